"""Mosaic GPU ragged (prefill + decode) paged attention, GPU interpret mode vs the float64
oracle on poisoned caches, race detection on; deviceless sm_90a compile; and the engine end
to end on the Mosaic backend (interpret mode) against the reference backend.

Skips on jax < 0.11.2 (no usable Mosaic GPU interpreter). Error bound as the decode tests.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attention_oracle import make_cache, ragged_oracle, rel_err
import pallas_kernels
from pallas_kernels.deviceless import target as compile_target
from pallas_kernels.mosaic_gpu import paged_attention as mosaic_decode
from pallas_kernels.mosaic_gpu import ragged_paged_attention as mosaic

_SKIP = mosaic_decode.interpret_unavailable_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
TOL = 1e-2


def run_case(seed, *, q_lens, kv_lens, block_size=16, group=4, num_kv_heads=2, head_dim=128,
             num_seqs=None, pad_rows=3, dtype=ml_dtypes.bfloat16, via_package=False,
             quant=None, **kw):
  from mosaic_gpu_support import races_found  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  num_seqs = len(q_lens) if num_seqs is None else num_seqs
  pages = max(-(-n // block_size) for n in kv_lens) + 1
  need = sum(-(-n // block_size) for n in kv_lens)
  k, v, ks, vs, tables = make_cache(rng, num_kv_heads=num_kv_heads, num_blocks=need + 3,
                                    block_size=block_size, head_dim=head_dim,
                                    lengths=kv_lens, pages_per_seq=pages, dtype=dtype,
                                    quant=quant)
  if quant:
    kw = dict(kw, k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs))
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.normal(size=(int(cu[-1]) + pad_rows, num_kv_heads * group, head_dim)).astype(dtype)
  args = [jnp.asarray(x) for x in (q, k, v, tables, np.asarray(kv_lens, np.int32), cu)]
  if via_package:
    out = pallas_kernels.ragged_paged_attention(*args, num_seqs, interpret=True,
                                                gpu_backend="mosaic_gpu", **kw)
  else:
    out = mosaic.ragged_paged_attention(*args, num_seqs, interpret=True, **kw)
  out = jax.block_until_ready(out)
  assert not races_found(), "GPU interpret mode reported a race"
  assert out.shape == q.shape and out.dtype == q.dtype
  out = np.asarray(out.astype(jnp.float32))
  assert np.isfinite(out).all(), "NaN/inf: a stale page reached the output"
  assert np.all(out[cu[num_seqs]:] == 0), "padding rows must be zeros"
  if quant:  # the oracle takes dequantized float64 pages
    k = k.astype(np.float64) * ks[..., None]
    v = v.astype(np.float64) * vs[..., None]
  want = ragged_oracle(q, k, v, tables, kv_lens, cu, num_seqs,
                       sm_scale=kw.get("sm_scale") or 1 / math.sqrt(head_dim),
                       soft_cap=kw.get("soft_cap"), window=kw.get("sliding_window"))
  return rel_err(out, want)


def test_mixed_batch_with_chunked_prefill_and_splits():
  """Decode rows, a prefill chunk starting mid-page, one spanning several q tiles; 2 splits,
  soft cap and window; the package entry with gpu_backend="mosaic_gpu"."""
  err = run_case(0, q_lens=[1, 5, 40, 1], kv_lens=[10, 70, 100, 1], num_splits=2,
                 soft_cap=3.0, sliding_window=20, via_package=True)
  assert err <= TOL, err


def test_odd_group_dead_sequences_and_page_slices():
  """G = 7 (Qwen-like 14/2, D 64), num_seqs < S; then pages bigger than a kv tile."""
  err = run_case(1, q_lens=[3, 20, 1], kv_lens=[3, 90, 200], group=7, head_dim=64,
                 num_seqs=2)
  assert err <= TOL, err
  err = run_case(2, q_lens=[30, 1], kv_lens=[300, 257], block_size=256, q_per_tile=4,
                 num_splits=3)
  assert err <= TOL, err


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("block_size,group,head_dim", [(16, 1, 64), (32, 8, 256),
                                                       (64, 4, 128), (128, 2, 128)])
def test_wide_grid(block_size, group, head_dim):
  err = run_case(block_size + group + head_dim, q_lens=[1, 0, 17, 64, 1],
                 kv_lens=[1, 5, 3 * block_size + 1, 200, 700], block_size=block_size,
                 group=group, head_dim=head_dim, num_kv_heads=1 if group == 8 else 2,
                 dtype=np.float16 if head_dim == 64 else ml_dtypes.bfloat16)
  assert err <= TOL, err


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_quantized_pages(quant):
  err = run_case(9, q_lens=[1, 12, 1], kv_lens=[33, 80, 150], quant=quant, num_splits=2,
                 via_package=True)
  assert err <= TOL, err


def test_deviceless_sm90_compile_llama8b_prefill_step():
  """A 256-token mixed step at Llama-3-8B attention shape compiles: 0 spills, smem fits."""
  why = compile_target.unavailable_reason()
  if why:
    pytest.skip(why)
  from mosaic_gpu_support import mosaic_resources  # pylint: disable=g-import-not-at-top
  a = compile_target.abstract
  seqs, pages, bs = 32, 64, 64
  fn = lambda q, k, v, t, l, cu: pallas_kernels.ragged_paged_attention(
      q, k, v, t, l, cu, seqs, gpu_backend="mosaic_gpu")
  kernels, report = mosaic_resources(
      fn, a((256, 32, 128), jnp.bfloat16), a((8, seqs * pages, bs, 128), jnp.bfloat16),
      a((8, seqs * pages, bs, 128), jnp.bfloat16), a((seqs, pages), jnp.int32),
      a((seqs,), jnp.int32), a((seqs + 1,), jnp.int32))
  assert len(kernels) == 1, kernels
  print(kernels[0], "xla temp bytes", report.temp_bytes)
  assert kernels[0].spill_bytes == 0 and kernels[0].registers <= 255
  assert kernels[0].shared_memory <= compile_target.SM90_SHARED_MEMORY_BYTES


@pytest.mark.slow
def test_engine_end_to_end_mosaic_interpret_equals_reference():
  """A 1-layer bf16 Llama (D 64, pages of 16) through the engine: greedy tokens on the
  Mosaic backend in interpret mode equal the reference backend's."""
  from paged_jax.config import CacheConfig, ModelConfig  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine, SamplingParams  # pylint: disable=g-import-not-at-top
  from paged_jax.models import llama  # pylint: disable=g-import-not-at-top
  mc = ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=128, num_layers=1,
                   num_heads=2, num_kv_heads=1, max_position_embeddings=256,
                   dtype="bfloat16")
  params = jax.tree_util.tree_map(lambda x: x * 8.0 if x.ndim == 2 else x,
                                  llama.init_params(mc, jax.random.key(0)))
  cc = CacheConfig(block_size=16, num_blocks=16, max_seqs=2, max_blocks_per_seq=4,
                   num_layers=1, num_kv_heads=1, head_dim=mc.head_dim, dtype="bfloat16")
  prompts = [[1, 2, 3, 4, 5], list(range(10, 30))]
  outs = {}
  for backend in ("reference", "pallas_interpret:mosaic_gpu"):
    engine = Engine(mc, params, cc, max_num_batched_tokens=32, attention_backend=backend)
    outs[backend] = [o.outputs for o in engine.generate(
        prompts, SamplingParams(max_tokens=4, temperature=0.0))]
  assert outs["pallas_interpret:mosaic_gpu"] == outs["reference"], outs
