"""Paged decode attention as a Pallas kernel on the GPU Triton backend.

One query token per sequence attends to that sequence's K/V, which live in fixed-size
pages scattered through a shared pool. The kernel reads the sequence's block table
itself (one small vector load per tile of pages) and loads those pages straight from the
pool: no gather of the cache into a contiguous copy, and nothing past a sequence's
length is loaded (every page load is masked by position).

Each loop step handles `tile_tokens` tokens (default 128 for bf16/fp16 at D <= 128, from
the sm_90 resource model in triton/tuning.py): several whole pages when pages are small
(the tile stays big enough for Triton's 16-wide dot), or one slice of a page when a page
is bigger than the tile. float32 runs its dots as 3-pass TF32 on the GPU (IEEE in
interpret mode); float32 queries over int8 / fp8 pages run two bf16 dots (q split into
bf16 hi + lo, pages exact in bf16: tuning.splits_f32_queries); a head_dim that is not a
power of two (80, 96) is computed padded to the next one (q zero-padded, K/V loaded with
a feature mask: the pool is never copied).

Grid: (batch, num_kv_heads, num_splits). One program serves ALL query heads that share
one KV head (GQA / MQA), so each K/V page is read once per KV head; its query tile is
[q_heads_per_kv padded to >= 16 rows, head_dim] because Triton's dot needs 16 rows.
Split-K ("flash-decoding"): each sequence's live page range is divided evenly between
the `num_splits` programs of that (sequence, KV head), per sequence at run time, so short
and long sequences alike use every split; each split writes a normalized partial output
and its log-sum-exp, and the wrapper combines them stably.

Layout (see paged_jax/kv_cache.py; semantics in pallas_kernels/reference.py):
  q [B, Hq, D]; k_pages, v_pages [Hkv, NB, bs, D]; k_scales, v_scales f32[Hkv, NB, bs];
  block_tables i32[B, P]; lengths i32[B]  ->  [B, Hq, D].

Structure follows jax/experimental/pallas/ops/gpu: the checks and the frozen
`TuningConfig`, the kernel body, the pallas_call wrapper, the public entry with
keyword-only tuning knobs, and the plain-jnp reference it is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import common
from pallas_kernels import reference
from pallas_kernels.triton import tuning

SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
Q_DTYPES, PAGE_DTYPES = tuning.Q_DTYPES, tuning.PAGE_DTYPES
NUM_WARPS = tuning.NUM_WARPS
_MIN_TILE_TOKENS = 16
_MIN_Q_ROWS = 16           # Triton's tl.dot needs M, N, K >= 16.


def check_supported(shapes: checks.AttentionShapes, q, k_pages, k_scales) -> None:
  """What this kernel takes beyond `checks.check_decode` (one-line ValueError)."""
  if shapes.block_size not in SUPPORTED_BLOCK_SIZES:
    raise ValueError(f"k_pages has shape {tuple(k_pages.shape)}; expected a block_size "
                     f"(dim 2) that is a power of two in [1, 256] (Triton decode kernel)")
  tuning.check_dtypes(shapes, q)
  page = shapes.page_dtype.name
  quantized = page in ("int8", "float8_e4m3fn")
  if quantized and not shapes.quantized:
    raise ValueError(f"k_pages has dtype {page}; {page} pages need k_scales and v_scales "
                     f"f32{list(k_pages.shape[:3])}")
  if not quantized and page != shapes.q_dtype.name:
    raise ValueError(f"k_pages has dtype {page}; expected q's dtype {shapes.q_dtype.name} "
                     f"(or int8 / float8_e4m3fn with scales)")
  if k_scales is not None and jnp.dtype(k_scales.dtype) != jnp.float32:
    raise ValueError(f"k_scales has dtype {jnp.dtype(k_scales.dtype).name}; expected float32")


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static launch parameters of the kernel (part of its jit key).

  Attributes:
    tile_tokens: tokens per loop step, a power of two >= 16 (whole pages when block_size
      <= tile_tokens, else slices of one page); at most what the sm_90 shared memory holds
      for the dtype / head_dim / stages (`resolve` checks).
    num_splits: split-K partitions per (sequence, KV head), in [1, 256].
    num_warps: Triton warps per program, one of 1, 2, 4, 8, 16.
    num_stages: Triton software-pipelining stages, in [1, 4].
  """
  tile_tokens: int
  num_splits: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    checks.check_int("tile_tokens", self.tile_tokens, _MIN_TILE_TOKENS, None, pow2=True)
    checks.check_int("num_splits", self.num_splits, 1, 256)
    checks.check_choice("num_warps", self.num_warps, NUM_WARPS)
    checks.check_int("num_stages", self.num_stages, 1, 4, why="Triton software pipelining")

  @classmethod
  def resolve(cls, shapes: checks.AttentionShapes, **knobs) -> "TuningConfig":
    """The given knobs (None: default), checked against the sm_90 budgets
    (`tuning.decode_knobs`: `decode_defaults`, `default_num_splits`)."""
    return cls(**tuning.decode_knobs(shapes, **knobs))


# ------------------------------------------------------------------------- kernel

def _load_pages(ref, page_ids, tok_ids, mask, width=None):
  """Masked load of tokens `tok_ids` of pages `page_ids`: ref [NB, bs, *rest] ->
  [ppt, tpp, *rest] (ppt = len(page_ids), tpp = len(tok_ids)).

  Every dimension gets an integer index array (page id, token in page, then an iota per
  remaining dimension): Triton turns this into one pointer tensor, and the Pallas
  interpreter into a plain gather (it cannot mix array and slice indices). Masked-off
  elements are never read from memory and come back as 0. `width` (> rest[-1]) pads the
  last dimension with zeros in registers (head_dim 80 / 96 computed as 128).
  """
  rest = list(ref.shape[2:])
  real_last = rest[-1] if rest else None
  if width is not None and width != real_last:
    rest[-1] = width
  full = (page_ids.shape[0], tok_ids.shape[0]) + tuple(rest)
  rank = len(full)

  def along(axis, values):
    shape = [1] * rank
    shape[axis] = values.shape[0]
    return jnp.broadcast_to(values.reshape(shape), full)

  idx = [along(0, page_ids), along(1, tok_ids)]
  idx += [along(axis, jnp.arange(size, dtype=jnp.int32))
          for axis, size in enumerate(rest, start=2)]
  if rest and rest[-1] != real_last:
    feature = idx[-1]
    idx[-1] = jnp.minimum(feature, real_last - 1)   # padded features: masked, in bounds
    mask = jnp.logical_and(mask, feature < real_last)
  return plgpu.load(ref.at[tuple(idx)], mask=mask, other=jnp.zeros(full, ref.dtype))


def _decode_kernel(
    lengths_ref,  # i32[B] (whole array; this program reads lengths_ref[b])
    tables_ref,   # i32[P_pad] block-table row of sequence b, zero-padded past P
    q_ref,        # [G_pad, D] query heads of KV head h (rows >= G are zero padding)
    k_ref,        # [NB, bs, D] every page of KV head h
    v_ref,        # [NB, bs, D]
    k_scale_ref,  # f32[NB, bs] or None
    v_scale_ref,  # f32[NB, bs] or None
    o_ref,        # [G_pad, D] this split's output, normalized by its own softmax sum
    lse_ref,      # f32[G_pad] this split's log-sum-exp (-inf when it saw no key)
    *,
    num_splits: int,
    tile_tokens: int,
    pages_per_seq: int,
    sm_scale: float,
    soft_cap: Optional[float],
    sliding_window: Optional[int],
    compute_dtype,
    precision,
    split_q: bool,
):
  b = pl.program_id(0)
  split = pl.program_id(2)
  num_blocks, block_size, _ = k_ref.shape
  q_rows, head_dim = q_ref.shape  # head_dim padded to a power of two (pages keep theirs)
  # A loop step covers `tile_tokens` tokens: several whole pages when pages are small, or
  # one slice of a page when a page is bigger than the tile (`subtiles` steps per page).
  pages_per_tile = max(1, tile_tokens // block_size)
  tokens_per_page = min(block_size, tile_tokens)
  subtiles = block_size // tokens_per_page

  # Token range [start_tok, end_tok) this query sees, and its pages [first, end).
  end_tok = jnp.minimum(lengths_ref[b], pages_per_seq * block_size)
  end_tok = jnp.maximum(end_tok, 0)
  start_tok = 0 if sliding_window is None else jnp.maximum(end_tok - sliding_window, 0)
  first_page = start_tok // block_size
  end_page = pl.cdiv(end_tok, block_size)
  # Even division of this sequence's live pages between the splits, in whole page tiles.
  tiles_total = pl.cdiv(end_page - first_page, pages_per_tile)
  pages_per_split = pl.cdiv(tiles_total, num_splits) * pages_per_tile
  lo = first_page + split * pages_per_split
  hi = jnp.minimum(lo + pages_per_split, end_page)
  num_steps = pl.cdiv(jnp.maximum(hi - lo, 0), pages_per_tile) * subtiles

  # split_q (f32 q, int8 / fp8 pages): bf16 hi + lo parts against bf16 K/V (tuning.py).
  q = q_ref[...]
  q_parts = tuning.bf16_parts(q.astype(jnp.float32)) if split_q else (q.astype(compute_dtype),)
  page_in_tile = jnp.arange(pages_per_tile, dtype=jnp.int32)
  tok_in_tile = jnp.arange(tokens_per_page, dtype=jnp.int32)

  def body(t, carry):
    o, m, l = carry
    if subtiles == 1:
      tile_lo, tok_ids = lo + t * pages_per_tile, tok_in_tile
    else:  # one page per step (pages_per_tile == 1), `subtiles` slices of it
      sub = jnp.int32(subtiles)
      tile_lo = lo + lax.div(t, sub)
      tok_ids = lax.rem(t, sub) * tokens_per_page + tok_in_tile        # [tpp] within page
    pages = tile_lo + page_in_tile                                    # [ppt]
    page_live = pages < hi
    page_ids = plgpu.load(tables_ref.at[pl.ds(tile_lo, pages_per_tile)],
                          mask=page_live, other=0)                    # [ppt]
    pos = pages[:, None] * block_size + tok_ids[None, :]              # [ppt, tpp]
    live = page_live[:, None] & (pos >= start_tok) & (pos < end_tok)  # [ppt, tpp]
    live3 = jnp.broadcast_to(live[:, :, None],
                             (pages_per_tile, tokens_per_page, head_dim))
    k = _load_pages(k_ref, page_ids, tok_ids, live3, head_dim)        # [ppt, tpp, D]
    v = _load_pages(v_ref, page_ids, tok_ids, live3, head_dim)
    k = k.reshape(tile_tokens, head_dim).astype(compute_dtype)
    v = v.reshape(tile_tokens, head_dim).astype(compute_dtype)
    live_row = live.reshape(1, tile_tokens)

    logits = tuning.dot_parts(q_parts, k, ((1,), (1,)), precision)   # f32[G_pad, T]
    if k_scale_ref is not None:
      k_scale = _load_pages(k_scale_ref, page_ids, tok_ids, live)
      logits = logits * k_scale.reshape(1, tile_tokens)
    logits = logits * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(live_row, logits, common.MASK_VALUE)

    m_new = jnp.maximum(m, jnp.max(logits, axis=1))                   # [G_pad]
    alpha = jnp.exp(m - m_new)
    p = jnp.where(live_row, jnp.exp(logits - m_new[:, None]), 0.0)    # f32[G_pad, T]
    l_new = alpha * l + jnp.sum(p, axis=1)
    if v_scale_ref is not None:
      v_scale = _load_pages(v_scale_ref, page_ids, tok_ids, live)
      p = p * v_scale.reshape(1, tile_tokens)
    p_parts = tuning.bf16_parts(p) if split_q else (p.astype(compute_dtype),)
    pv = tuning.dot_parts(p_parts, v, ((1,), (0,)), precision)       # f32[G_pad, D]
    return alpha[:, None] * o + pv, m_new, l_new

  o = jnp.zeros((q_rows, head_dim), jnp.float32)
  m = jnp.full((q_rows,), common.MASK_VALUE, jnp.float32)
  l = jnp.zeros((q_rows,), jnp.float32)
  o, m, l = lax.fori_loop(0, num_steps, body, (o, m, l))

  seen = l > 0
  o_ref[...] = (o / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


# ------------------------------------------------------------------------ wrapper

@functools.partial(jax.jit, static_argnames=("sem", "cfg", "interpret"))
def _paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, *,
                     sem: checks.Semantics, cfg: TuningConfig, interpret: bool):
  sm_scale, soft_cap, sliding_window = sem
  tile_tokens, num_splits = cfg.tile_tokens, cfg.num_splits
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  pages_per_seq = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  q_rows = max(_MIN_Q_ROWS, common.next_pow2(group))
  head_dim_p = tuning.padded_head_dim(head_dim)  # pages stay [.., D]: padded on load

  q4 = q.reshape(batch, num_kv_heads, group, head_dim)
  if q_rows != group or head_dim_p != head_dim:
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, q_rows - group), (0, head_dim_p - head_dim)))
  # Zero-pad the table so every tile's vector load of page ids stays inside the row.
  pages_per_tile = max(1, tile_tokens // block_size)
  tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_tile)))
  tables_width = tables.shape[1]

  # f32: 3-pass TF32 on the GPU, IEEE in the interpreter; f32 q over int8 / fp8 pages:
  # bf16 K/V and a bf16 hi + lo split of q and p (see triton/tuning.py).
  split_q = tuning.splits_f32_queries(q.dtype, k_pages.dtype)
  compute_dtype = jnp.bfloat16 if split_q else q.dtype
  precision = tuning.dot_precision(compute_dtype, interpret)
  out_dtype = q.dtype if num_splits == 1 else jnp.float32

  kernel = functools.partial(
      _decode_kernel, num_splits=num_splits, tile_tokens=tile_tokens,
      pages_per_seq=pages_per_seq, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, compute_dtype=compute_dtype, precision=precision,
      split_q=split_q)
  pages_spec = pl.BlockSpec((None, num_blocks, block_size, head_dim),
                            lambda b, h, s: (h, 0, 0, 0))
  scale_spec = pl.BlockSpec((None, num_blocks, block_size), lambda b, h, s: (h, 0, 0))
  kv_len = pages_per_seq * block_size
  rows = batch * num_kv_heads * q_rows
  cost = common.attention_cost(
      q_tokens=batch, num_q_heads=num_kv_heads * q_rows, kv_len=kv_len,
      kv_reads=batch * kv_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
      page_dtype=k_pages.dtype, q_dtype=q.dtype, out_dtype=out_dtype,
      quantized=k_scales is not None, soft_cap=soft_cap,
      extra_bytes=(num_splits - 1) * rows * head_dim_p * jnp.dtype(out_dtype).itemsize
      + num_splits * rows * 4 + batch * tables_width * 4)
  o, lse = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, num_splits),
      in_specs=[
          pl.BlockSpec(),                                                       # lengths
          pl.BlockSpec((None, tables_width), lambda b, h, s: (b, 0)),            # tables
          pl.BlockSpec((None, None, q_rows, head_dim_p), lambda b, h, s: (b, h, 0, 0)),
          pages_spec,                                                           # k_pages
          pages_spec,                                                           # v_pages
          None if k_scales is None else scale_spec,
          None if v_scales is None else scale_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, q_rows, head_dim_p),
                       lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, q_rows), lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, q_rows, head_dim_p),
                               out_dtype),
          jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, q_rows), jnp.float32),
      ],
      interpret=interpret,
      # Passing Triton's params pins the Triton backend (not Mosaic GPU) on every JAX.
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      name=f"paged_decode_bs{block_size}_tile{tile_tokens}_splits{num_splits}",
      cost_estimate=cost,
  )(lengths.astype(jnp.int32), tables, q4, k_pages, v_pages, k_scales, v_scales)

  if num_splits == 1:
    out = o[:, :, 0]
  else:
    out = common.combine_splits(o, lse)
  out = out[:, :, :group, :head_dim]
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                    interpret=False, num_splits=None, tile_tokens=None, num_warps=None,
                    num_stages=None):
  """Decode attention over a paged KV cache (one query token per sequence).

  Args:
    q: [B, Hq, D] float32 / bfloat16 / float16; D in [16, 256] (a D that is not a power
      of two, e.g. 80 / 96, is computed as the next power of two: q padded with zeros,
      pages loaded with a feature mask, nothing copied).
    k_pages, v_pages: [Hkv, NB, bs, D] in q's dtype, or int8 / float8_e4m3fn with scales;
      bs a power of two in [1, 256]; Hkv divides Hq.
    block_tables: i32[B, P]; entries past a sequence's length are never read.
    lengths: i32[B] tokens per sequence (the query sits at position lengths[b] - 1);
      0 gives zeros; values above P * bs are clamped to P * bs.
    sm_scale: logit scale, default 1/sqrt(D). soft_cap: c * tanh(logits / c).
    sliding_window: W, the query sees the last W tokens only.
    k_scales, v_scales: f32[Hkv, NB, bs] per-token dequantization scales.
    interpret: run the Pallas interpreter (CPU) instead of compiling for the GPU.
    num_splits: split-K partitions per (sequence, KV head); default
      `tuning.default_num_splits`.
    tile_tokens: tokens per loop step (power of two >= 16, up to what the sm_90 shared
      memory budget allows for the dtype / head_dim / stages): whole pages when
      block_size <= tile_tokens, else slices of one page; default
      `tuning.decode_defaults` (per q / page dtype and head_dim).
    num_warps, num_stages: Triton launch parameters (default `tuning.decode_defaults`
      for its tile, else `tuning.default_num_warps`; stages in [1, 4], default 3).
  Returns:
    [B, Hq, D] in q's dtype, accumulated in float32. float32 dots run as 3-pass TF32 on
    the GPU (~1e-6 relative error) and IEEE f32 in interpret mode (triton/tuning.py).
  Raises:
    ValueError naming the argument and its allowed range, before any tracing.
  """
  shapes = checks.check_decode(q, k_pages, v_pages, block_tables, lengths, k_scales,
                               v_scales)
  check_supported(shapes, q, k_pages, k_scales)
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=shapes.head_dim)
  cfg = TuningConfig.resolve(shapes, tile_tokens=tile_tokens, num_splits=num_splits,
                             num_warps=num_warps, num_stages=num_stages)
  return _paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales,
                          sem=sem, cfg=cfg, interpret=bool(interpret))


# The plain-jnp oracle of this op (same arguments, no tuning knobs): pallas_kernels/reference.py.
paged_attention_reference = reference.paged_attention_reference
