"""Defaults and argument checks of the paged decode kernel (pallas_kernels/paged_attention.py).

`validate` runs on static shapes / dtypes / knobs before any tracing and raises a one-line
ValueError naming the argument and its allowed range (for tile sizes and stages: the sm_90
shared-memory budget they would break, from pallas_kernels/tuning.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.triton import tuning

_MIN_TILE_TOKENS = 16
SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_PAGE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")
_Q_DTYPES = ("float32", "bfloat16", "float16")


def default_num_splits(batch: int, num_kv_heads: int, pages_per_seq: int, block_size: int,
                       tile_tokens: int, target_programs: int = 528,
                       max_splits: int = 32) -> int:
  """Split-K heuristic: programs for about two waves of resident blocks (132 SMs x 2
  blocks of 256 threads at ~128 registers on H100/H200: 528), without splits shorter than
  two page tiles of the longest sequence the table can hold. B=64 x 8 KV heads at 4K
  context: 2 splits (1,024 programs) instead of 512 programs for 264 slots."""
  max_tiles = -(-pages_per_seq // max(1, tile_tokens // block_size))
  want = -(-target_programs // (batch * num_kv_heads))
  return int(max(1, min(want, max_tiles // 2, max_splits)))


def default_tile_tokens(block_size: int, head_dim: int, dtype=jnp.bfloat16) -> int:
  """Tokens per loop step (tuning.decode_defaults): 128 for 2-byte dtypes at D <= 128,
  halved for D > 128 and for float32; at least 16 (Triton dot)."""
  del block_size  # Pages smaller than the tile are grouped, bigger ones sliced.
  head_dim_p = tuning.padded_head_dim(head_dim)
  return tuning.decode_defaults(dtype, head_dim_p, padded=head_dim_p != head_dim).tile_tokens


def default_num_warps(tile_tokens: int, head_dim: int, dtype=jnp.bfloat16) -> int:
  """8 warps for big tiles and for float32, else 4 (tuning.decode_defaults)."""
  wide = jnp.dtype(dtype).itemsize >= 4
  return 8 if wide or tile_tokens * tuning.padded_head_dim(head_dim) >= 64 * 128 else 4


def _dtype_name(x) -> str:
  return jnp.dtype(x.dtype).name


def validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sm_scale,
              soft_cap, sliding_window, num_splits, tile_tokens, num_warps, num_stages):
  """Shape / dtype / range checks on static information, before any tracing or device work."""
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {q.shape}")
  if k_pages.ndim != 4:
    raise ValueError("k_pages must be [num_kv_heads, num_blocks, block_size, head_dim], "
                     f"got shape {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, page_head_dim = k_pages.shape
  if page_head_dim != head_dim:
    raise ValueError(f"k_pages head_dim {page_head_dim} must equal q head_dim {head_dim}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_q_heads={num_q_heads}")
  if block_size not in SUPPORTED_BLOCK_SIZES:
    raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size}")
  if head_dim < 16 or head_dim > 256:
    raise ValueError(f"head_dim must be in [16, 256] (computed padded to a power of two), "
                     f"got {head_dim}")
  if _dtype_name(q) not in _Q_DTYPES:
    raise ValueError(f"q dtype must be one of {_Q_DTYPES}, got {_dtype_name(q)}")
  page_dtype = _dtype_name(k_pages)
  if page_dtype not in _PAGE_DTYPES or _dtype_name(v_pages) != page_dtype:
    raise ValueError(f"k_pages/v_pages dtype must be one (the same) of {_PAGE_DTYPES}, "
                     f"got {page_dtype} / {_dtype_name(v_pages)}")
  quantized = page_dtype in ("int8", "float8_e4m3fn")
  if quantized and (k_scales is None or v_scales is None):
    raise ValueError(f"{page_dtype} pages need k_scales and v_scales")
  if not quantized and page_dtype != _dtype_name(q):
    raise ValueError(f"unquantized pages must have q's dtype {_dtype_name(q)}, "
                     f"got {page_dtype}")
  for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
    if s is not None and (s.shape != k_pages.shape[:3] or _dtype_name(s) != "float32"):
      raise ValueError(f"{name} must be f32{list(k_pages.shape[:3])}, "
                       f"got {_dtype_name(s)}{list(s.shape)}")
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(f"block_tables must be i32[{batch}, pages_per_seq], "
                     f"got shape {block_tables.shape}")
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must be i32[{batch}], got shape {lengths.shape}")
  for name, a in (("block_tables", block_tables), ("lengths", lengths)):
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array, got {a.dtype}")
  if sm_scale is not None and not (np.isfinite(sm_scale) and sm_scale > 0):
    raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale}")
  if soft_cap is not None and not (np.isfinite(soft_cap) and soft_cap > 0):
    raise ValueError(f"soft_cap must be a finite number > 0, got {soft_cap}")
  if sliding_window is not None and (int(sliding_window) != sliding_window
                                     or sliding_window < 1):
    raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window}")
  if num_splits is not None and (int(num_splits) != num_splits or not 1 <= num_splits <= 256):
    raise ValueError(f"num_splits must be an int in [1, 256], got {num_splits}")
  head_dim_p = tuning.padded_head_dim(head_dim)
  stages = 3 if num_stages is None else num_stages
  if num_stages is not None:
    tuning.check_knob("num_stages", num_stages, 1, 4, why="Triton software pipelining")
  buffers = tuning.kv_buffers("decode", stages)
  top = tuning.max_tile(head_dim_p, k_pages.dtype, q.dtype, buffers)
  if tile_tokens is not None:
    tuning.check_knob("tile_tokens", tile_tokens, _MIN_TILE_TOKENS, top, pow2=True,
                      why=f"Triton dot >= 16; above {top}, {stages} stages of K/V tiles at "
                      f"head_dim {head_dim_p} exceed the sm_90 shared-memory budget of "
                      f"{tuning.SHARED_MEMORY_BUDGET:,} B")
  if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps}")
  tile = tile_tokens if tile_tokens is not None else default_tile_tokens(
      block_size, head_dim, q.dtype)
  tuning.check_shared_memory(knob="num_stages", value=stages, tile=tile,
                             head_dim_p=head_dim_p, page_dtype=k_pages.dtype,
                             compute_dtype=q.dtype, buffers=buffers)
