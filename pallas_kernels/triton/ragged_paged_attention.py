"""Ragged paged attention: one Pallas (Triton GPU) call for a mixed prefill + decode batch.

A batch holds S sequences; sequence i brings q_len_i = cu_q_lens[i+1] - cu_q_lens[i] new
query rows q[cu_q_lens[i]:cu_q_lens[i+1]] at positions kv_lens[i] - q_len_i ..
kv_lens[i] - 1, whose K/V are already written into the paged cache. A decode sequence
has q_len 1, a prefill chunk many (a chunk may start mid-block: chunked prefill, prefix
cache hits). Each new query attends causally within its chunk and fully to the cached
prefix. Semantics are exactly `reference.ragged_paged_attention_reference`.

Design (Triton backend, chosen explicitly through `plgpu.CompilerParams`):
  * Query tiles (pallas_kernels/tiling.py, jnp inside jit). Two launches share one output
    buffer: sequences with at most `short_q_per_tile` new queries (decode rows) get one
    small tile each, the others (prefill chunks) tiles of `q_per_tile` rows; tiles past
    the real count do nothing. A decode row so costs a 16-row tile, not a 64-row one.
  * Grid (query tile, KV head, KV split). One program holds all G = Hq / Hkv query heads
    of its KV head for its q_per_tile rows (R = q_per_tile * G logit rows), so every K/V
    page is read once per (tile, KV head), not once per query head.
  * KV loop. Keys are visited `kv_per_tile` tokens at a time from the first visible key
    (0, or the sliding-window start) up to the tile's last query position; each key's page
    is read from the block table inside the kernel (block_tables[seq, pos // block_size],
    offset pos % block_size) and K/V rows are gathered straight from the paged arrays, for
    any block size: no contiguous copy. Keys at or past the sequence end are masked out
    and their values zeroed (stale NaN pages cannot leak).
  * Online softmax in base 2 with float32 accumulation; bf16/fp16 operands go to the
    tensor cores as-is, float32 as 3-pass TF32 (IEEE in interpret mode; triton/tuning.py).
    int8 / fp8 pages are converted to the query dtype in registers (to bf16 under f32
    queries, which are split into bf16 hi + lo parts: tuning.splits_f32_queries); their
    per-token scales multiply the logits (K) and the probabilities (V).
  * Split-K (`kv_splits`): when the grid is too small to fill the GPU, each tile's KV
    range is cut into splits whose partials (sized by the tiles, not the batch's T rows)
    are merged by `common.combine_splits`.
  * Rows no tile covers (padding) are zero: the output aliases a zero-initialised input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import common
from pallas_kernels import reference
from pallas_kernels import tiling
from pallas_kernels.triton import tuning

Q_DTYPES, PAGE_DTYPES = tuning.Q_DTYPES, tuning.PAGE_DTYPES
NUM_WARPS = tuning.NUM_WARPS
_LOG2E = math.log2(math.e)
_SQ = pl.Squeezed()  # a block dimension indexed by the grid and squeezed out of the ref


def check_supported(shapes: checks.AttentionShapes, q, k_pages) -> None:
  """What this kernel takes beyond `checks.check_ragged` (one-line ValueError)."""
  if shapes.rows < 1:
    raise ValueError(f"q has shape {tuple(q.shape)}; expected at least one row (T >= 1)")
  tuning.check_dtypes(shapes, q)
  if shapes.num_blocks < 1 or not 1 <= shapes.block_size <= 1024:
    raise ValueError(f"k_pages has shape {tuple(k_pages.shape)}; expected num_blocks >= 1 "
                     f"and a block_size (dim 2) in [1, 1024]")


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static launch parameters of the kernel (part of its jit key).

  Attributes:
    q_per_tile: query tokens per prefill tile, a power of two with q_per_tile x G_pad
      >= 16 logit rows (Triton's dot); with the key tile within sm_90 shared memory.
    short_q_per_tile: sequences with at most this many new queries (decode rows, short
      chunks) get one tile of this size in a first launch (a power of two <= q_per_tile;
      == q_per_tile: one launch for every sequence).
    kv_per_tile: keys per inner step, a power of two in [16, 1024].
    kv_splits: split-K factor of the short-sequence launch, in [1, 256].
    num_warps: one of 1, 2, 4, 8, 16. num_stages: in [1, 4].
  """
  q_per_tile: int
  short_q_per_tile: int
  kv_per_tile: int
  kv_splits: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    checks.check_int("q_per_tile", self.q_per_tile, 1, 1024, pow2=True)
    checks.check_int("short_q_per_tile", self.short_q_per_tile, 1, self.q_per_tile, pow2=True)
    checks.check_int("kv_per_tile", self.kv_per_tile, 16, 1024, pow2=True)
    checks.check_int("kv_splits", self.kv_splits, 1, 256)
    checks.check_choice("num_warps", self.num_warps, NUM_WARPS)
    checks.check_int("num_stages", self.num_stages, 1, 4)

  @classmethod
  def resolve(cls, shapes: checks.AttentionShapes, *, interpret: bool,
              **knobs) -> "TuningConfig":
    """The given knobs (None: default), checked against the sm_90 budgets
    (`tuning.ragged_knobs`: ~64 logit rows x 64 keys for bf16 at D <= 128; split-K fills
    ~2 GPU waves, 1 in interpret mode)."""
    return cls(**tuning.ragged_knobs(shapes, interpret=interpret, **knobs))


# ------------------------------------------------------------------------- kernel

def _ragged_kernel(
    # Scalar-like metadata, one entry per query tile (see pallas_kernels/tiling.py).
    tile_seq_ref,        # i32[num_tiles]   sequence id (clamped into [0, S))
    tile_row_start_ref,  # i32[num_tiles]   first q row of the tile
    tile_num_rows_ref,   # i32[num_tiles]   valid rows (0 for idle tiles)
    tile_pos_start_ref,  # i32[num_tiles]   position of the first row in its sequence
    block_tables_ref,    # i32[S, P]
    q_ref,               # [T, G, D]        query heads of this program's KV head
    k_ref,               # [NB, bs, D]      this KV head's K pages
    v_ref,               # [NB, bs, D]
    k_scales_ref,        # f32[NB, bs] | None
    v_scales_ref,        # f32[NB, bs] | None
    *refs,               # aliased initial outputs, then the outputs (see below)
    q_per_tile: int, kv_per_tile: int, kv_splits: int, sm_scale: float,
    soft_cap: Optional[float], sliding_window: Optional[int], precision, split_q: bool):
  # refs: the aliased input buffers (never read here: they only give the outputs their
  # initial content, zeros or the previous launch's rows), then the outputs: o_ref
  # [T, G, D] (normalised, q dtype) when kv_splits == 1; else (nothing aliased) this
  # (split, tile)'s acc_ref f32[tq, G, D], m_ref f32[tq, G], l_ref f32[tq, G].
  num_outs = 1 if kv_splits == 1 else 3
  out_refs = refs[len(refs) - num_outs:]
  tile, split = pl.program_id(0), pl.program_id(2)
  _, group, head_dim = q_ref.shape  # head_dim padded to a power of two
  num_blocks, block_size, page_head_dim = k_ref.shape
  pages_per_seq = block_tables_ref.shape[1]
  rows = q_per_tile * group
  # split_q (f32 q, int8 / fp8 pages): bf16 K/V against a bf16 hi + lo split of q and of
  # the probabilities, two bf16 MMAs per dot (tuning.splits_f32_queries).
  compute_dtype = jnp.bfloat16 if split_q else q_ref.dtype

  seq, row_start = tile_seq_ref[tile], tile_row_start_ref[tile]
  num_rows, pos_start = tile_num_rows_ref[tile], tile_pos_start_ref[tile]

  row_ok = jnp.arange(q_per_tile, dtype=jnp.int32) < num_rows            # [tq]
  q = plgpu.load(q_ref.at[pl.ds(row_start, q_per_tile)],
                 mask=row_ok[:, None, None], other=0)                     # [tq, G, D]
  q = q.reshape(rows, head_dim)
  q_parts = tuning.bf16_parts(q) if split_q else (q,)
  # Position of every logit row (row r is token r // G, head r % G).
  tok_pos = pos_start + jnp.arange(q_per_tile, dtype=jnp.int32)
  row_pos = jnp.broadcast_to(tok_pos[:, None], (q_per_tile, group)).reshape(rows)

  # Keys [kv_begin, kv_end) can be visible to some row of this tile.
  kv_end = jnp.where(num_rows > 0, pos_start + num_rows, 0)
  kv_begin = jnp.int32(0)
  if sliding_window is not None:
    kv_begin = jnp.maximum(pos_start - (sliding_window - 1), 0)
  kv_end = jnp.maximum(kv_end, kv_begin)
  first_tile = kv_begin // kv_per_tile
  end_tile = jnp.where(kv_end > kv_begin, (kv_end + kv_per_tile - 1) // kv_per_tile,
                       first_tile)
  if kv_splits > 1:
    per_split = (end_tile - first_tile + kv_splits - 1) // kv_splits
    first_tile = first_tile + split * per_split
    end_tile = jnp.minimum(end_tile, first_tile + per_split)
    end_tile = jnp.maximum(end_tile, first_tile)

  logit_scale = sm_scale if soft_cap is None else 1.0

  def load_kv(ref, page, offset, key_ok):
    if page_head_dim == head_dim:
      return ref[page, offset]                                                  # [tk, D]
    # head_dim 80 / 96: gather the real features, zeros up to the padded width.
    shape = (kv_per_tile, head_dim)
    feature = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    idx = (jnp.broadcast_to(page[:, None], shape), jnp.broadcast_to(offset[:, None], shape),
           jnp.minimum(feature, page_head_dim - 1))
    mask = (feature < page_head_dim) & key_ok[:, None]
    return plgpu.load(ref.at[idx], mask=mask, other=jnp.zeros(shape, ref.dtype))

  def body(kv_tile, carry):
    acc, m_prev, l_prev = carry
    key_pos = kv_tile * kv_per_tile + jnp.arange(kv_per_tile, dtype=jnp.int32)  # [tk]
    key_ok = key_pos < kv_end
    page_idx = jnp.minimum(key_pos // block_size, pages_per_seq - 1)
    page = block_tables_ref[seq, page_idx]                                      # [tk]
    # Keys past the causal bound are never used: point them at page 0 (always in
    # bounds) and clamp malformed entries so no load can leave the K/V arrays.
    page = jnp.clip(jnp.where(key_ok, page, 0), 0, num_blocks - 1)
    offset = key_pos % block_size
    k = load_kv(k_ref, page, offset, key_ok)                                    # [tk, D]
    if k.dtype != compute_dtype:
      k = k.astype(compute_dtype)
    logits = tuning.dot_parts(q_parts, k, ((1,), (1,)), precision)             # [R, tk]
    if k_scales_ref is not None:
      logits = logits * (k_scales_ref[page, offset] * logit_scale)[None, :]
    elif logit_scale != 1.0:
      logits = logits * logit_scale
    if soft_cap is not None:
      logits = jnp.tanh(logits * (sm_scale / soft_cap)) * soft_cap
    logits = logits * _LOG2E
    visible = (key_pos[None, :] <= row_pos[:, None]) & key_ok[None, :]
    if sliding_window is not None:
      visible &= key_pos[None, :] > row_pos[:, None] - sliding_window
    logits = jnp.where(visible, logits, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1))
    correction = jnp.exp2(m_prev - m_next)
    probs = jnp.where(visible, jnp.exp2(logits - m_next[:, None]), 0.0)       # [R, tk]
    l_next = correction * l_prev + jnp.sum(probs, axis=1)
    v = load_kv(v_ref, page, offset, key_ok)                                    # [tk, D]
    if v.dtype != compute_dtype:
      v = v.astype(compute_dtype)
    v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))  # 0 * NaN from stale pages
    if v_scales_ref is not None:
      v_scale = jnp.where(key_ok, v_scales_ref[page, offset], 0.0)
      probs = probs * v_scale[None, :]
    p_parts = tuning.bf16_parts(probs) if split_q else (probs.astype(compute_dtype),)
    pv = tuning.dot_parts(p_parts, v, ((1,), (0,)), precision)
    return correction[:, None] * acc + pv, m_next, l_next

  init = (jnp.zeros((rows, head_dim), jnp.float32),
          jnp.full((rows,), common.MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
  acc, m_i, l_i = lax.fori_loop(first_tile, end_tile, body, init)

  out_rows = pl.ds(row_start, q_per_tile)
  if kv_splits == 1:
    (o_ref,) = out_refs
    out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    plgpu.store(o_ref.at[out_rows], out.astype(o_ref.dtype).reshape(q_per_tile, group,
                                                                    head_dim),
                mask=row_ok[:, None, None])
  else:
    acc_ref, m_ref, l_ref = out_refs  # this tile's slot: rows past num_rows are unused
    acc_ref[...] = acc.reshape(q_per_tile, group, head_dim)
    m_ref[...] = m_i.reshape(q_per_tile, group)
    l_ref[...] = l_i.reshape(q_per_tile, group)


def _kernel_call(q4, k_pages, v_pages, block_tables, k_scales, v_scales, tiles, init, *,
                 q_per_tile, kv_splits, sem, cfg, interpret, precision, split_q):
  """One pallas_call over `tiles`; returns [T, Hkv, G, D] in q4.dtype: the tiles' rows
  (re)written, every other row as in `init` (aliased, or scattered into with split-K)."""
  num_tokens, num_kv_heads, group_p, head_dim = q4.shape
  _, num_blocks, block_size, _ = k_pages.shape
  num_seqs_max, pages_per_seq = block_tables.shape
  num_tiles = tiles.seq.shape[0]
  grid = (num_tiles, num_kv_heads, kv_splits)
  full_1d = pl.BlockSpec((num_tiles,), lambda j, h, s: (0,))
  per_head_q = pl.BlockSpec((num_tokens, _SQ, group_p, head_dim),
                            lambda j, h, s: (0, h, 0, 0))
  per_head_pages = pl.BlockSpec((_SQ, num_blocks, block_size, k_pages.shape[3]),
                                lambda j, h, s: (h, 0, 0, 0))
  per_head_scales = pl.BlockSpec((_SQ, num_blocks, block_size), lambda j, h, s: (h, 0, 0))
  in_specs = [
      full_1d, full_1d, full_1d, full_1d,
      pl.BlockSpec((num_seqs_max, pages_per_seq), lambda j, h, s: (0, 0)),
      per_head_q, per_head_pages, per_head_pages,
      None if k_scales is None else per_head_scales,
      None if v_scales is None else per_head_scales,
  ]
  args = [tiles.seq, tiles.row_start, tiles.num_rows, tiles.pos_start, block_tables, q4,
          k_pages, v_pages, k_scales, v_scales]
  if kv_splits == 1:
    out_shapes = [jax.ShapeDtypeStruct(q4.shape, q4.dtype)]
    out_specs = [per_head_q]
    inits = [init]
  else:
    # [splits, tiles, Hkv, tq, G(, D)]: one block per program, written whole.
    part = (kv_splits, num_tiles, num_kv_heads, q_per_tile, group_p)
    split_acc = pl.BlockSpec((_SQ, _SQ, _SQ, q_per_tile, group_p, head_dim),
                             lambda j, h, s: (s, j, h, 0, 0, 0))
    split_ml = pl.BlockSpec((_SQ, _SQ, _SQ, q_per_tile, group_p),
                            lambda j, h, s: (s, j, h, 0, 0))
    out_shapes = [jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                  jax.ShapeDtypeStruct(part, jnp.float32),
                  jax.ShapeDtypeStruct(part, jnp.float32)]
    out_specs = [split_acc, split_ml, split_ml]
    inits = []
  first_alias = len(jax.tree.leaves(args))  # None scales are empty pytrees: no operand
  kv_per_tile = cfg.kv_per_tile
  kernel = functools.partial(
      _ragged_kernel, q_per_tile=q_per_tile, kv_per_tile=kv_per_tile, kv_splits=kv_splits,
      sm_scale=sem.sm_scale, soft_cap=sem.soft_cap, sliding_window=sem.sliding_window,
      precision=precision, split_q=split_q)
  kv_len = pages_per_seq * block_size
  rows = num_tiles * q_per_tile * num_kv_heads * group_p
  cost = common.attention_cost(   # each tile reads its sequence's pages, up to kv_len
      q_tokens=num_tiles * q_per_tile, num_q_heads=num_kv_heads * group_p, kv_len=kv_len,
      kv_reads=num_tiles * kv_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
      page_dtype=k_pages.dtype, q_dtype=q4.dtype,
      out_dtype=q4.dtype if kv_splits == 1 else jnp.float32,
      quantized=k_scales is not None, soft_cap=sem.soft_cap,
      extra_bytes=(kv_splits - 1) * rows * head_dim * 4 + (kv_splits > 1) * 2 * kv_splits
      * rows * 4 + block_tables.size * 4)
  outs = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs + out_specs[:len(inits)],
      out_specs=out_specs,
      out_shape=out_shapes,
      input_output_aliases={first_alias + i: i for i in range(len(inits))},
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret,
      name=f"ragged_paged_attention_tq{q_per_tile}_tk{kv_per_tile}_s{kv_splits}",
      cost_estimate=cost,
  )(*args, *inits)
  if kv_splits == 1:
    return outs[0]
  acc, m, l = outs                     # [splits, tiles, Hkv, tq, G(, D)], maxima in base 2
  lse = jnp.where(l > 0, m / _LOG2E + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  part = common.combine_splits(            # split axis third from last: [tiles, Hkv, tq, G, D]
      jnp.moveaxis(acc / jnp.where(l > 0, l, 1.0)[..., None], 0, -3),
      jnp.moveaxis(lse, 0, -2)).astype(q4.dtype)
  part = jnp.swapaxes(part, 1, 2).reshape(num_tiles * q_per_tile, num_kv_heads, group_p,
                                          head_dim)
  local = jnp.arange(q_per_tile, dtype=jnp.int32)
  rows = tiles.row_start[:, None] + local[None, :]
  rows = jnp.where(local[None, :] < tiles.num_rows[:, None], rows, num_tokens)  # dropped
  return init.at[rows.reshape(-1)].set(part, mode="drop")


# ------------------------------------------------------------------------ wrapper

@functools.partial(jax.jit, static_argnames=("sem", "cfg", "interpret"))
def _ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                            k_scales, v_scales, *, sem: checks.Semantics, cfg: TuningConfig,
                            interpret: bool):
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  group = num_q_heads // num_kv_heads
  group_p = common.next_pow2(group)  # Triton tensors need power-of-two sizes.
  head_dim_p = tuning.padded_head_dim(head_dim)  # pages keep D: padded on load
  q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
  if group_p != group or head_dim_p != head_dim:
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_p - group), (0, head_dim_p - head_dim)))
  block_tables = block_tables.astype(jnp.int32)
  split_q = tuning.splits_f32_queries(q.dtype, k_pages.dtype)  # f32 q, int8 / fp8 pages
  launch = dict(sem=sem, cfg=cfg, interpret=interpret, split_q=split_q,
                precision=tuning.dot_precision(jnp.bfloat16 if split_q else q.dtype,
                                               interpret))
  out4 = jnp.zeros(q4.shape, q4.dtype)  # rows no tile covers (padding) stay zero
  for tile_class in tiling.tile_classes(num_tokens, cfg.q_per_tile, cfg.short_q_per_tile,
                                        cfg.kv_splits):
    tiles = tiling.query_tiles(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                               q_per_tile=tile_class.q_per_tile,
                               min_q_len=tile_class.min_q_len,
                               max_q_len=tile_class.max_q_len)
    out4 = _kernel_call(q4, k_pages, v_pages, block_tables, k_scales, v_scales, tiles, out4,
                        q_per_tile=tile_class.q_per_tile, kv_splits=tile_class.kv_splits,
                        **launch)
  return out4[:, :, :group, :head_dim].reshape(num_tokens, num_q_heads, head_dim)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           k_scales=None, v_scales=None, interpret=False,
                           q_per_tile=None, short_q_per_tile=None, kv_per_tile=None,
                           kv_splits=None, num_warps=None, num_stages=None):
  """Mixed prefill + decode paged attention (Pallas, Triton GPU backend).

  Args:
    q: [T, Hq, D] new queries of all sequences, concatenated (float32/bfloat16/float16).
    k_pages, v_pages: [Hkv, NB, bs, D] paged cache of one layer (same dtype as q, or
      int8 / float8_e4m3fn with scales, or any other float dtype, converted to q.dtype).
    block_tables: i32[S, P]; token p of sequence i is at page block_tables[i, p // bs],
      offset p % bs. Entries past a sequence's length may hold anything (-1, garbage).
    kv_lens: i32[S] tokens of each sequence in the cache, this step's new ones included.
    cu_q_lens: i32[S + 1] cumulative new-query counts (cu_q_lens[0] == 0); sequence i owns
      rows cu_q_lens[i]:cu_q_lens[i+1] at positions kv_lens[i] - q_len_i .. kv_lens[i]-1.
    num_seqs: i32 scalar (traced or int): sequences >= num_seqs are ignored; rows at or
      past cu_q_lens[num_seqs] are padding and come back as zeros.
    sm_scale: logit scale (None: 1/sqrt(D)). soft_cap: c -> logits = c*tanh(logits/c).
    sliding_window: W -> a query at position p sees keys in (p - W, p].
    k_scales, v_scales: f32[Hkv, NB, bs] per-token dequantisation scales or None.
    interpret: run the Pallas interpreter (CPU tests) instead of compiling for the GPU.
    q_per_tile, short_q_per_tile, kv_per_tile, kv_splits, num_warps, num_stages: the
      tuning knobs (`TuningConfig`); None takes triton/tuning.py's sm_90 default (a tile
      of ~64 logit rows and 64 keys for bf16 at D <= 128; kv_splits 1 in interpret mode).
  Any D in [16, 256] runs; one that is not a power of two (80, 96) is computed as the next
  (q zero-padded, K/V loaded with a feature mask). float32 dots are 3-pass TF32 on the GPU.

  Returns:
    [T, Hq, D] in q.dtype.
  Raises:
    ValueError naming the argument, before any tracing of the kernel.
  """
  shapes = checks.check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                               num_seqs, k_scales, v_scales)
  check_supported(shapes, q, k_pages)
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=shapes.head_dim)
  cfg = TuningConfig.resolve(shapes, interpret=bool(interpret), q_per_tile=q_per_tile,
                             short_q_per_tile=short_q_per_tile, kv_per_tile=kv_per_tile,
                             kv_splits=kv_splits, num_warps=num_warps, num_stages=num_stages)
  return _ragged_paged_attention(
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, jnp.asarray(num_seqs, jnp.int32),
      k_scales, v_scales, sem=sem, cfg=cfg, interpret=bool(interpret))


# The plain-jnp oracle of this op (same arguments, no tuning knobs): pallas_kernels/reference.py.
ragged_paged_attention_reference = reference.ragged_paged_attention_reference
