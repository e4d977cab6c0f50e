"""The paged decode kernel lowers for CUDA on a CPU-only machine.

`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` runs the Pallas -> Triton
lowering (tile shapes, supported ops, dtypes) without a GPU. For every configuration the
kernel benchmark (experiments/kernel_bench.py) and the engine use, the lowered module must
hold the Triton custom call carrying our kernel, and no gather of the paged cache outside
it (the kernel reads the block table itself). The final Triton -> PTX compile happens only
on a GPU (experiments/gpu_check.sh).

The ragged kernel's lowering tests live in their own file.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from paged_jax import attention
from pallas_kernels.triton.paged_attention import paged_attention  # the Triton kernel itself

from pallas_kernels.deviceless import target as compile_target

import lowering_support


def lower_decode(*, batch, num_q_heads, num_kv_heads, head_dim, block_size, pages_per_seq,
                 num_blocks=None, dtype=jnp.bfloat16, page_dtype=None, via_dispatch=False,
                 **kw):
  """Lowers one decode call for CUDA from shapes only (nothing is allocated)."""
  page_dtype = page_dtype or dtype
  num_blocks = num_blocks or batch * pages_per_seq
  sds = jax.ShapeDtypeStruct
  q = sds((batch, num_q_heads, head_dim), dtype)
  pages, scales = lowering_support.page_args(num_kv_heads, num_blocks, block_size, head_dim,
                                                page_dtype)
  tables = sds((batch, pages_per_seq), jnp.int32)
  lengths = sds((batch,), jnp.int32)

  def f(q, k, v, tables, lengths, k_scales, v_scales):
    if via_dispatch:
      return attention.paged_attention(q, k, v, tables, lengths, backend="pallas:triton",
                                       k_scales=k_scales, v_scales=v_scales, **kw)
    return paged_attention(q, k, v, tables, lengths, k_scales=k_scales, v_scales=v_scales,
                           **kw)

  # Placed on a compile-only H200 (jax 0.10 and 0.11); jax 0.10 without the plugin
  # lowers with lowering_platforms=("cuda",).
  return compile_target.lower_for_gpu_or_platform(jax.jit(f), q, pages, pages, tables,
                                                  lengths, scales, scales)


def assert_triton_kernel(text, block_size):
  calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  assert calls == [lowering_support.triton_call()], calls
  assert f"paged_decode_bs{block_size}_" in text  # our kernel, by its pallas_call name
  # The pages enter the custom call as they are: no gather builds a contiguous copy.
  assert "stablehlo.gather" not in text and "stablehlo.dynamic_slice" not in text


# kernel_bench.py's GPU grid: batch x context x block size, 32 query / 8 KV heads, D 128, bf16.
BENCH = list(itertools.product([1, 8, 64, 256], [512, 4096, 32768], [16, 128]))


@pytest.mark.parametrize("batch,context,block_size", BENCH)
def test_benchmark_configs_lower(batch, context, block_size):
  pages_per_seq = context // block_size
  text = lower_decode(batch=batch, num_q_heads=32, num_kv_heads=8, head_dim=128,
                      block_size=block_size, pages_per_seq=pages_per_seq)
  assert_triton_kernel(text, block_size)


@pytest.mark.parametrize("cfg", [
    # Engine / model configs (tiny Llama f32, GQA 2; and a bf16 Llama-like layer).
    dict(batch=8, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
         pages_per_seq=64, dtype=jnp.float32, via_dispatch=True),
    dict(batch=64, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
         pages_per_seq=128, via_dispatch=True),
    # Every block size, MQA, fp16, long tables, knobs.
    dict(batch=4, num_q_heads=8, num_kv_heads=1, head_dim=64, block_size=8, pages_per_seq=256),
    dict(batch=4, num_q_heads=16, num_kv_heads=2, head_dim=64, block_size=32,
         pages_per_seq=64, dtype=jnp.float16),
    dict(batch=2, num_q_heads=8, num_kv_heads=8, head_dim=256, block_size=64, pages_per_seq=32),
    dict(batch=2, num_q_heads=32, num_kv_heads=4, head_dim=128, block_size=256,
         pages_per_seq=8, soft_cap=30.0, sliding_window=1000, num_splits=4),
    dict(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=1,
         pages_per_seq=512),
    dict(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4,
         pages_per_seq=128, tile_tokens=32, num_warps=8, num_stages=3),
    dict(batch=2, num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=256,
         pages_per_seq=16, tile_tokens=64),
    # Quantized pages.
    dict(batch=8, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
         pages_per_seq=64, page_dtype=jnp.int8),
    dict(batch=8, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
         pages_per_seq=64, page_dtype=jnp.float8_e4m3fn),
    dict(batch=8, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
         pages_per_seq=64, dtype=jnp.float32, page_dtype=jnp.int8),
    # float32 at D 128 (TF32 x3 dots, 64-token tiles) and head_dim 80 / 96 (padded).
    dict(batch=8, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
         pages_per_seq=64, dtype=jnp.float32),
    dict(batch=8, num_q_heads=32, num_kv_heads=8, head_dim=80, block_size=16,
         pages_per_seq=64),
    dict(batch=4, num_q_heads=16, num_kv_heads=4, head_dim=96, block_size=32,
         pages_per_seq=32, dtype=jnp.float32, num_splits=4),
])
def test_kernel_configs_lower(cfg):
  assert_triton_kernel(lower_decode(**cfg), cfg["block_size"])


def test_pool_over_4gib_lowers():
  # 64-bit offsets: one KV head's pages span more than 2**32 bytes.
  text = lower_decode(batch=256, num_q_heads=32, num_kv_heads=8, head_dim=128,
                      block_size=16, pages_per_seq=2048, num_blocks=256 * 2048)
  assert_triton_kernel(text, 16)
