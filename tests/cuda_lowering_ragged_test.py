"""The ragged paged attention kernel lowers for CUDA on a CPU-only machine.

`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` runs the Pallas -> Triton
lowering (tensor shapes, supported ops, dtype casts, 64-bit offsets) from shapes alone.
For every configuration the engine and the benchmarks use, and for each feature of the
kernel, the module must hold only Triton custom calls (one or two launches) carrying our
kernel, and the
paged K/V arrays must enter it untouched: no gather or slice outside the kernel makes a
contiguous copy of the cache. (Triton -> PTX happens only on a GPU: experiments/gpu_check.sh.)
"""

import re

import jax
import jax.numpy as jnp
import pytest

from experiments import ragged_bench
from paged_jax import attention
from pallas_kernels.triton.ragged_paged_attention import ragged_paged_attention  # Triton kernel

from pallas_kernels.deviceless import target as compile_target

import lowering_support


_IR_DTYPE = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16",
             jnp.dtype(jnp.float16): "f16", jnp.dtype(jnp.int8): "i8",
             jnp.dtype(jnp.float8_e4m3fn): "f8E4M3FN"}


def lower_ragged(*, num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
                 pages_per_seq, num_blocks=None, dtype=jnp.bfloat16, page_dtype=None,
                 via_dispatch=False, **kw):
  """Lowers one ragged call for CUDA from shapes only; returns (text, pages IR type)."""
  page_dtype = page_dtype or dtype
  num_blocks = num_blocks or num_seqs * pages_per_seq
  sds = jax.ShapeDtypeStruct
  q = sds((num_tokens, num_q_heads, head_dim), dtype)
  pages, scales = lowering_support.page_args(num_kv_heads, num_blocks, block_size, head_dim,
                                                page_dtype)
  tables = sds((num_seqs, pages_per_seq), jnp.int32)
  kv_lens = sds((num_seqs,), jnp.int32)
  cu_q_lens = sds((num_seqs + 1,), jnp.int32)
  live = sds((), jnp.int32)

  def f(q, k, v, tables, kv_lens, cu_q_lens, live, k_scales, v_scales):
    if via_dispatch:
      return attention.ragged_paged_attention(q, k, v, tables, kv_lens, cu_q_lens, live,
                                              backend="pallas:triton", k_scales=k_scales,
                                              v_scales=v_scales, **kw)
    return ragged_paged_attention(q, k, v, tables, kv_lens, cu_q_lens, live,
                                  k_scales=k_scales, v_scales=v_scales, **kw)

  text = compile_target.lower_for_gpu_or_platform(jax.jit(f), q, pages, pages, tables,
                                                  kv_lens, cu_q_lens, live, scales, scales)
  pages_type = (f"tensor<{num_kv_heads}x{num_blocks}x{block_size}x{head_dim}x"
                f"{_IR_DTYPE[jnp.dtype(page_dtype)]}>")
  return text, pages_type


def assert_triton_kernel(text, pages_type):
  calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  triton_call = lowering_support.triton_call()
  # One launch for short (decode) sequences, one for prefill chunks (or a single one).
  assert calls in ([triton_call], [triton_call] * 2), calls
  assert "ragged_paged_attention_tq" in text  # our kernel, by its pallas_call name
  call_lines = [l for l in text.splitlines() if triton_call in l]
  for line in call_lines:
    assert pages_type in line, "the pages must be operands of the kernel"
  for line in text.splitlines():
    if any(op in line for op in ("stablehlo.gather", "slice", "stablehlo.transpose",
                                 "stablehlo.convert", "stablehlo.pad")):
      assert pages_type not in line, f"the paged cache is copied outside the kernel: {line}"


@pytest.mark.parametrize("cfg", ragged_bench.lowering_configs(), ids=lambda c: c["name"])
def test_benchmark_configs_lower(cfg):
  cfg = dict(cfg)
  cfg.pop("name")
  text, pages_type = lower_ragged(**cfg)
  assert_triton_kernel(text, pages_type)


@pytest.mark.parametrize("cfg", [
    # Engine: the shipped tiny byte Llama (4 query / 2 KV heads, D 32, f32), decode-only
    # and chunked-prefill steps, through the dispatch the model calls.
    dict(num_tokens=8, num_seqs=8, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
         pages_per_seq=64, dtype=jnp.float32, via_dispatch=True),
    dict(num_tokens=256, num_seqs=8, num_q_heads=4, num_kv_heads=2, head_dim=32,
         block_size=16, pages_per_seq=64, dtype=jnp.float32, via_dispatch=True),
    # A Llama-3-8B-like layer in bf16 with a 2048-token budget.
    dict(num_tokens=2048, num_seqs=64, num_q_heads=32, num_kv_heads=8, head_dim=128,
         block_size=16, pages_per_seq=256, via_dispatch=True),
    # Block sizes 1 .. 256, GQA ratios 1 .. 8 (and 3, padded), head_dim 16 .. 256.
    dict(num_tokens=64, num_seqs=8, num_q_heads=8, num_kv_heads=8, head_dim=64, block_size=1,
         pages_per_seq=512),
    dict(num_tokens=64, num_seqs=8, num_q_heads=16, num_kv_heads=8, head_dim=128,
         block_size=8, pages_per_seq=128),
    dict(num_tokens=64, num_seqs=8, num_q_heads=16, num_kv_heads=4, head_dim=16,
         block_size=32, pages_per_seq=32),
    dict(num_tokens=64, num_seqs=8, num_q_heads=64, num_kv_heads=8, head_dim=128,
         block_size=64, pages_per_seq=16),
    dict(num_tokens=64, num_seqs=8, num_q_heads=12, num_kv_heads=4, head_dim=64,
         block_size=128, pages_per_seq=8),
    dict(num_tokens=64, num_seqs=8, num_q_heads=8, num_kv_heads=1, head_dim=256,
         block_size=256, pages_per_seq=8),
    # Dtypes: fp16, fp32 (IEEE dots), int8 and fp8 pages with scales.
    dict(num_tokens=128, num_seqs=8, num_q_heads=16, num_kv_heads=4, head_dim=128,
         block_size=16, pages_per_seq=64, dtype=jnp.float16),
    dict(num_tokens=128, num_seqs=8, num_q_heads=16, num_kv_heads=4, head_dim=64,
         block_size=16, pages_per_seq=64, dtype=jnp.float32),
    dict(num_tokens=128, num_seqs=8, num_q_heads=32, num_kv_heads=8, head_dim=128,
         block_size=16, pages_per_seq=64, page_dtype=jnp.int8),
    dict(num_tokens=128, num_seqs=8, num_q_heads=32, num_kv_heads=8, head_dim=128,
         block_size=16, pages_per_seq=64, page_dtype=jnp.float8_e4m3fn),
    dict(num_tokens=128, num_seqs=8, num_q_heads=8, num_kv_heads=2, head_dim=64,
         block_size=16, pages_per_seq=64, dtype=jnp.float32, page_dtype=jnp.int8),
    # Features and knobs.
    dict(num_tokens=256, num_seqs=4, num_q_heads=32, num_kv_heads=8, head_dim=128,
         block_size=16, pages_per_seq=256, soft_cap=30.0, sliding_window=1024,
         sm_scale=0.1),
    dict(num_tokens=4, num_seqs=4, num_q_heads=32, num_kv_heads=8, head_dim=128,
         block_size=16, pages_per_seq=2048, kv_splits=16),
    dict(num_tokens=512, num_seqs=16, num_q_heads=32, num_kv_heads=8, head_dim=128,
         block_size=16, pages_per_seq=64, q_per_tile=16, kv_per_tile=64, num_warps=8,
         num_stages=3),
    # head_dim not a power of two (computed as 128 / 128), f32 and bf16.
    dict(num_tokens=64, num_seqs=4, num_q_heads=32, num_kv_heads=8, head_dim=80,
         block_size=16, pages_per_seq=16, dtype=jnp.float32),
    dict(num_tokens=64, num_seqs=4, num_q_heads=16, num_kv_heads=4, head_dim=96,
         block_size=32, pages_per_seq=16, kv_splits=4),
])
def test_kernel_configs_lower(cfg):
  assert_triton_kernel(*lower_ragged(**cfg))


def test_pool_over_4gib_lowers():
  # One KV head's pages span more than 2**32 bytes: 64-bit pointer offsets.
  text, pages_type = lower_ragged(num_tokens=256, num_seqs=256, num_q_heads=32,
                                  num_kv_heads=8, head_dim=128, block_size=16,
                                  pages_per_seq=2048, num_blocks=256 * 2048)
  assert_triton_kernel(text, pages_type)
