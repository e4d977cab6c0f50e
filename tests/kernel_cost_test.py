"""Every Pallas kernel declares its cost (`pl.CostEstimate`, pallas_kernels/common.py).

The estimate of a small shape against an independent hand count (flops = 4 x tokens x
keys x D x heads, one exp per logit, K/V pages + q + out bytes), the costs a traced
program declares (`common.declared_cost`) for the Triton and Mosaic GPU decode kernels,
and XLA's own `compiled.cost_analysis()` of the TPU kernel compiled deviceless for a v5e:
Mosaic TPU hands the estimate to XLA, so the compiled flops are the kernel's (the Triton
and Mosaic GPU lowerings of jax 0.10 / 0.11 drop it: XLA's GPU analysis cannot see them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import common

# A small decode shape: 8 sequences, 8 / 2 heads of 64, 4 pages of 16 a sequence.
B, HQ, HKV, D, BS, P, NB = 8, 8, 2, 64, 16, 4, 64


def _hand(q_rows_per_kv_head, kv_len, page_bytes=2, q_bytes=2):
  """Hand count for B queries each reading its own kv_len keys of every KV head."""
  rows = B * HKV * q_rows_per_kv_head
  flops = 2 * rows * kv_len * D + 2 * rows * kv_len * D          # QK^T, then PV
  kv = B * kv_len * HKV * D * page_bytes * 2                      # K and V
  return flops, rows * kv_len, kv + rows * D * 2 * q_bytes


def test_attention_cost_matches_a_hand_count():
  got = common.attention_cost(q_tokens=B, num_q_heads=HQ, kv_len=P * BS, kv_reads=B * P * BS,
                              num_kv_heads=HKV, head_dim=D, page_dtype=jnp.bfloat16,
                              q_dtype=jnp.bfloat16)
  flops, exps, nbytes = _hand(HQ // HKV, P * BS)
  assert (got.flops, got.transcendentals, got.bytes_accessed) == (flops, exps, nbytes)
  capped = common.attention_cost(q_tokens=B, num_q_heads=HQ, kv_len=P * BS,
                                 kv_reads=B * P * BS, num_kv_heads=HKV, head_dim=D,
                                 page_dtype=jnp.int8, q_dtype=jnp.float32, quantized=True,
                                 soft_cap=30.0)
  assert capped.transcendentals == 2 * exps
  kv_int8 = B * P * BS * HKV * (D + 4) * 2                        # int8 rows + f32 scales
  assert capped.bytes_accessed == kv_int8 + B * HQ * D * 8


def _decode_args(seed=0):
  rng = np.random.default_rng(seed)
  bf16 = jnp.bfloat16
  q = jnp.asarray(rng.standard_normal((B, HQ, D)), bf16)
  k = jnp.asarray(rng.standard_normal((HKV, NB, BS, D)), bf16)
  tables = jnp.asarray(rng.permutation(NB)[:B * P].reshape(B, P), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, P * BS + 1, B), jnp.int32)
  return q, k, k, tables, lengths


@pytest.mark.parametrize("backend,rows", [("triton", 16), ("mosaic_gpu", 64)])
def test_gpu_kernels_declare_their_padded_work(backend, rows):
  """The GQA group (4 rows) is padded to the kernel's row block (Triton 16, wgmma 64):
  the declared flops are the rows the kernel computes, as traced (no GPU needed)."""
  from pallas_kernels.mosaic_gpu import pipeline  # pylint: disable=g-import-not-at-top
  if backend == "mosaic_gpu" and pipeline.plgpu is None:
    pytest.skip("no Mosaic GPU Pallas in this jax")
  f = lambda *a: pallas_kernels.paged_attention(*a, backend=backend, num_splits=1)
  cost = common.declared_cost(jax.make_jaxpr(f)(*_decode_args()))
  flops, exps, _ = _hand(rows, P * BS)
  assert (cost["kernels"], cost["undeclared"]) == (1, 0)
  assert (cost["flops"], cost["transcendentals"]) == (flops, exps)


def test_declared_cost_counts_a_scan_body_per_iteration():
  f = lambda *a: pallas_kernels.paged_attention(*a, backend="triton", num_splits=1)
  args = _decode_args()
  one = common.declared_cost(jax.make_jaxpr(f)(*args))
  scanned = lambda *a: jax.lax.scan(lambda c, _: (c, f(*a)), 0, None, length=3)[1]
  three = common.declared_cost(jax.make_jaxpr(scanned)(*args))
  assert three["flops"] == 3 * one["flops"] and three["kernels"] == 3


def test_tpu_compiled_cost_analysis_sees_the_kernel():
  """XLA's cost analysis of the TPU decode kernel compiled for a v5e reports the declared
  flops (nonzero: it counted nothing inside a custom call before the estimate)."""
  from pallas_kernels.tpu import compile_target as ct  # pylint: disable=g-import-not-at-top
  if ct.unavailable_reason() is not None:
    pytest.skip(ct.unavailable_reason())
  f = lambda *a: pallas_kernels.paged_attention(*a, backend="tpu")
  host = _decode_args()
  with ct.tpu_target("v5e") as dev:
    args = ct.place(host, dev)
    declared = common.declared_cost(jax.make_jaxpr(f)(*args))
    compiled = jax.jit(f).trace(*args).lower().compile().cost_analysis()
  compiled = compiled[0] if isinstance(compiled, list) else compiled
  flops, exps, _ = _hand(HQ // HKV, P * BS)
  assert declared["flops"] == flops
  # The wrapper around the kernel (reshapes, a cast) adds well under 1%.
  assert flops <= compiled["flops"] <= 1.01 * flops, (compiled["flops"], flops)
  assert compiled["transcendentals"] >= exps
  assert compiled["bytes accessed"] >= declared["bytes_accessed"]
