"""Test support for the CUDA lowering tests (tests/cuda_lowering*_test.py)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.deviceless import target as compile_target


def triton_call():
  """The Pallas Triton custom-call target of this JAX version (read, never assumed)."""
  try:
    targets = compile_target.pallas_gpu_call_targets()
  except RuntimeError as e:
    pytest.skip(str(e))
  assert len(targets) == 1, targets
  return targets[0]


def page_args(num_kv_heads, num_blocks, block_size, head_dim, page_dtype):
  """Abstract K/V pages and, for int8 / fp8 pages, their f32 scales (else None)."""
  sds = jax.ShapeDtypeStruct
  pages = sds((num_kv_heads, num_blocks, block_size, head_dim), page_dtype)
  quantized = jnp.dtype(page_dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
  scales = sds((num_kv_heads, num_blocks, block_size), jnp.float32) if quantized else None
  return pages, scales
