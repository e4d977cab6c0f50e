"""The paged KV cache's pure, jittable ops on `KVPages` (`kv_pages`: the pytree, `init`).

Layout (head-major, so one attention program reads one head's pages
contiguously), one array per layer (`layer_stack.LayerStack`):

    k[l], v[l]:             [num_kv_heads, num_blocks, block_size, head_dim]
    k_scale[l], v_scale[l]: f32[num_kv_heads, num_blocks, block_size]  (int8/fp8 only)
                        or, on the TPU kernels, the same numbers as scale rows
                        f32[num_kv_heads, ceil(num_blocks * block_size / 128), 128]

`k`, `v` (and the scales) still index like the stacked `[num_layers, ...]` arrays
(`pages.k.shape`, `pages.k[:, :, ids]`, `np.asarray(pages.k)`), but each layer is its own
buffer: the attention kernel reads layer l's pages and the K/V write updates them in place,
with no copy of the pool (a kernel cannot read a view of a stacked array; XLA copied each
layer's whole pool every step, see `layer_stack.py`).

A *slot* is a flat token position in the pool: `slot = block * block_size +
offset`, in `[0, num_blocks * block_size)`. Negative slots mean padding and are
never written. Slots past the pool are dropped as well (JAX's scatter
`mode="drop"`); the block manager never produces them.

Quantized pages (`int8`, `float8_e4m3fn`) store one f32 scale per token per
head, computed on write from that token-head's absolute maximum over
`head_dim`: `scale = absmax / 127` (int8, values rounded and clipped to
[-127, 127]) or `scale = absmax / 448` (e4m3's largest finite value).
Dequantized `x = page.astype(f32) * scale[..., None]`.

Where the TPU kernels run (`scale_rows_for(backend)`), `init(..., scale_rows=True)` holds
the scales as *scale rows* (`pallas_kernels/scale_rows.py`: slot t at row t // 128, lane
t % 128): the one shape the TPU kernels read without XLA copying the whole scale array
before every call (for bs < 128 the blocks shape tiles to 128 lanes on a TPU). Every op
here reads the layout from the scales' shape and keeps it; block ops move a block's scales
as one window of the rows. Other backends keep the blocks shape, unchanged.

Every op returns a new `KVPages`; call them inside a `jax.jit` that donates the
pages (`donate_argnums`) so XLA updates the buffers in place. `write_donated`,
`copy_blocks_donated` and `zero_blocks_donated` are such jitted entries.
"""

from __future__ import annotations

from typing import Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.kv_pages import (HybridPages, KVPages, check_pages, init,  # re-exported
                                init_sliding, scale_rows_for)
from paged_jax.layer_stack import LayerStack
from pallas_kernels import backends
from pallas_kernels import scale_rows as rows_layout

__all__ = ["HybridPages", "KVPages", "check_pages", "init", "init_sliding",
           "scale_rows_for", "quantize", "dequantize", "write", "copy_blocks",
           "zero_blocks", "read_blocks", "write_blocks", "layer", "gather",
           "write_donated", "copy_blocks_donated", "zero_blocks_donated"]

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}

def quantize(x: jax.Array, dtype) -> Tuple[jax.Array, jax.Array]:
  """Per-row symmetric quantization over the last axis.

  Args:
    x: [..., head_dim] values (any float dtype).
    dtype: int8 or float8_e4m3fn.
  Returns:
    (q [..., head_dim] of `dtype`, scale f32[...]) with x ~= q * scale[..., None].
    An all-zero row gets scale 0 and q 0.
  """
  name = jnp.dtype(dtype).name
  if name not in _QMAX:
    raise ValueError(f"dtype must be int8 or float8_e4m3fn, got {name}")
  qmax = _QMAX[name]
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / qmax
  safe = jnp.where(scale > 0, scale, 1.0)[..., None]
  y = jnp.clip(x / safe, -qmax, qmax)
  if name == "int8":
    y = jnp.round(y)
  return y.astype(dtype), scale


def dequantize(q: jax.Array, scale: Optional[jax.Array]) -> jax.Array:
  """f32 values of pages `q [..., head_dim]` with optional scales `[...]`."""
  x = q.astype(jnp.float32)
  return x if scale is None else x * scale[..., None]

def _check_layer(pages: KVPages, layer) -> int:
  """The layer as a Python int; each layer is its own array, so it must be static."""
  check_pages(pages)
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
    raise TypeError(f"layer must be a Python int (each layer's pages are their own array), "
                    f"got {type(layer).__name__}")
  if not 0 <= layer < pages.num_layers:
    raise ValueError(f"layer must be in [0, {pages.num_layers - 1}], got {layer}")
  return int(layer)


def write(pages: KVPages, layer, k_new: jax.Array, v_new: jax.Array,
          slot_mapping: jax.Array, *, backend: Optional[str] = None) -> KVPages:
  """Writes new tokens' K/V into their cache slots of one layer.

  Args:
    pages: the cache.
    layer: layer index (a Python int in [0, num_layers)).
    k_new: [T, num_kv_heads, head_dim] keys of T new tokens.
    v_new: [T, num_kv_heads, head_dim] values.
    slot_mapping: i32[T] flat slot of each token (`block * block_size + offset`);
      slot < 0 marks padding, which is not written. Two tokens must not share a
      slot (which one would win is unspecified).
    backend: the attention backend of the step (a `paged_jax.attention` spelling), or
      None. Where it runs the TPU kernels ("pallas:tpu", "pallas_interpret:tpu", or
      "auto" / "pallas" on a TPU) the write is the TPU kernel `pallas_kernels.tpu.write_kv`
      (in place; XLA's TPU scatter transposes and copies the whole layer pool); anywhere
      else, and for None, XLA's scatter.
  Returns:
    The updated pages (casts to the page dtype; quantizes int8 / fp8 pages and
    stores their scales). Only layer `layer`'s arrays change, by a scatter of the T
    slots: in place when the pages are donated.
  """
  layer = _check_layer(pages, layer)
  num_tokens = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
  want = (num_tokens, pages.num_kv_heads, pages.head_dim)
  if slot_mapping.ndim != 1 or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
    raise ValueError(f"slot_mapping must be an integer [T] array, got {slot_mapping.dtype}"
                     f"{list(slot_mapping.shape)}")
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if tuple(x.shape) != want:
      raise ValueError(f"{name} must have shape [T, num_kv_heads, head_dim] = {list(want)}, "
                       f"got {list(x.shape)}")
  chex.assert_type([k_new, v_new], float, custom_message="k_new, v_new (float K/V to write)")
  tpu = None if backend is None else backends.tpu_key(backend)
  if tpu is not None:
    return _write_tpu(pages, layer, k_new, v_new, slot_mapping, interpret=tpu.interpret)
  num_slots = pages.num_blocks * pages.block_size
  # Padding (and anything out of the pool) goes to an out-of-bounds index: dropped (scale
  # rows pad the flat slots: past the pool is made past the rows, never into the padding).
  in_pool = (slot_mapping >= 0) & (slot_mapping < num_slots)
  past = rows_layout.num_rows(pages.num_blocks, pages.block_size) * rows_layout.LANES
  slots = jnp.where(in_pool, slot_mapping, past).astype(jnp.int32)
  flat = (pages.num_kv_heads, num_slots)

  def put(stack, scale_stack, x):
    page = stack[layer]
    x = jnp.swapaxes(x, 0, 1)   # [Hkv, T, D]: `[:, slots]` indexes the slot axis
    if scale_stack is not None:
      x, scale = quantize(x, page.dtype)
      scale_page = scale_stack[layer]
      scale_page = scale_page.reshape(pages.num_kv_heads, -1).at[:, slots].set(
          scale, mode="drop").reshape(scale_page.shape)
      scale_stack = _replace_layer(scale_stack, layer, scale_page)
    page = page.reshape(flat + (pages.head_dim,)).at[:, slots].set(
        x.astype(page.dtype), mode="drop").reshape(page.shape)
    return _replace_layer(stack, layer, page), scale_stack

  k, k_scale = put(pages.k, pages.k_scale, k_new)
  v, v_scale = put(pages.v, pages.v_scale, v_new)
  return KVPages(k=k, v=v, k_scale=k_scale, v_scale=v_scale)


def _write_tpu(pages: KVPages, index: int, k_new, v_new, slot_mapping, *, interpret):
  """`write` by the TPU kernel: the layer's pages (and scales) updated where they are."""
  from pallas_kernels import tpu  # pylint: disable=g-import-not-at-top
  k, v, ks, vs = layer(pages, index)
  nb, bs = pages.num_blocks, pages.block_size
  if ks is not None:   # the kernel keeps scales as scale rows (as the pages hold them on TPU)
    ks, vs = (rows_layout.as_rows(s, nb, bs) for s in (ks, vs))
  out = tpu.write_kv(k, v, k_new, v_new, slot_mapping.astype(jnp.int32), ks, vs,
                     interpret=interpret)
  new = KVPages(k=_replace_layer(pages.k, index, out[0]),
                v=_replace_layer(pages.v, index, out[1]), k_scale=pages.k_scale,
                v_scale=pages.v_scale)
  if ks is None:
    return new
  back = lambda r: r if pages.scale_rows else rows_layout.as_blocks(r, nb, bs)
  return new.replace(k_scale=_replace_layer(pages.k_scale, index, back(out[2])),
                     v_scale=_replace_layer(pages.v_scale, index, back(out[3])))


def _replace_layer(stack: LayerStack, layer: int, x) -> LayerStack:
  layers = list(stack.layers)
  layers[layer] = x
  return LayerStack(layers)


def _check_ids(name: str, ids: jax.Array, ndim: int) -> None:
  if ids.ndim != ndim or not jnp.issubdtype(ids.dtype, jnp.integer):
    shape = "[n, 2]" if ndim == 2 else "[n]"
    raise ValueError(f"{name} must be an integer {shape} array, got {ids.dtype}"
                     f"{list(ids.shape)}")
  if ndim == 2 and ids.shape[1] != 2:
    raise ValueError(f"{name} must have shape [n, 2], got {list(ids.shape)}")


def copy_blocks(pages: KVPages, pairs: jax.Array) -> KVPages:
  """Copies whole blocks (all layers, heads, scales): copy-on-write.

  Args:
    pages: the cache.
    pairs: i32[n, 2] rows (src_block, dst_block); rows with src < 0 or dst < 0
      are ignored. All sources are read before any destination is written.
      Destinations must be distinct.
  """
  check_pages(pages)
  _check_ids("pairs", pairs, 2)
  nb, bs, rows = pages.num_blocks, pages.block_size, pages.scale_rows
  src, dst = pairs[:, 0], pairs[:, 1]
  valid = (src >= 0) & (dst >= 0)
  src = jnp.where(valid, src, 0)
  dst = jnp.where(valid, dst, nb)   # out of bounds: dropped

  # Per layer: gather the n source blocks, scatter them (in place when donated); scale
  # rows (ndim 3) move each block as its window of the rows.
  def copy(x):
    if rows and x.ndim == 3:
      return rows_layout.set_blocks(x, dst, rows_layout.gather_blocks(x, src, bs), nb, bs)
    return x.at[:, dst].set(x[:, src], mode="drop")

  return pages.map_layers(copy)


def zero_blocks(pages: KVPages, block_ids: jax.Array) -> KVPages:
  """Zeroes whole blocks (all layers, heads, scales); ids < 0 are ignored."""
  check_pages(pages)
  _check_ids("block_ids", block_ids, 1)
  nb, bs, rows = pages.num_blocks, pages.block_size, pages.scale_rows
  ids = jnp.where(block_ids >= 0, block_ids, nb)

  def zero(x):
    if rows and x.ndim == 3:
      blank = jnp.zeros((x.shape[0], ids.shape[0], bs), x.dtype)
      return rows_layout.set_blocks(x, ids, blank, nb, bs)
    return x.at[:, ids].set(0, mode="drop")

  return pages.map_layers(zero)


def read_blocks(pages: KVPages, block_ids: jax.Array) -> dict:
  """Whole blocks of every layer, in the blocks layout whatever the scales' layout.

  Args:
    block_ids: i32[n], each in [0, num_blocks).
  Returns:
    {field: [num_layers, Hkv, n, bs, D] pages, or f32[num_layers, Hkv, n, bs] scales} for
    the fields (FIELDS) the pages have.
  """
  check_pages(pages)
  _check_ids("block_ids", block_ids, 1)
  out = {f: getattr(pages, f)[:, :, block_ids] for f in ("k", "v")}
  for f in ("k_scale", "v_scale") if pages.quantized else ():
    stack = getattr(pages, f)
    out[f] = (jnp.stack([rows_layout.gather_blocks(x, block_ids, pages.block_size)
                         for x in stack.layers]) if pages.scale_rows
              else stack[:, :, block_ids])
  return out


def write_blocks(pages: KVPages, block_ids: jax.Array, blocks: dict) -> KVPages:
  """`pages` with blocks `block_ids` i32[n] (distinct; < 0 or >= num_blocks: dropped) set
  to `blocks` (`read_blocks`' form, cast to the pages' dtypes)."""
  check_pages(pages)
  _check_ids("block_ids", block_ids, 1)
  nb, bs = pages.num_blocks, pages.block_size
  ids = jnp.where((block_ids >= 0) & (block_ids < nb), block_ids, nb)
  updates = {}
  for f, x in blocks.items():
    stack = getattr(pages, f)
    if pages.scale_rows and f in ("k_scale", "v_scale"):
      updates[f] = LayerStack(tuple(rows_layout.set_blocks(s, ids, x[i], nb, bs)
                                    for i, s in enumerate(stack.layers)))
    else:
      updates[f] = stack.at[:, :, ids].set(x.astype(stack.dtype), mode="drop")
  return pages.replace(**updates)


def layer(pages: KVPages, layer_index) -> Tuple[jax.Array, jax.Array, Optional[jax.Array],
                                               Optional[jax.Array]]:
  """One layer's arrays for the attention kernels (the buffers themselves, no copy).

  Returns:
    (k [Hkv, NB, bs, D], v [Hkv, NB, bs, D], k_scale f32[Hkv, NB, bs] | None, v_scale | None);
    the scales as the pages hold them: scale rows when `pages.scale_rows` (the attention
    entries take either shape).
  """
  layer_index = _check_layer(pages, layer_index)
  pick = lambda x: None if x is None else x[layer_index]
  return pick(pages.k), pick(pages.v), pick(pages.k_scale), pick(pages.v_scale)


def gather(pages: KVPages, layer_index, block_table: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """Contiguous f32 K/V of one sequence (the reference path's dense view).

  Args:
    block_table: i32[P] physical block of each logical block; entries < 0 read
      block 0 (mask them by length).
  Returns:
    (k [P * block_size, Hkv, D], v [...]) dequantized to f32, token-major.
  """
  _check_ids("block_table", block_table, 1)
  k, v, ks, vs = layer(pages, layer_index)
  table = jnp.maximum(block_table, 0)
  if ks is not None:
    ks, vs = (rows_layout.as_blocks(s, pages.num_blocks, pages.block_size) for s in (ks, vs))

  def dense(x, s):
    x = dequantize(x[:, table], None if s is None else s[:, table])  # [Hkv, P, bs, D]
    return jnp.transpose(x.reshape(x.shape[0], -1, x.shape[-1]), (1, 0, 2))

  return dense(k, ks), dense(v, vs)


# `layer` is static: it picks which per-layer array is updated.
write_donated = jax.jit(write, donate_argnums=0, static_argnums=1)
copy_blocks_donated = jax.jit(copy_blocks, donate_argnums=0)
zero_blocks_donated = jax.jit(zero_blocks, donate_argnums=0)
