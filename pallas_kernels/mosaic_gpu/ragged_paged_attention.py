"""Ragged (mixed prefill + decode) paged attention on the Mosaic GPU backend (sm_90a).

Same contract as `triton/ragged_paged_attention.py` and
`reference.ragged_paged_attention_reference`: sequence i's new queries
q[cu_q_lens[i]:cu_q_lens[i+1]] sit at positions kv_lens[i] - q_len_i .. kv_lens[i] - 1,
attend causally (and within a sliding window), rows past cu_q_lens[num_seqs] are zeros.

Design (the decode kernel's pipeline, mosaic_gpu/pipeline.py, with query tiles):
  * Query tiles, planned outside the kernel in jnp (pallas_kernels/tiling.py): each live
    sequence's rows are cut into tiles of `q_per_tile` tokens (default 64 // G, so that
    q_per_tile * G <= 64 logit rows fill one wgmma M tile); tile j is (sequence, first q
    row, rows, first position). The grid has the static bound min(T, cdiv(T, q_per_tile)
    + S) tiles; tiles past the real count see no keys and write nothing that is read back.
  * The query is laid out KV-head-major, [Hkv, T * G, D], so a tile's q_per_tile tokens x
    G heads are 64 consecutive rows, gathered in jnp into [Hkv, tiles, 64, D] (one aligned
    TMA per tile). Rows of the next tile are computed and discarded.
  * Per program (KV head, tile, split): keys from the first visible one (0 or the window
    start of the tile's first row) to the tile's last position, one TMA per page (or page
    slice) into the shared-memory ring, wgmma QK^T / PV, causal + window mask per row,
    online softmax, split-K partials merged in jnp. Output rows are scattered back to
    [T, Hq, D] by a gather in the wrapper.

Supported shapes and dtypes: those of the decode kernel (`supported_reason`, int8 / fp8
pages with scales included), q_per_tile * G <= 64.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import common
from pallas_kernels import reference
from pallas_kernels import tiling
from pallas_kernels.mosaic_gpu import pipeline as core
from pallas_kernels.mosaic_gpu.pipeline import plgpu

_Q_ROWS = core.Q_ROWS


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static launch parameters of the kernel (part of its jit key).

  Attributes:
    q_per_tile: query tokens per tile, q_per_tile * G <= 64 (one wgmma M tile).
    num_splits: split-K partitions per tile, in [1, 256].
    tile_kv: keys per loop step, 64 or 128.
    num_stages: depth of the shared-memory K/V ring, in [1, 8] and within sm_90's 227 KiB.
  """
  q_per_tile: int
  num_splits: int
  tile_kv: int
  num_stages: int

  def __post_init__(self):
    checks.check_int("q_per_tile", self.q_per_tile, 1, _Q_ROWS)
    checks.check_int("num_splits", self.num_splits, 1, 256)
    core.check_tile_kv(self.tile_kv)
    checks.check_int("num_stages", self.num_stages, 1, 8)

  @classmethod
  def resolve(cls, shapes: checks.AttentionShapes, *, q_per_tile=None, num_splits=1,
              tile_kv=64, num_stages=None) -> "TuningConfig":
    """The given knobs, checked, and defaults for the rest (64 // G query tokens, the
    deepest ring that fits: `pipeline.default_num_stages`)."""
    tile_kv = core.check_tile_kv(tile_kv)
    checks.check_int("num_splits", num_splits, 1, 256)
    stages = core.check_num_stages(num_stages, shapes.head_dim, tile_kv,
                                   1 if shapes.quantized else None)
    group = shapes.group
    q_per_tile = _Q_ROWS // group if q_per_tile is None else q_per_tile
    checks.check_int("q_per_tile", q_per_tile, 1, _Q_ROWS // group,
                     why=f"q_per_tile x {group} query heads <= {_Q_ROWS} rows")
    return cls(q_per_tile=int(q_per_tile), num_splits=int(num_splits), tile_kv=tile_kv,
               num_stages=stages)


def _ragged_kernel(
    kv_lens_ref,   # i32[S] (GMEM scalars)
    tables_ref,    # i32[S, P]
    tile_seq_ref,  # i32[N] sequence of each tile
    tile_n_ref,    # i32[N] live tokens of each tile (0: an empty tile past the real count)
    tile_pos_ref,  # i32[N] position of the tile's first token
    q_ref,         # [Hkv, N, 64, D] query rows of each tile (tokens x G heads)
    k_ref, v_ref,  # [Hkv, NB, bs, D]
    ks_ref, vs_ref,  # f32[Hkv, NB, bs] per-token scales (int8 / fp8 pages) or None
    o_ref,         # [Hkv, N, splits, 64, D] per-tile, per-split normalized partials
    lse_ref,       # f32[Hkv, N, splits, 64]
    scratch, *, group, sliding_window, **pipeline):
  h, j, split = lax.axis_index("h"), lax.axis_index("t"), lax.axis_index("s")
  _, num_blocks, block_size, _ = k_ref.shape
  pages_per_seq = tables_ref.shape[1]
  tile_kv = pipeline["tile_kv"]
  seq = tile_seq_ref[j]
  n_tok, pos0 = tile_n_ref[j], tile_pos_ref[j]
  kv_len = jnp.clip(kv_lens_ref[seq], 0, pages_per_seq * block_size)
  # Keys [start_tok, end_tok) seen by any row of this tile.
  end_tok = jnp.where(n_tok > 0, jnp.minimum(pos0 + n_tok, kv_len), 0)
  start_tok = (jnp.int32(0) if sliding_window is None
               else jnp.maximum(pos0 - sliding_window + 1, 0))
  start_tok = jnp.minimum(start_tok, end_tok)
  # Position of each logit row's query (-1: a row of no token of this tile).
  row_tok = lax.div(plgpu.broadcasted_iota(jnp.int32, (_Q_ROWS, tile_kv), 0,
                                           layout=plgpu.Layout.WGMMA), jnp.int32(group))
  row_pos = jnp.where(row_tok < n_tok, pos0 + row_tok, -1)

  def live_fn(key):
    live = (key <= row_pos) & (key < kv_len)
    if sliding_window is not None:
      live = live & (key > row_pos - sliding_window)
    return live

  core.attend_pages(
      scratch, q_ref.at[h, j], k_ref, v_ref, ks_ref, vs_ref, o_ref.at[h, j, split],
      lse_ref.at[h, j, split], h=h, page_of=core.page_lookup(tables_ref, seq, num_blocks),
      start_tok=start_tok, end_tok=end_tok, live_fn=live_fn, split=split, **pipeline)


def num_query_tiles(num_tokens: int, num_seqs_max: int, q_per_tile: int) -> int:
  """The grid's static tile count: cdiv(T, q_per_tile) + S, at most T (one more than
  `tiling.max_query_tiles` when q_per_tile does not divide T; kept so the compiled grid
  stays the one measured in the compile report)."""
  return max(1, min(num_tokens, common.cdiv(num_tokens, q_per_tile) + num_seqs_max))


@functools.partial(jax.jit, static_argnames=("sem", "cfg", "interpret"))
def _ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                            k_scales, v_scales, *, sem: checks.Semantics, cfg: TuningConfig,
                            interpret: bool):
  q_per_tile, num_splits = cfg.q_per_tile, cfg.num_splits
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  dtype = q.dtype
  cu_q_lens = cu_q_lens.astype(jnp.int32)
  kv_lens = kv_lens.astype(jnp.int32)
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  n_max = num_query_tiles(num_tokens, kv_lens.shape[0], q_per_tile)
  tiles = tiling.query_tiles(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                             q_per_tile=q_per_tile, num_tiles=n_max)
  tok_tile, tok_row, tok_live = tiling.token_tiles(cu_q_lens, num_seqs, num_tokens=num_tokens,
                                                   q_per_tile=q_per_tile)
  q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
  q_rows = q_rows.reshape(num_kv_heads, num_tokens * group, head_dim)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, _Q_ROWS), (0, 0)))       # [Hkv, T*G + 64, D]
  # Each tile's 64 rows, gathered here (a TMA at a dynamic, unaligned row offset of the
  # swizzled tile would not lower): [Hkv, N, 64, D].
  seq, first_row, n_tok, pos0 = tiles
  q_tiles = q_rows[:, first_row[:, None] * group + jnp.arange(_Q_ROWS)[None, :]]

  inputs = [kv_lens, block_tables.astype(jnp.int32), seq, n_tok, pos0, q_tiles, k_pages,
            v_pages]
  o, lse = core.launch(
      _ragged_kernel, inputs, k_pages, k_scales, v_scales, sem=sem, cfg=cfg, dtype=dtype,
      out_lead=(num_kv_heads, n_max, num_splits), grid=(num_kv_heads, n_max, num_splits),
      grid_names=("h", "t", "s"),
      name=f"ragged_paged_mgpu_bs{block_size}_q{q_per_tile}_splits{num_splits}",
      interpret=interpret, group=group)

  # Gather each token's G rows back: [Hkv, T, G, D] -> [T, Hq, D].
  rows = tok_row[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]  # [T, G]
  o_tok = o[:, tok_tile[:, None], :, rows]            # [T, G, Hkv, splits, D]
  lse_tok = lse[:, tok_tile[:, None], :, rows]        # [T, G, Hkv, splits]
  if num_splits == 1:
    out = o_tok[:, :, :, 0].astype(jnp.float32)
  else:
    # Split axis last-but-one: [T, G, Hkv, splits, 1, D] / [T, G, Hkv, splits, 1].
    out = common.combine_splits(o_tok[..., None, :].astype(jnp.float32),
                                lse_tok[..., None])[..., 0, :]
  out = jnp.where(tok_live[:, None, None, None], out, 0.0)   # [T, G, Hkv, D]
  return out.transpose(0, 2, 1, 3).reshape(num_tokens, num_q_heads, head_dim).astype(dtype)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           k_scales=None, v_scales=None, interpret=False, q_per_tile=None,
                           num_splits=1, tile_kv=64, num_stages=None):
  """Mixed prefill + decode paged attention on the Mosaic GPU backend (sm_90a).

  Args: as the Triton `ragged_paged_attention` (q [T, Hq, D], k/v_pages [Hkv, NB, bs, D],
    block_tables i32[S, P], kv_lens i32[S], cu_q_lens i32[S + 1], num_seqs i32 scalar),
    k_scales / v_scales (int8 / fp8 pages), with the decode kernel's support limits
    (`pipeline.supported_reason`: bf16 / f16 q, bs >= 16, D 64 / 128 / 256, G <= 64).
    q_per_tile: query tokens per tile (default 64 // G; q_per_tile * G <= 64).
    num_splits: split-K partitions per tile (default 1). tile_kv: 64 or 128.
    num_stages: K/V shared-memory ring depth (default: deepest of 3, 2, 1 that fits).
    interpret: GPU interpret mode on a CPU (jax >= 0.11.2), race detection on.
  Returns:
    [T, Hq, D] in q's dtype; rows past cu_q_lens[num_seqs] are zeros.
  Raises:
    ValueError naming the argument (checks.check_ragged), or what this kernel does not
    support, before any tracing.
  """
  shapes = checks.check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                               num_seqs, k_scales, v_scales)
  core.check_supported("ragged_paged_attention", shapes, bool(interpret))
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=shapes.head_dim)
  cfg = TuningConfig.resolve(shapes, q_per_tile=q_per_tile, num_splits=num_splits,
                             tile_kv=tile_kv, num_stages=num_stages)
  return _ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                                 num_seqs, k_scales, v_scales, sem=sem, cfg=cfg,
                                 interpret=bool(interpret))


# The plain-jnp oracle of this op (same arguments, no tuning knobs): pallas_kernels/reference.py.
ragged_paged_attention_reference = reference.ragged_paged_attention_reference
