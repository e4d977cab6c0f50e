"""Per-token int8 / fp8 scales on TPU: a compact HBM layout and their in-kernel lane vector.

The reference keeps scales f32[Hkv, NB, bs]. On a TPU that shape has no good layout for
bs < 128: XLA's default puts NB minor (a page's bs scales are strided, and a Pallas
operand must be row-major, so XLA would copy the whole array every call), and row-major
pads bs to 128 lanes (8x the bytes at bs 16, a quarter of an int8 pool at D 128). So the
kernel reads the same numbers as *scale rows*

  rows f32[Hkv, ceil(NB * bs / 128), 128]:  token slot t = page * bs + offset of head h
                                            at rows[h, t // 128, t % 128]

(the flat slot order, compact). `as_rows` makes it from the reference shape (a free
reshape when that array is row-major); the engine on the TPU kernels holds this shape
(`paged_jax.kv_cache.init(..., scale_rows=True)`).
A page's scales are one 128-lane row (bs <= 128: 128 / bs pages share it, the page at lane
offset page * bs % 128) or bs / 128 whole rows; one DMA per page brings its row(s).

In the kernel, `lane_vector` turns the PT fetched rows of a K/V tile into the lane vector
[1, TK] (key j of the tile at lane j) that multiplies the logits' (K) or probabilities'
(V) columns: per row a lane rotation by one of 128 / seg static amounts (seg = min(bs,
128)), a mask to the page's segment, then the rows of each 128-lane group summed (strided
sublane reads) and the groups concatenated. (lax.rem, not %: see attention_kernel.py.)
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

# The layout itself (shapes, conversions, block windows) is pallas_kernels/scale_rows.py.
from pallas_kernels.scale_rows import (  # pylint: disable=unused-import
    LANES, as_rows, num_rows, rows_per_page)


def first_row(page, block_size: int):
  """Row of `page`'s first scale."""
  return lax.div(page * block_size, LANES)


def lane_vector(rows, pages, block_size: int, ybuf):
  """The tile's per-key scales as a lane vector.

  Args:
    rows: f32[PT * rpp, 128], page i's row(s) at i * rpp (stale rows for pages that were
      not fetched: their lanes land only on their own keys, which the caller masks).
    pages: PT scalar page ids (source offsets: page * bs % 128).
    ybuf: VMEM scratch f32[PT * rpp, 128].
  Returns:
    f32[1, TK], TK = PT * bs.
  """
  nrows = rows.shape[0]
  seg = min(block_size, LANES)
  per_group = LANES // seg
  groups = nrows * seg // LANES
  r = lax.broadcasted_iota(jnp.int32, (nrows, 1), 0)
  tgt = lax.rem(r * seg, LANES)
  if seg < LANES:
    off = jnp.zeros((nrows, 1), jnp.int32)
    for i, page in enumerate(pages):
      off = jnp.where(r == i, lax.rem(page * block_size, LANES), off)
    shift = lax.rem(tgt - off + LANES, LANES)
    y = rows
    for k in range(1, per_group):
      y = jnp.where(shift == k * seg, pltpu.roll(rows, k * seg, 1), y)
    lane = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    y = jnp.where((lane >= tgt) & (lane < tgt + seg), y, 0.0)
    if groups == 0:                                     # a tile narrower than 128 keys
      return jnp.sum(y, axis=0, keepdims=True)[:, :nrows * seg]
    ybuf[...] = y
    z = ybuf[pl.ds(0, groups, stride=per_group)]
    for k in range(1, per_group):
      z = z + ybuf[pl.ds(k, groups, stride=per_group)]
  else:
    z = rows
  if groups == 1:
    return z
  return jnp.concatenate([z[g:g + 1] for g in range(groups)], axis=1)
