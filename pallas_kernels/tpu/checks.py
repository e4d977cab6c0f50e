"""Argument checks of the TPU paged-attention entries: one-line ValueErrors before tracing.

Every message names the argument and what is allowed. Shapes follow reference.py:
q [B or T, Hq, D]; pages [Hkv, NB, bs, D]; scales f32[Hkv, NB, bs]; block_tables
i32[rows, P].
"""

from __future__ import annotations

import math

import jax.numpy as jnp

QUANTIZED_PAGE_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
FLOAT_DTYPES = ("bfloat16", "float32")
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def _shape(x):
  return tuple(getattr(x, "shape", ()))


def _dtype(x):
  return jnp.dtype(getattr(x, "dtype", jnp.float32)).name


def _integer(name, x):
  if not jnp.issubdtype(jnp.dtype(getattr(x, "dtype", jnp.int32)), jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {_dtype(x)}")


def check_common(q, k_pages, v_pages, block_tables, *, rows_name, num_rows, sm_scale,
                 soft_cap, sliding_window, k_scales, v_scales):
  """Checks shared by both entries. Returns (num_q_heads, num_kv_heads, head_dim)."""
  if len(_shape(q)) != 3:
    raise ValueError(f"q must have shape [{rows_name}, num_q_heads, head_dim], "
                     f"got {_shape(q)}")
  if _dtype(q) not in FLOAT_DTYPES:
    raise ValueError(f"q.dtype must be one of {FLOAT_DTYPES}, got {_dtype(q)}")
  if len(_shape(k_pages)) != 4:
    raise ValueError("k_pages must have shape [num_kv_heads, num_blocks, block_size, "
                     f"head_dim], got {_shape(k_pages)}")
  if _shape(v_pages) != _shape(k_pages) or _dtype(v_pages) != _dtype(k_pages):
    raise ValueError(f"v_pages must match k_pages ({_shape(k_pages)} {_dtype(k_pages)}), "
                     f"got {_shape(v_pages)} {_dtype(v_pages)}")
  num_kv_heads, num_blocks, block_size, head_dim = _shape(k_pages)
  num_q_heads = _shape(q)[1]
  if _shape(q)[2] != head_dim:
    raise ValueError(f"q head_dim {_shape(q)[2]} must equal the pages' head_dim {head_dim}")
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_q_heads={num_q_heads}")
  if block_size not in SUPPORTED_BLOCK_SIZES:
    raise ValueError(f"block_size={block_size} must be one of {SUPPORTED_BLOCK_SIZES}")
  if num_blocks < 1:
    raise ValueError(f"k_pages must hold at least one block, got num_blocks={num_blocks}")
  page_dtype = _dtype(k_pages)
  if page_dtype not in FLOAT_DTYPES + QUANTIZED_PAGE_DTYPES:
    raise ValueError(f"k_pages.dtype must be one of {FLOAT_DTYPES + QUANTIZED_PAGE_DTYPES}"
                     f", got {page_dtype}")
  if (k_scales is None) != (v_scales is None):
    raise ValueError("k_scales and v_scales must be given together")
  if page_dtype in QUANTIZED_PAGE_DTYPES and k_scales is None:
    raise ValueError(f"{page_dtype} pages need k_scales / v_scales "
                     f"f32[{num_kv_heads}, {num_blocks}, {block_size}]")
  rows = (num_kv_heads, -(-num_blocks * block_size // 128), 128)
  for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
    if s is not None and _shape(s) not in ((num_kv_heads, num_blocks, block_size), rows):
      raise ValueError(f"{name} must have shape {(num_kv_heads, num_blocks, block_size)} "
                       f"(or scale rows {rows}, see tpu/scales.py), got {_shape(s)}")
  if len(_shape(block_tables)) != 2 or _shape(block_tables)[0] != num_rows:
    raise ValueError(f"block_tables must have shape [{num_rows}, pages_per_seq], "
                     f"got {_shape(block_tables)}")
  if _shape(block_tables)[1] < 1:
    raise ValueError("block_tables must have at least one page per sequence")
  _integer("block_tables", block_tables)
  if sm_scale is not None and not math.isfinite(float(sm_scale)):
    raise ValueError(f"sm_scale={sm_scale} must be a finite float or None")
  if soft_cap is not None and not float(soft_cap) > 0:
    raise ValueError(f"soft_cap={soft_cap} must be > 0 or None")
  if sliding_window is not None and (int(sliding_window) != sliding_window
                                     or sliding_window < 1):
    raise ValueError(f"sliding_window={sliding_window} must be an int >= 1 or None")
  return num_q_heads, num_kv_heads, head_dim


def kernel_semantics(head_dim, sm_scale, soft_cap, sliding_window) -> dict:
  """The kernels' static semantic arguments (after `check_common`): sm_scale a float
  (1/sqrt(head_dim) when None), soft_cap a float or None, sliding_window an int or None."""
  return dict(sm_scale=1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale),
              soft_cap=None if soft_cap is None else float(soft_cap),
              sliding_window=None if sliding_window is None else int(sliding_window))


def check_vector(name, x, length):
  if _shape(x) != (length,):
    raise ValueError(f"{name} must have shape ({length},), got {_shape(x)}")
  _integer(name, x)
