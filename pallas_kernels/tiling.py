"""Query tiles of a ragged batch: the one planner of every ragged kernel.

A ragged batch holds S sequences; sequence i owns q rows cu_q_lens[i] : cu_q_lens[i + 1]
(q_len_i of them) at positions kv_lens[i] - q_len_i .. kv_lens[i] - 1. A kernel works on
tiles of at most `q_per_tile` rows of ONE sequence. `query_tiles` cuts the live sequences
into tiles with plain jnp (inside jit, no host sync); the number of tiles has a static
bound so a kernel's grid is static, and tiles past the real count are idle
(num_rows == 0). `token_tiles` is the inverse map (row -> tile, row in tile), for kernels
that write their output per tile. Users: triton/ragged_paged_attention.py (two launches,
`tile_classes`), mosaic_gpu/ragged_paged_attention.py, cpu/xla_attention.py.

Sequence of a tile is a compare-and-sum over the [tiles, S] table of tile ends, one
fusion; jnp.searchsorted would be a while loop of tiny kernels on a GPU.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import jax
import jax.numpy as jnp


class QueryTiles(NamedTuple):
  """Per-tile metadata, each i32[num_tiles]; idle tiles have num_rows == 0."""
  seq: jax.Array        # sequence id, clamped into [0, S)
  row_start: jax.Array  # first q row
  num_rows: jax.Array   # valid rows in the tile (<= q_per_tile)
  pos_start: jax.Array  # position of the first row within its sequence


def max_query_tiles(num_tokens: int, num_seqs: int, q_per_tile: int, min_q_len: int = 1,
                    max_q_len: Optional[int] = None) -> int:
  """Static bound on sum_i cdiv(q_len_i, q_per_tile) over sequences with
  min_q_len <= q_len_i <= max_q_len, given sum_i q_len_i <= num_tokens.

  At most min(S, T // min_q_len) sequences qualify; each adds at most one partial tile,
  and no tile is empty.
  """
  num_qualifying = min(num_seqs, num_tokens // max(1, min_q_len))
  if max_q_len is not None and max_q_len <= q_per_tile:
    return max(1, num_qualifying)
  return max(1, min(num_tokens, num_tokens // q_per_tile + num_qualifying))


def _tiles_per_seq(cu_q_lens, num_seqs, num_seqs_max, num_tokens, q_per_tile, min_q_len,
                   max_q_len):
  """(cu clipped into [0, T], q_lens of the tiled sequences (0 for the others), tiles per
  sequence, cumulative tile ends), each [S] (cu [S + 1])."""
  cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
  live = jnp.arange(num_seqs_max, dtype=jnp.int32) < jnp.reshape(num_seqs, ())
  q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
  in_class = live & (q_lens >= min_q_len)
  if max_q_len is not None:
    in_class &= q_lens <= max_q_len
  q_lens = jnp.where(in_class, q_lens, 0)
  tiles_per_seq = (q_lens + q_per_tile - 1) // q_per_tile
  return cu, q_lens, tiles_per_seq, jnp.cumsum(tiles_per_seq).astype(jnp.int32)


def query_tiles(cu_q_lens, kv_lens, num_seqs, *, num_tokens: int, q_per_tile: int,
                min_q_len: int = 1, max_q_len: Optional[int] = None,
                num_tiles: Optional[int] = None) -> QueryTiles:
  """Cuts the query rows of each live sequence with min_q_len <= q_len <= max_q_len
  into tiles of q_per_tile rows (jnp, jittable).

  Args:
    cu_q_lens: i32[S + 1]; kv_lens: i32[S]; num_seqs: i32[] live sequences.
    num_tokens: T, rows of q (static). q_per_tile: rows per tile (static).
    min_q_len, max_q_len: the class of sequences to tile (static; None: no upper bound).
    num_tiles: tiles to return (static; default `max_query_tiles`, the tightest bound).
  Returns:
    QueryTiles of `num_tiles` entries. Rows past T (malformed cu_q_lens) are dropped;
    tiles beyond the real count are idle.
  """
  num_seqs_max = kv_lens.shape[0]
  if num_tiles is None:
    num_tiles = max_query_tiles(num_tokens, num_seqs_max, q_per_tile, min_q_len, max_q_len)
  cu, q_lens, tiles_per_seq, tile_ends = _tiles_per_seq(
      cu_q_lens, num_seqs, num_seqs_max, num_tokens, q_per_tile, min_q_len, max_q_len)
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  seq = jnp.sum(tile_ends[None, :] <= tile[:, None], axis=1, dtype=jnp.int32)
  active = seq < num_seqs_max
  seq = jnp.minimum(seq, num_seqs_max - 1)
  local = tile - (tile_ends[seq] - tiles_per_seq[seq])               # tile index in seq
  row_start = jnp.where(active, cu[seq] + local * q_per_tile, 0)
  num_rows = jnp.clip(q_lens[seq] - local * q_per_tile, 0, q_per_tile)
  num_rows = jnp.where(active, num_rows, 0)
  pos_start = kv_lens[seq].astype(jnp.int32) - q_lens[seq] + local * q_per_tile
  return QueryTiles(seq=seq, row_start=row_start.astype(jnp.int32),
                    num_rows=num_rows.astype(jnp.int32),
                    pos_start=pos_start.astype(jnp.int32))


def token_tiles(cu_q_lens, num_seqs, *, num_tokens: int, q_per_tile: int):
  """Where `query_tiles` (every live sequence, one class) put each q row.

  Returns (tile i32[T], row within the tile i32[T], live bool[T]); padding rows (past
  cu_q_lens[num_seqs]) are not live and point at tile 0.
  """
  num_seqs_max = cu_q_lens.shape[0] - 1
  cu, _, tiles_per_seq, tile_ends = _tiles_per_seq(
      cu_q_lens, num_seqs, num_seqs_max, num_tokens, q_per_tile, 1, None)
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  seq = jnp.sum(cu[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32)
  seq = jnp.minimum(seq, num_seqs_max - 1)
  local = t - cu[seq]
  live = (t < cu[jnp.clip(jnp.reshape(num_seqs, ()), 0, num_seqs_max)]) & (local >= 0)
  tile = jnp.where(live, tile_ends[seq] - tiles_per_seq[seq] + local // q_per_tile, 0)
  return tile.astype(jnp.int32), (local % q_per_tile).astype(jnp.int32), live


class TileClass(NamedTuple):
  """One kernel launch: the sequences with min_q_len <= q_len <= max_q_len."""
  q_per_tile: int
  min_q_len: int
  max_q_len: Optional[int]
  kv_splits: int


def tile_classes(num_tokens: int, q_per_tile: int, short_q_per_tile: int,
                 kv_splits: int) -> List[TileClass]:
  """Short sequences (decode) first, in small split-K tiles; then the long ones."""
  if short_q_per_tile >= q_per_tile:
    return [TileClass(q_per_tile, 1, None, kv_splits)]
  classes = [TileClass(short_q_per_tile, 1, short_q_per_tile, kv_splits)]
  if num_tokens > short_q_per_tile:  # else no sequence can be long: skip the launch
    classes.append(TileClass(q_per_tile, short_q_per_tile + 1, None, 1))
  return classes
