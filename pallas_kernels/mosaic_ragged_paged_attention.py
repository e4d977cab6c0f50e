"""Ragged (mixed prefill + decode) paged attention on the Mosaic GPU backend (sm_90a).

Same contract as `ragged_paged_attention.ragged_paged_attention` (Triton) and
`reference.ragged_paged_attention_reference`: sequence i's new queries
q[cu_q_lens[i]:cu_q_lens[i+1]] sit at positions kv_lens[i] - q_len_i .. kv_lens[i] - 1,
attend causally (and within a sliding window), rows past cu_q_lens[num_seqs] are zeros.

Design (the decode kernel's pipeline, mosaic_paged_attention.py, with query tiles):
  * Query tiles, planned outside the kernel in jnp: each live sequence's rows are cut into
    tiles of `q_per_tile` tokens (default 64 // G, so that q_per_tile * G <= 64 logit rows
    fill one wgmma M tile); tile j is (sequence, first q row, rows, first position).
    The grid has the static bound min(T, T // q_per_tile + S) tiles; tiles past the real
    count see no keys and write nothing that is read back.
  * The query is laid out KV-head-major, [Hkv, T * G, D], so a tile's q_per_tile tokens x
    G heads are 64 consecutive rows, gathered in jnp into [Hkv, tiles, 64, D] (one aligned
    TMA per tile). Rows of the next tile are computed and discarded.
  * Per program (KV head, tile, split): keys from the first visible one (0 or the window
    start of the tile's first row) to the tile's last position, one TMA per page (or page
    slice) into the shared-memory ring, wgmma QK^T / PV, causal + window mask per row,
    online softmax, split-K partials merged in jnp. Output rows are scattered back to
    [T, Hq, D] by a gather in the wrapper.

Supported shapes and dtypes: those of the decode kernel (`supported_reason`), q_per_tile
* G <= 64.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import mosaic_paged_attention as decode
from pallas_kernels.mosaic_paged_attention import pl, plgpu

_Q_ROWS = decode._Q_ROWS  # pylint: disable=protected-access
_MASK_VALUE = decode._MASK_VALUE  # pylint: disable=protected-access
_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)


def _ragged_kernel(
    kv_lens_ref,   # i32[S] (GMEM scalars)
    tables_ref,    # i32[S, P]
    tile_seq_ref,  # i32[N] sequence of each tile
    tile_n_ref,    # i32[N] live tokens of each tile (0: an empty tile past the real count)
    tile_pos_ref,  # i32[N] position of the tile's first token
    q_ref,         # [Hkv, N, 64, D] query rows of each tile (tokens x G heads)
    k_ref, v_ref,  # [Hkv, NB, bs, D]
    o_ref,         # [Hkv, N, splits, 64, D] per-tile, per-split normalized partials
    lse_ref,       # f32[Hkv, N, splits, 64]
    scratch, *, group, num_splits, tile_kv, num_stages, sm_scale, soft_cap,
    sliding_window, accumulate_in_place):
  q_smem, k_smem, v_smem, p_smem, lse_smem, q_bar, k_bars, v_bars = scratch
  h, j, split = lax.axis_index("h"), lax.axis_index("t"), lax.axis_index("s")
  _, num_blocks, block_size, head_dim = k_ref.shape
  pages_per_seq = tables_ref.shape[1]
  dtype = q_smem.dtype
  pages_per_tile = max(1, tile_kv // block_size)
  tokens_per_copy = min(block_size, tile_kv)
  seq = tile_seq_ref[j]
  n_tok, pos0 = tile_n_ref[j], tile_pos_ref[j]
  kv_len = jnp.clip(kv_lens_ref[seq], 0, pages_per_seq * block_size)

  # Keys [start_tok, end_tok) seen by any row of this tile; this split's kv tiles.
  end_tok = jnp.where(n_tok > 0, jnp.minimum(pos0 + n_tok, kv_len), 0)
  start_tok = (jnp.int32(0) if sliding_window is None
               else jnp.maximum(pos0 - sliding_window + 1, 0))
  start_tok = jnp.minimum(start_tok, end_tok)
  first_tile = lax.div(start_tok, jnp.int32(tile_kv))
  end_tile = lax.div(end_tok + tile_kv - 1, jnp.int32(tile_kv))
  per_split = lax.div(end_tile - first_tile + num_splits - 1, jnp.int32(num_splits))
  lo = first_tile + split * per_split
  num_steps = jnp.clip(jnp.minimum(lo + per_split, end_tile) - lo, 0, None)

  def issue(step):  # TMA of kv tile lo + step into ring slot step % num_stages.
    slot = lax.rem(step, jnp.int32(num_stages))
    tok0 = (lo + step) * tile_kv
    for i in range(pages_per_tile):
      tok = tok0 + i * tokens_per_copy
      logical = jnp.minimum(lax.div(tok, jnp.int32(block_size)), pages_per_seq - 1)
      page = jnp.clip(tables_ref[seq, logical], 0, num_blocks - 1)
      rows = pl.ds(lax.rem(tok, jnp.int32(block_size)) if block_size > tile_kv else 0,
                   tokens_per_copy)
      dst = pl.ds(i * tokens_per_copy, tokens_per_copy)
      plgpu.copy_gmem_to_smem(k_ref.at[h, page, rows], k_smem.at[slot, dst], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[h, page, rows], v_smem.at[slot, dst], v_bars.at[slot])

  plgpu.copy_gmem_to_smem(q_ref.at[h, j], q_smem, q_bar)
  for s in range(num_stages):
    pl.when(s < num_steps)(functools.partial(issue, jnp.int32(s)))
  plgpu.barrier_wait(q_bar)

  # Position of each logit row's query (-1: a row of no token of this tile).
  row_tok = lax.div(plgpu.broadcasted_iota(jnp.int32, (_Q_ROWS, tile_kv), 0,
                                           layout=plgpu.Layout.WGMMA), jnp.int32(group))
  row_pos = jnp.where(row_tok < n_tok, pos0 + row_tok, -1)
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def body(step, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(step, jnp.int32(num_stages))
    tok0 = (lo + step) * tile_kv
    plgpu.barrier_wait(k_bars.at[slot])

    def qk_scope(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
      return acc_ref[...]
    logits = pl.run_scoped(qk_scope, plgpu.ACC((_Q_ROWS, tile_kv), jnp.float32))
    logits = logits * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    key = tok0 + plgpu.broadcasted_iota(jnp.int32, (_Q_ROWS, tile_kv), 1,
                                        layout=plgpu.Layout.WGMMA)
    live = (key <= row_pos) & (key < kv_len)
    if sliding_window is not None:
      live = live & (key > row_pos - sliding_window)
    logits = jnp.where(live, logits * _LOG2E, _MASK_VALUE)   # log2 domain
    m_new = jnp.maximum(m_i, logits.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    # A row may see no key of this kv tile (causal / window): exp2(MASK - MASK) = 1 there.
    p = jnp.where(live, jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0])),
                  0.0)
    l_i = l_i * alpha + p.sum(axis=1)
    p_smem[...] = p.astype(dtype)

    plgpu.barrier_wait(v_bars.at[slot])
    @pl.when((tok0 < start_tok) | (tok0 + tile_kv > end_tok))
    def _zero_dead_rows():  # stale values (even NaN) must not meet p = 0 in PV
      rows = tok0 + plgpu.broadcasted_iota(jnp.int32, (tile_kv, 64), 0,
                                           layout=plgpu.Layout.WGMMA)
      keep = (rows >= start_tok) & (rows < end_tok)
      for c in range(head_dim // 64):
        v_cols = v_smem.at[slot, :, pl.ds(c * 64, 64)]
        v_tile = v_cols[...]
        v_cols[...] = jnp.where(keep, v_tile, jnp.zeros_like(v_tile))
    plgpu.commit_smem()

    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    pv_v = v_smem.at[slot]
    if accumulate_in_place:
      acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p_smem, pv_v))(
          plgpu.ACC.init(acc))
    else:  # GPU interpret mode cannot seed an accumulator.
      def pv_scope(pv_ref):
        plgpu.wgmma(pv_ref, p_smem, pv_v)
        return pv_ref[...]
      acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((_Q_ROWS, head_dim), jnp.float32))
    nxt = step + num_stages
    pl.when(nxt < num_steps)(functools.partial(issue, nxt))
    return acc, m_new, l_i

  acc = plgpu.layout_cast(jnp.zeros((_Q_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((_Q_ROWS,), _MASK_VALUE, jnp.float32), row_layout)
  l_i = plgpu.layout_cast(jnp.zeros((_Q_ROWS,), jnp.float32), row_layout)
  acc, m_i, l_i = lax.fori_loop(0, num_steps, body, (acc, m_i, l_i))

  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
  lse_smem[...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, o_ref.at[h, j, split])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[h, j, split])
  plgpu.wait_smem_to_gmem(0)


def plan_tiles(cu_q_lens, kv_lens, num_seqs, num_tokens, q_per_tile):
  """Query tiles of a ragged batch (jnp, traced).

  Returns (num_tiles_max (static), tile arrays (seq, first row, tokens, first position),
  and per token: its tile and its first logit row in that tile).
  """
  num_seqs_max = kv_lens.shape[0]
  live = jnp.arange(num_seqs_max) < num_seqs
  q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
  tiles = (q_lens + q_per_tile - 1) // q_per_tile
  tile_end = jnp.cumsum(tiles)
  tile_base = tile_end - tiles
  n_max = max(1, min(num_tokens, -(-num_tokens // q_per_tile) + num_seqs_max))
  j = jnp.arange(n_max, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), num_seqs_max - 1)
  q_off = (j - tile_base[seq]) * q_per_tile
  valid = j < tile_end[-1]
  n_tok = jnp.where(valid, jnp.clip(q_lens[seq] - q_off, 0, q_per_tile), 0)
  first_row = jnp.where(valid, cu_q_lens[seq] + q_off, 0)
  pos0 = kv_lens[seq] - q_lens[seq] + q_off
  # Per token t: sequence, tile and row.
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  tok_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), num_seqs_max - 1)
  local = t - cu_q_lens[tok_seq]
  tok_live = (t < cu_q_lens[jnp.clip(num_seqs, 0, num_seqs_max)]) & (local >= 0)
  tok_tile = jnp.where(tok_live, tile_base[tok_seq] + local // q_per_tile, 0)
  tok_row = (local % q_per_tile)
  tile_arrays = tuple(x.astype(jnp.int32) for x in (seq, first_row, n_tok, pos0))
  return n_max, tile_arrays, tok_tile.astype(jnp.int32), tok_row.astype(jnp.int32), tok_live


def _ragged_impl(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *,
                 sm_scale, soft_cap, sliding_window, q_per_tile, num_splits, tile_kv,
                 num_stages, interpret):
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  dtype = q.dtype
  cu_q_lens = cu_q_lens.astype(jnp.int32)
  kv_lens = kv_lens.astype(jnp.int32)
  n_max, tile_arrays, tok_tile, tok_row, tok_live = plan_tiles(
      cu_q_lens, kv_lens, jnp.asarray(num_seqs, jnp.int32), num_tokens, q_per_tile)
  q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
  q_rows = q_rows.reshape(num_kv_heads, num_tokens * group, head_dim)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, _Q_ROWS), (0, 0)))       # [Hkv, T*G + 64, D]
  # Each tile's 64 rows, gathered here (a TMA at a dynamic, unaligned row offset of the
  # swizzled tile would not lower): [Hkv, N, 64, D].
  seq, first_row, n_tok, pos0 = tile_arrays
  q_tiles = q_rows[:, first_row[:, None] * group + jnp.arange(_Q_ROWS)[None, :]]

  transforms = (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
                plgpu.SwizzleTransform(128))
  pages_per_tile = max(1, tile_kv // block_size)
  scratch = (
      plgpu.SMEM((_Q_ROWS, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((num_stages, tile_kv, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((num_stages, tile_kv, head_dim), dtype, transforms=transforms),
      plgpu.SMEM((_Q_ROWS, tile_kv), dtype, transforms=transforms),
      plgpu.SMEM((_Q_ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=num_stages),
  )
  kernel = functools.partial(
      _ragged_kernel, group=group, num_splits=num_splits, tile_kv=tile_kv,
      num_stages=num_stages, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, accumulate_in_place=not interpret)
  params = dict(compiler_params=plgpu.CompilerParams())
  if interpret:
    params["interpret"] = plgpu.InterpretGPUParams(detect_races=True)
  o, lse = plgpu.kernel(
      lambda *refs: kernel(*refs[:10], refs[10:]),
      kernel_name=f"ragged_paged_mgpu_bs{block_size}_q{q_per_tile}_splits{num_splits}",
      out_type=(jax.ShapeDtypeStruct((num_kv_heads, n_max, num_splits, _Q_ROWS, head_dim),
                                     dtype),
                jax.ShapeDtypeStruct((num_kv_heads, n_max, num_splits, _Q_ROWS),
                                     jnp.float32)),
      scratch_types=scratch,
      grid=(num_kv_heads, n_max, num_splits),
      grid_names=("h", "t", "s"),
      **params,
  )(kv_lens, block_tables.astype(jnp.int32), seq, n_tok, pos0, q_tiles, k_pages, v_pages)

  # Gather each token's G rows back: [Hkv, T, G, D] -> [T, Hq, D].
  rows = tok_row[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]  # [T, G]
  o_tok = o[:, tok_tile[:, None], :, rows]            # [T, G, Hkv, splits, D]
  lse_tok = lse[:, tok_tile[:, None], :, rows]        # [T, G, Hkv, splits]
  if num_splits == 1:
    out = o_tok[:, :, :, 0].astype(jnp.float32)
  else:
    # Split axis last-but-one: [T, G, Hkv, splits, 1, D] / [T, G, Hkv, splits, 1].
    out = decode._combine_splits(o_tok[..., None, :].astype(jnp.float32),  # pylint: disable=protected-access
                                 lse_tok[..., None])[..., 0, :]
  out = jnp.where(tok_live[:, None, None, None], out, 0.0)   # [T, G, Hkv, D]
  return out.transpose(0, 2, 1, 3).reshape(num_tokens, num_q_heads, head_dim).astype(dtype)


_jitted_impl = jax.jit(
    _ragged_impl,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_per_tile", "num_splits",
                     "tile_kv", "num_stages", "interpret"))


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           interpret=False, q_per_tile=None, num_splits=1, tile_kv=64,
                           num_stages=None):
  """Mixed prefill + decode paged attention on the Mosaic GPU backend (sm_90a).

  Args: as the Triton `ragged_paged_attention` (q [T, Hq, D], k/v_pages [Hkv, NB, bs, D],
    block_tables i32[S, P], kv_lens i32[S], cu_q_lens i32[S + 1], num_seqs i32 scalar),
    with the decode kernel's support limits (bf16 / f16 pages = q dtype, bs >= 16, D 64 /
    128 / 256, G <= 64; no scales).
    q_per_tile: query tokens per tile (default 64 // G; q_per_tile * G <= 64).
    num_splits: split-K partitions per tile (default 1). tile_kv: 64 or 128.
    num_stages: K/V shared-memory ring depth (default: deepest of 3, 2, 1 that fits).
    interpret: GPU interpret mode on a CPU (jax >= 0.11.2), race detection on.
  Returns:
    [T, Hq, D] in q's dtype; rows past cu_q_lens[num_seqs] are zeros.
  """
  if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
    raise ValueError(f"q must be [T, Hq, D] and k/v_pages [Hkv, NB, bs, D], got "
                     f"{q.shape}, {k_pages.shape}, {v_pages.shape}")
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  why = decode.supported_reason(num_q_heads, num_kv_heads, head_dim, block_size, q.dtype,
                                k_pages.dtype)
  if why is not None:
    raise ValueError(f"mosaic_gpu ragged_paged_attention does not support {why}; "
                     "use Triton")
  group = num_q_heads // num_kv_heads
  if q_per_tile is None:
    q_per_tile = _Q_ROWS // group
  if int(q_per_tile) != q_per_tile or not 1 <= q_per_tile * group <= _Q_ROWS:
    raise ValueError(f"q_per_tile must be an int with q_per_tile * {group} <= {_Q_ROWS}, "
                     f"got {q_per_tile}")
  if tile_kv not in (64, 128):
    raise ValueError(f"tile_kv must be 64 or 128, got {tile_kv}")
  num_stages = decode.check_num_stages(num_stages, head_dim, tile_kv)
  if int(num_splits) != num_splits or not 1 <= num_splits <= 256:
    raise ValueError(f"num_splits must be an int in [1, 256], got {num_splits}")
  if sliding_window is not None and (int(sliding_window) != sliding_window
                                     or sliding_window < 1):
    raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window}")
  if interpret and decode.interpret_unavailable_reason():
    raise ValueError(decode.interpret_unavailable_reason())
  if cu_q_lens.shape != (kv_lens.shape[0] + 1,) or block_tables.shape[0] != kv_lens.shape[0]:
    raise ValueError(f"cu_q_lens must be i32[S + 1] and block_tables i32[S, P] for kv_lens "
                     f"i32[S], got {cu_q_lens.shape}, {block_tables.shape}, {kv_lens.shape}")
  return _jitted_impl(
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
      sm_scale=float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale),
      soft_cap=None if soft_cap is None else float(soft_cap),
      sliding_window=None if sliding_window is None else int(sliding_window),
      q_per_tile=int(q_per_tile), num_splits=int(num_splits), tile_kv=int(tile_kv),
      num_stages=int(num_stages), interpret=bool(interpret))
