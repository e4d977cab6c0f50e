"""Paged decode attention as a Pallas kernel on the Mosaic GPU backend (Hopper, sm_90a).

One query token per sequence attends to that sequence's K/V pages, scattered through a
shared pool. The kernel reads `lengths[b]` and the block table as scalars from global
memory and gathers the live pages with TMA (one copy per page, or per page slice when a
page is longer than a tile) into a `num_stages`-deep shared-memory ring; QK^T and PV run
on wgmma with both operands in shared memory (P goes through shared memory), softmax is
online in registers, accumulators live in `plgpu.ACC` scopes. The same code runs under
GPU interpret mode on a CPU (jax >= 0.11.2).

Grid: (num_kv_heads, batch, num_splits), one warpgroup per program. One program serves all
query heads of one KV head (GQA / MQA): its query tile is the group padded to wgmma's 64
rows. Split-K ("flash-decoding"): each sequence's live tiles are divided evenly between the
`num_splits` programs of a (sequence, KV head) at run time; each split writes a normalized
partial and its log-sum-exp, and the wrapper merges them stably.

Supported (anything else: use the Triton kernel; `supported_reason` says why, and
`backends.paged_attention(gpu_backend="auto")` falls back to Triton by itself):
  * q bfloat16 or float16; pages of q's dtype, or int8 / float8_e4m3fn with f32 per-token
    k_scales / v_scales (TMA into 8-bit rings, converted per step into a q-dtype tile in
    shared memory; scales multiply logits and probabilities); no float32;
  * block_size a power of two >= 16 (smaller pages fall back to Triton: a TMA slice of
    the swizzled tile must cover whole 8-row swizzle groups and a page per copy is too
    little work below that);
  * head_dim 64, 128 or 256 (the 128-byte swizzle needs D % 64 == 0);
  * num_q_heads / num_kv_heads <= 64 (one wgmma M tile).

Layout (semantics in pallas_kernels/reference.py):
  q [B, Hq, D]; k_pages, v_pages [Hkv, NB, bs, D]; block_tables i32[B, P]; lengths i32[B]
  -> [B, Hq, D].
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

try:  # Mosaic GPU Pallas; its interpreter needs jax >= 0.11.2 (checked by callers).
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - very old jax
  pl = plgpu = None

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_Q_ROWS = 64              # wgmma M: the GQA group is padded to this many rows.
_SWIZZLE = 128            # bytes; 64 bf16 / f16 elements per swizzled row.
_MIN_BLOCK_SIZE = 16
_DTYPES = ("bfloat16", "float16")
_QUANT_DTYPES = ("int8", "float8_e4m3fn")
MIN_JAX_INTERPRET = (0, 11, 2)


def _jax_version():
  return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def interpret_unavailable_reason() -> Optional[str]:
  """None when GPU interpret mode can run this kernel here, else a one-line reason."""
  if plgpu is None or not hasattr(plgpu, "InterpretGPUParams"):
    return f"Mosaic GPU interpret mode needs jax >= 0.11.2, this is jax {jax.__version__}"
  if _jax_version() < MIN_JAX_INTERPRET:
    return f"Mosaic GPU interpret mode needs jax >= 0.11.2, this is jax {jax.__version__}"
  return None


def supported_reason(num_q_heads, num_kv_heads, head_dim, block_size, q_dtype,
                     page_dtype, quantized=False) -> Optional[str]:
  """None when this kernel supports the shape / dtypes, else why not (one line).
  `quantized`: int8 / float8_e4m3fn pages with scales (decode kernel only)."""
  q_name, page_name = jnp.dtype(q_dtype).name, jnp.dtype(page_dtype).name
  if quantized:
    if q_name not in _DTYPES or page_name not in _QUANT_DTYPES:
      return (f"dtypes q={q_name} pages={page_name} with scales (Mosaic kernel: bf16/f16 q, "
              f"{'/'.join(_QUANT_DTYPES)} pages)")
  elif q_name not in _DTYPES or page_name != q_name:
    return f"dtypes q={q_name} pages={page_name} (Mosaic kernel: bf16/f16 pages = q dtype)"
  if block_size < _MIN_BLOCK_SIZE or block_size & (block_size - 1):
    return f"block_size {block_size} (Mosaic kernel: power of two >= {_MIN_BLOCK_SIZE})"
  if head_dim not in (64, 128, 256):
    return f"head_dim {head_dim} (Mosaic kernel: 64, 128 or 256)"
  if num_kv_heads < 1 or num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > _Q_ROWS:
    return f"heads {num_q_heads}/{num_kv_heads} (Mosaic kernel: group of at most {_Q_ROWS})"
  return None


def _decode_kernel(
    lengths_ref,  # i32[B] (GMEM, read as scalars)
    tables_ref,   # i32[B, P] (GMEM, read as scalars)
    q_ref,        # [B, Hkv, 64, D] (GMEM) query group of each KV head, zero-padded rows
    k_ref,        # [Hkv, NB, bs, D] (GMEM)
    v_ref,        # [Hkv, NB, bs, D] (GMEM)
    ks_ref,       # f32[Hkv, NB, bs] (GMEM) per-token K scales, or None (float pages)
    vs_ref,       # f32[Hkv, NB, bs] (GMEM) per-token V scales, or None
    o_ref,        # [B, Hkv, S, 64, D] (GMEM) per-split output, normalized by its own sum
    lse_ref,      # f32[B, Hkv, S, 64] (GMEM) per-split log-sum-exp, -inf when empty
    scratch,
    *,
    num_splits, tile_kv, num_stages, sm_scale, soft_cap, sliding_window,
    accumulate_in_place):
  q_smem, k_smem, v_smem, p_smem, lse_smem, q_bar, k_bars, v_bars, *quant = scratch
  # int8 / fp8 pages: TMA into 8-bit rings (+ scale rings), converted per step into the
  # one-slot q-dtype tiles k_smem / v_smem that wgmma reads; scales multiply the logits
  # (K) and the probabilities (V) column-wise.
  quantized = bool(quant)
  k_land, v_land, ks_smem, vs_smem = quant if quantized else (k_smem, v_smem, None, None)
  h, b, split = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("s")
  _, num_blocks, block_size, head_dim = k_ref.shape
  pages_per_seq = tables_ref.shape[1]
  dtype = q_smem.dtype
  pages_per_tile = max(1, tile_kv // block_size)
  tokens_per_copy = min(block_size, tile_kv)

  # Live tokens [start_tok, end_tok) and this split's tiles [lo, lo + num_steps).
  end_tok = jnp.clip(lengths_ref[b], 0, pages_per_seq * block_size)
  start_tok = (jnp.int32(0) if sliding_window is None
               else jnp.maximum(end_tok - sliding_window, 0))
  first_tile = lax.div(start_tok, jnp.int32(tile_kv))
  end_tile = lax.div(end_tok + tile_kv - 1, jnp.int32(tile_kv))
  tiles_total = end_tile - first_tile
  per_split = lax.div(tiles_total + num_splits - 1, jnp.int32(num_splits))
  lo = first_tile + split * per_split
  num_steps = jnp.clip(jnp.minimum(lo + per_split, end_tile) - lo, 0, None)

  def issue(step):  # TMA of tile lo + step into ring slot step % num_stages.
    slot = lax.rem(step, jnp.int32(num_stages))
    tok0 = (lo + step) * tile_kv
    for i in range(pages_per_tile):
      tok = tok0 + i * tokens_per_copy
      logical = jnp.minimum(lax.div(tok, jnp.int32(block_size)), pages_per_seq - 1)
      page = jnp.clip(tables_ref[b, logical], 0, num_blocks - 1)
      rows = pl.ds(lax.rem(tok, jnp.int32(block_size)) if block_size > tile_kv else 0,
                   tokens_per_copy)
      dst = pl.ds(i * tokens_per_copy, tokens_per_copy)
      plgpu.copy_gmem_to_smem(k_ref.at[h, page, rows], k_land.at[slot, dst], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[h, page, rows], v_land.at[slot, dst], v_bars.at[slot])
      if quantized:
        plgpu.copy_gmem_to_smem(ks_ref.at[h, page, rows], ks_smem.at[slot, dst],
                                k_bars.at[slot])
        plgpu.copy_gmem_to_smem(vs_ref.at[h, page, rows], vs_smem.at[slot, dst],
                                v_bars.at[slot])

  plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
  for s in range(num_stages):
    pl.when(s < num_steps)(functools.partial(issue, jnp.int32(s)))
  plgpu.barrier_wait(q_bar)

  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def body(step, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(step, jnp.int32(num_stages))
    tok0 = (lo + step) * tile_kv
    plgpu.barrier_wait(k_bars.at[slot])
    cslot = step * 0 if quantized else slot   # compute tile (traced: a literal index fails to lower)
    if quantized:
      _dequantize(k_land.at[slot], k_smem.at[cslot])
      plgpu.commit_smem()

    def qk_scope(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[cslot].transpose((1, 0)))
      return acc_ref[...]
    logits = pl.run_scoped(qk_scope, plgpu.ACC((_Q_ROWS, tile_kv), jnp.float32))
    if quantized:
      logits = logits * _columns(ks_smem.at[slot], logits.shape)
    logits = logits * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    pos = tok0 + plgpu.broadcasted_iota(jnp.int32, (_Q_ROWS, tile_kv), 1,
                                        layout=plgpu.Layout.WGMMA)
    live = (pos >= start_tok) & (pos < end_tok)
    logits = jnp.where(live, logits * _LOG2E, _MASK_VALUE)   # log2 domain
    m_new = jnp.maximum(m_i, logits.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    if not quantized:
      p_smem[...] = p.astype(dtype)

    plgpu.barrier_wait(v_bars.at[slot])
    if quantized:
      p_smem[...] = (p * _columns(vs_smem.at[slot], p.shape)).astype(dtype)
      _dequantize(v_land.at[slot], v_smem.at[cslot])
    # Rows outside [start_tok, end_tok) of an edge tile may hold stale data (even NaN)
    # that 0 * NaN would carry into PV: zero them in shared memory.
    @pl.when((tok0 < start_tok) | (tok0 + tile_kv > end_tok))
    def _zero_dead_rows():  # 64 columns at a time (registers: acc is live).
      rows = tok0 + plgpu.broadcasted_iota(jnp.int32, (tile_kv, 64), 0,
                                           layout=plgpu.Layout.WGMMA)
      keep = (rows >= start_tok) & (rows < end_tok)
      for c in range(head_dim // 64):
        v_cols = v_smem.at[cslot, :, pl.ds(c * 64, 64)]
        v_tile = v_cols[...]
        v_cols[...] = jnp.where(keep, v_tile, jnp.zeros_like(v_tile))
    plgpu.commit_smem()

    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    pv_v = v_smem.at[cslot]
    if accumulate_in_place:  # compiled: wgmma adds onto the rescaled acc (no second tile)
      acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p_smem, pv_v))(
          plgpu.ACC.init(acc))
    else:  # GPU interpret mode cannot seed an accumulator: PV into a fresh one, then add.
      def pv_scope(pv_ref):
        plgpu.wgmma(pv_ref, p_smem, pv_v)
        return pv_ref[...]
      acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((_Q_ROWS, head_dim), jnp.float32))
    # Both wgmmas have been waited for: the slot is free for the tile num_stages ahead.
    nxt = step + num_stages
    pl.when(nxt < num_steps)(functools.partial(issue, nxt))
    return acc, m_new, l_i

  acc = plgpu.layout_cast(jnp.zeros((_Q_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((_Q_ROWS,), _MASK_VALUE, jnp.float32), row_layout)
  l_i = plgpu.layout_cast(jnp.zeros((_Q_ROWS,), jnp.float32), row_layout)
  acc, m_i, l_i = lax.fori_loop(0, num_steps, body, (acc, m_i, l_i))

  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
  q_smem[...] = acc.astype(dtype)           # Q is no longer needed: reuse its tile.
  lse_smem[...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, split])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, split])
  plgpu.wait_smem_to_gmem(0)


def _dequantize(src, dst):
  """8-bit [T, D] tile -> dst's dtype, one 128-column swizzle tile at a time (registers).
  fp8 goes through f32: sm_90 converts e4m3 only to f16 in hardware."""
  head_dim = src.shape[-1]
  chunk = min(head_dim, 128)
  for c in range(head_dim // chunk):
    cols = pl.ds(c * chunk, chunk)
    x = src.at[:, cols][...]
    if x.dtype != jnp.int8:
      x = x.astype(jnp.float32)
    dst.at[:, cols][...] = x.astype(dst.dtype)


def _columns(scale_ref, shape):
  """f32[T] scales in shared memory -> [64, T] broadcast along rows (WGMMA layout)."""
  cols = plgpu.load(scale_ref, layout=plgpu.Layout.WGMMA.reduce(0))
  return lax.broadcast_in_dim(cols, shape, [1])


def _transforms(dtype, head_dim):
  """Tiling + swizzle of a [rows, head_dim] shared-memory tile for TMA and wgmma."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(_SWIZZLE, head_dim * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _combine_splits(o, lse):
  """Merges split-K partials: o f32[..., S, R, D], lse f32[..., S, R] -> f32[..., R, D]."""
  top = jnp.max(lse, axis=-2, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.exp(lse - top)                      # 0 for empty splits (lse = -inf)
  denom = jnp.sum(w, axis=-2)
  out = jnp.sum(w[..., None] * o, axis=-3)
  return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def _paged_attention_impl(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, *,
                          sm_scale, soft_cap, sliding_window, num_splits, tile_kv, num_stages,
                          interpret):
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  dtype = q.dtype
  quantized = k_scales is not None
  q4 = q.reshape(batch, num_kv_heads, group, head_dim)
  q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, _Q_ROWS - group), (0, 0)))   # [B, Hkv, 64, D]

  transforms = _transforms(dtype, head_dim)
  pages_per_tile = max(1, tile_kv // block_size)
  compute_slots = 1 if quantized else num_stages
  copies_per_barrier = pages_per_tile * (2 if quantized else 1)
  scratch = [
      plgpu.SMEM((_Q_ROWS, head_dim), dtype, transforms=transforms),                # q / out
      plgpu.SMEM((compute_slots, tile_kv, head_dim), dtype, transforms=transforms),  # K
      plgpu.SMEM((compute_slots, tile_kv, head_dim), dtype, transforms=transforms),  # V
      plgpu.SMEM((_Q_ROWS, tile_kv), dtype, transforms=transforms),                  # P
      plgpu.SMEM((_Q_ROWS,), jnp.float32),                                           # lse
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_arrivals=copies_per_barrier, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=copies_per_barrier, num_barriers=num_stages),
  ]
  if quantized:  # 8-bit K / V rings and their scale rings
    page_transforms = _transforms(k_pages.dtype, head_dim)
    scratch += [
        plgpu.SMEM((num_stages, tile_kv, head_dim), k_pages.dtype, transforms=page_transforms),
        plgpu.SMEM((num_stages, tile_kv, head_dim), v_pages.dtype, transforms=page_transforms),
        plgpu.SMEM((num_stages, tile_kv), jnp.float32),
        plgpu.SMEM((num_stages, tile_kv), jnp.float32),
    ]
  kernel = functools.partial(
      _decode_kernel, num_splits=num_splits, tile_kv=tile_kv, num_stages=num_stages,
      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
      accumulate_in_place=not interpret)
  params = dict(compiler_params=plgpu.CompilerParams())
  if interpret:
    params["interpret"] = plgpu.InterpretGPUParams(detect_races=True)
  inputs = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32), q4, k_pages, v_pages]
  if quantized:
    inputs += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]

  def body(*refs):
    n = len(inputs)
    ins = list(refs[:n]) + ([] if quantized else [None, None])
    kernel(*ins, refs[n], refs[n + 1], refs[n + 2:])

  o, lse = plgpu.kernel(
      body,
      kernel_name=f"paged_decode_mgpu_bs{block_size}_tile{tile_kv}_splits{num_splits}",
      out_type=(jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, _Q_ROWS, head_dim),
                                     dtype),
                jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, _Q_ROWS),
                                     jnp.float32)),
      scratch_types=tuple(scratch),
      grid=(num_kv_heads, batch, num_splits),
      grid_names=("h", "b", "s"),
      **params,
  )(*inputs)

  if num_splits == 1:
    out = o[:, :, 0].astype(jnp.float32)
  else:
    out = _combine_splits(o.astype(jnp.float32), lse)
  return out[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(dtype)


_jitted_impl = jax.jit(
    _paged_attention_impl,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "num_splits", "tile_kv",
                     "num_stages", "interpret"))


def default_num_splits(batch, num_kv_heads, pages_per_seq, block_size, tile_kv,
                       target_programs=264, max_splits=32) -> int:
  """Enough programs to fill 132 SMs about twice, no split shorter than two tiles."""
  max_tiles = -(-pages_per_seq * block_size // tile_kv)
  want = -(-target_programs // (batch * num_kv_heads))
  return int(max(1, min(want, max_tiles // 2, max_splits)))


SM90_SHARED_MEMORY_BYTES = 232448   # opt-in limit per block (227 KiB)
_SMEM_SLACK = 4096                  # Mosaic's alignment padding and barriers


def default_num_stages(head_dim, tile_kv=64, page_itemsize=None) -> int:
  """The deepest K/V ring, up to 3, that fits in sm_90 shared memory."""
  for stages in (3, 2):
    if shared_memory_bytes(head_dim, tile_kv, stages, page_itemsize=page_itemsize) + \
        _SMEM_SLACK <= SM90_SHARED_MEMORY_BYTES:
      return stages
  return 1


def shared_memory_bytes(head_dim, tile_kv, num_stages, itemsize=2, page_itemsize=None) -> int:
  """Shared memory of one program (buffers only; barriers add a few bytes).
  `page_itemsize` (1) for int8 / fp8 pages: 8-bit + scale rings, one-slot compute tiles."""
  compute_slots = num_stages if page_itemsize is None else 1
  out = itemsize * head_dim * (_Q_ROWS + 2 * compute_slots * tile_kv) + \
      itemsize * _Q_ROWS * tile_kv + 4 * _Q_ROWS
  if page_itemsize is not None:
    out += 2 * num_stages * tile_kv * (head_dim * page_itemsize + 4)
  return out


def check_num_stages(num_stages, head_dim, tile_kv, page_itemsize=None) -> int:
  """Default or validated ring depth; ValueError when over the shared-memory budget."""
  if num_stages is None:
    return default_num_stages(head_dim, tile_kv, page_itemsize)
  if int(num_stages) != num_stages or not 1 <= num_stages <= 8:
    raise ValueError(f"num_stages must be an int in [1, 8], got {num_stages}")
  need = shared_memory_bytes(head_dim, tile_kv, num_stages,
                             page_itemsize=page_itemsize) + _SMEM_SLACK
  if need > SM90_SHARED_MEMORY_BYTES:
    raise ValueError(f"num_stages={num_stages} with tile_kv={tile_kv}, head_dim={head_dim} "
                     f"needs ~{need:,} B of shared memory > {SM90_SHARED_MEMORY_BYTES:,}")
  return int(num_stages)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                    interpret=False, num_splits=None, tile_kv=64, num_stages=None):
  """Decode attention over a paged KV cache on the Mosaic GPU backend (sm_90a).

  Args:
    q: [B, Hq, D] bfloat16 / float16; D in {64, 128, 256}; Hq / Hkv <= 64.
    k_pages, v_pages: [Hkv, NB, bs, D] in q's dtype, or int8 / float8_e4m3fn with scales;
      bs a power of two >= 16.
    block_tables: i32[B, P]; entries past a sequence's length are never used (clamped).
    lengths: i32[B] (query at position lengths[b] - 1); 0 gives zeros; clamped to P * bs.
    sm_scale: default 1/sqrt(D). soft_cap: c * tanh(logits / c). sliding_window: W.
    k_scales, v_scales: f32[Hkv, NB, bs] per-token scales of int8 / fp8 pages, else None.
    interpret: run under Mosaic GPU interpret mode on a CPU (jax >= 0.11.2), with race
      detection on.
    num_splits: split-K partitions per (sequence, KV head); default `default_num_splits`.
    tile_kv: keys per loop step, 64 or 128 (several whole pages, or one page slice).
    num_stages: depth of the shared-memory K/V ring (default: the deepest of 3, 2, 1 that
      fits in 227 KiB; 3 at D <= 128 with tile_kv 64).
  Returns:
    [B, Hq, D] in q's dtype, accumulated in float32.
  Raises:
    ValueError for shapes / dtypes this kernel does not support (see `supported_reason`).
  """
  if plgpu is None:
    raise ValueError("Mosaic GPU Pallas is not available in this jax")
  if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
    raise ValueError(f"q must be [B, Hq, D] and k/v_pages [Hkv, NB, bs, D], got "
                     f"{q.shape}, {k_pages.shape}, {v_pages.shape}")
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, page_dim = k_pages.shape
  quantized = k_scales is not None or v_scales is not None
  why = supported_reason(num_q_heads, num_kv_heads, head_dim, block_size, q.dtype,
                         k_pages.dtype, quantized)
  for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
    if why is None and quantized and (sc is None or sc.shape != k_pages.shape[:3]):
      why = f"{name} {None if sc is None else sc.shape} (need f32{list(k_pages.shape[:3])})"
  if why is None and page_dim != head_dim:
    why = f"page head_dim {page_dim} != q head_dim {head_dim}"
  if why is None and v_pages.dtype != k_pages.dtype:
    why = f"v_pages dtype {v_pages.dtype} != k_pages dtype {k_pages.dtype}"
  if why is not None:
    raise ValueError(f"mosaic_gpu paged_attention does not support {why}; use Triton")
  if block_tables.ndim != 2 or block_tables.shape[0] != batch or lengths.shape != (batch,):
    raise ValueError(f"block_tables must be i32[{batch}, P] and lengths i32[{batch}], got "
                     f"{block_tables.shape}, {lengths.shape}")
  if tile_kv not in (64, 128):
    raise ValueError(f"tile_kv must be 64 or 128, got {tile_kv}")
  num_stages = check_num_stages(num_stages, head_dim, tile_kv, 1 if quantized else None)
  if num_splits is None:
    num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1], block_size,
                                    tile_kv)
  if int(num_splits) != num_splits or not 1 <= num_splits <= 256:
    raise ValueError(f"num_splits must be an int in [1, 256], got {num_splits}")
  if sliding_window is not None and (int(sliding_window) != sliding_window
                                     or sliding_window < 1):
    raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window}")
  if interpret and interpret_unavailable_reason():
    raise ValueError(interpret_unavailable_reason())
  return _jitted_impl(
      q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales,
      sm_scale=float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale),
      soft_cap=None if soft_cap is None else float(soft_cap),
      sliding_window=None if sliding_window is None else int(sliding_window),
      num_splits=int(num_splits), tile_kv=int(tile_kv), num_stages=int(num_stages),
      interpret=bool(interpret))
