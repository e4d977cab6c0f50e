"""Per-token int8 / fp8 scales as *scale rows*: the layout the TPU kernels read in place.

Two shapes hold the same numbers in the same flat slot order (slot t = block * bs + offset):

    blocks f32[Hkv, NB, bs]                    reference.py's shape, every other backend's
    rows   f32[Hkv, ceil(NB * bs / 128), 128]  slot t of head h at rows[h, t // 128, t % 128]

Rows pad the flat slots up to a multiple of 128 (padding is never read, written or
copied). Why a TPU wants rows: for bs < 128 the blocks shape has no layout a Pallas
operand can take without a copy (XLA's default puts NB minor; row-major pads bs to 128
lanes, 8x the bytes at bs 16), so XLA copies the whole array before every kernel call;
rows are row-major in XLA's default TPU layout (tpu/scales.py reads them in the kernels).
At bs = 128 the two shapes are the same array; `is_rows` calls that blocks.

A block's scales are one window of rows: `rows_per_page(bs)` rows by `min(bs, 128)` lanes
starting at row `b * bs // 128`, lane `b * bs % 128`. `gather_blocks` / `set_blocks` move
whole blocks (copy-on-write, swap, zeroing) through those windows, on the rows array
itself: a reshape to blocks or to a flat [Hkv, NB * bs] view would be a relayout copy of
the whole array on a TPU. No Pallas import here: the engine's cache ops use this module on
every backend.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

LANES = 128


def rows_per_page(block_size: int) -> int:
  """Rows one block's scales span (1 for bs <= 128)."""
  return max(1, block_size // LANES)


def num_rows(num_blocks: int, block_size: int) -> int:
  """R = ceil(NB * bs / 128)."""
  return -(-num_blocks * block_size // LANES)


def rows_shape(num_kv_heads: int, num_blocks: int, block_size: int):
  return (num_kv_heads, num_rows(num_blocks, block_size), LANES)


def is_rows(scales, num_blocks: int, block_size: int) -> bool:
  """Whether `scales` [Hkv, ., .] is in the rows shape (and not also the blocks shape)."""
  shape = tuple(scales.shape)[1:]
  return shape != (num_blocks, block_size) and shape == rows_shape(1, num_blocks,
                                                                  block_size)[1:]


def as_rows(scales, num_blocks: int, block_size: int):
  """f32[Hkv, NB, bs] (blocks) or f32[Hkv, R, 128] (rows) -> rows f32[Hkv, R, 128]."""
  heads = scales.shape[0]
  r = num_rows(num_blocks, block_size)
  if tuple(scales.shape) == (heads, r, LANES):
    return scales.astype(jnp.float32)
  flat = scales.astype(jnp.float32).reshape(heads, num_blocks * block_size)
  pad = r * LANES - num_blocks * block_size
  if pad:
    flat = jnp.pad(flat, ((0, 0), (0, pad)))
  return flat.reshape(heads, r, LANES)


def as_blocks(scales, num_blocks: int, block_size: int):
  """Rows f32[Hkv, R, 128] (or blocks, returned as they are) -> blocks f32[Hkv, NB, bs]."""
  if not is_rows(scales, num_blocks, block_size):
    return scales
  heads = scales.shape[0]
  flat = scales.reshape(heads, -1)[:, :num_blocks * block_size]
  return flat.reshape(heads, num_blocks, block_size)


def _starts(block_ids, block_size: int):
  """i32[n, 2] (row, lane) of each block's window."""
  first = block_ids.astype(jnp.int32) * block_size
  return jnp.stack([lax.div(first, LANES), lax.rem(first, LANES)], axis=1)


def _window(rows, block_size: int):
  return (rows.shape[0], rows_per_page(block_size), min(block_size, LANES))


def gather_blocks(rows, block_ids, block_size: int):
  """Blocks `block_ids` i32[n] (each in [0, NB)) of rows f32[Hkv, R, 128] -> f32[Hkv, n, bs].

  Whole rows are gathered (a block's row(s); a TPU gathers 128-lane rows in place, where a
  gather of bs-lane windows made XLA relayout the whole array), then each block's lanes
  are picked out of those n rows."""
  heads, rpp = rows.shape[0], rows_per_page(block_size)
  first = block_ids.astype(jnp.int32) * block_size
  row_ids = lax.div(first, LANES)[:, None] + jnp.arange(rpp, dtype=jnp.int32)   # [n, rpp]
  picked = rows[:, row_ids.reshape(-1)].reshape(heads, -1, rpp * LANES)   # [Hkv, n, rpp*128]
  if block_size >= LANES:
    return picked
  lanes = lax.rem(first, LANES)[:, None] + jnp.arange(block_size, dtype=jnp.int32)
  return jnp.take_along_axis(picked, jnp.broadcast_to(lanes, (heads,) + lanes.shape), axis=2)


def set_blocks(rows, block_ids, values, num_blocks: int, block_size: int):
  """Rows with blocks `block_ids` i32[n] set to `values` f32[Hkv, n, bs]; ids outside
  [0, NB) are dropped (padding never written). Ids must be distinct."""
  heads, n = rows.shape[0], block_ids.shape[0]
  window = _window(rows, block_size)
  valid = (block_ids >= 0) & (block_ids < num_blocks)
  starts = _starts(jnp.where(valid, block_ids, 0), block_size)
  starts = jnp.where(valid[:, None], starts, jnp.asarray([rows.shape[1], 0], jnp.int32))
  updates = jnp.swapaxes(values.astype(rows.dtype).reshape((heads, n) + window[1:]), 0, 1)
  dims = lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3), inserted_window_dims=(),
                                     scatter_dims_to_operand_dims=(1, 2))
  return lax.scatter(rows, starts, updates, dims, unique_indices=False,
                     mode=lax.GatherScatterMode.FILL_OR_DROP)
