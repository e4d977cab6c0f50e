"""Argument validation, tuning defaults and query tiling for the ragged paged attention kernel.

`validate` runs on shapes and dtypes only (it works on tracers), before the kernel is
traced, and raises ValueError / TypeError naming the argument and the allowed range.
`query_tiles` cuts a ragged batch into fixed-size query tiles with plain jnp (inside
jit, no host sync); the tile count has a static upper bound so the grid is static.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.triton import tuning

Q_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
PAGE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.float8_e4m3fn)
NUM_WARPS = (1, 2, 4, 8, 16)
# Programs wanted in flight before split-K is used: about two waves of an H100/H200
# (132 SMs). Only a default; `kv_splits` overrides it.
TARGET_PROGRAMS = 264
MAX_DEFAULT_SPLITS = 16
MIN_DOT_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16.


def next_pow2(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _is_pow2(x: int) -> bool:
  return x >= 1 and (x & (x - 1)) == 0


def _check_int(name, value, lo, hi=None, pow2=False):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
  rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
  kind = "a power of two in " if pow2 else "in "
  if value < lo or (hi is not None and value > hi) or (pow2 and not _is_pow2(value)):
    raise ValueError(f"{name} must be {kind}{rng}, got {value}")


def _check_dtype(name, x, allowed):
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in allowed]:
    names = ", ".join(jnp.dtype(d).name for d in allowed)
    raise TypeError(f"{name} dtype must be one of ({names}), got {jnp.dtype(x.dtype).name}")


def _check_int_array(name, x, shape):
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array (int32), got {jnp.dtype(x.dtype).name}")


def _check_positive_float(name, value):
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a float or None, got {value!r}") from None
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite float > 0 or None, got {value}")
  return value


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
  """Resolved static parameters of one kernel call."""
  sm_scale: float
  soft_cap: Optional[float]
  sliding_window: Optional[int]
  q_per_tile: int
  short_q_per_tile: int
  kv_per_tile: int
  kv_splits: int
  num_warps: int = 4
  num_stages: int = 2


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


def default_q_per_tile(group: int, rows: int = 64) -> Tuple[int, int]:
  """(q_per_tile, short_q_per_tile): ~`rows` logit rows per prefill tile, 16 per short."""
  group_p = next_pow2(group)
  short = max(1, MIN_DOT_ROWS // group_p)
  return max(short, rows // group_p), short


def default_kv_splits(num_tiles: int, num_kv_heads: int, max_kv_tokens: int,
                      kv_per_tile: int) -> int:
  """Split-K factor: fill ~TARGET_PROGRAMS programs, >= 4 KV steps per split at full length."""
  programs = num_tiles * num_kv_heads
  if programs >= TARGET_PROGRAMS:
    return 1
  wanted = -(-TARGET_PROGRAMS // programs)
  by_length = max(1, -(-max_kv_tokens // kv_per_tile) // 4)
  return int(max(1, min(wanted, by_length, MAX_DEFAULT_SPLITS)))


def validate(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *, sm_scale,
             soft_cap, sliding_window, k_scales, v_scales, q_per_tile, short_q_per_tile,
             kv_per_tile, kv_splits, num_warps, num_stages, interpret=False) -> RaggedConfig:
  """Checks shapes, dtypes and knobs; resolves defaults. Raises ValueError / TypeError."""
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages),
                  ("block_tables", block_tables), ("kv_lens", kv_lens),
                  ("cu_q_lens", cu_q_lens)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if q.ndim != 3:
    raise ValueError(f"q must have shape [T, Hq, D], got {tuple(q.shape)}")
  _check_dtype("q", q, Q_DTYPES)
  num_tokens, num_q_heads, head_dim = q.shape
  if num_tokens < 1:
    raise ValueError(f"q must have at least one row (T >= 1), got T={num_tokens}")
  if k_pages.ndim != 4:
    raise ValueError(f"k_pages must have shape [Hkv, NB, bs, D], got {tuple(k_pages.shape)}")
  if tuple(v_pages.shape) != tuple(k_pages.shape):
    raise ValueError(f"v_pages shape {tuple(v_pages.shape)} must equal k_pages shape "
                     f"{tuple(k_pages.shape)}")
  _check_dtype("k_pages", k_pages, PAGE_DTYPES)
  _check_dtype("v_pages", v_pages, PAGE_DTYPES)
  num_kv_heads, num_blocks, block_size, head_dim_k = k_pages.shape
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads (k_pages.shape[0]={num_kv_heads}) must divide "
                     f"num_q_heads (q.shape[1]={num_q_heads})")
  if head_dim_k != head_dim:
    raise ValueError(f"head_dim of k_pages ({head_dim_k}) must equal head_dim of q "
                     f"({head_dim})")
  _check_int("head_dim", head_dim, 16, 256)
  _check_int("num_blocks", num_blocks, 1)
  _check_int("block_size", block_size, 1, 1024)
  if block_tables.ndim != 2 or block_tables.shape[0] < 1 or block_tables.shape[1] < 1:
    raise ValueError(f"block_tables must have shape [S, P] with S, P >= 1, got "
                     f"{tuple(block_tables.shape)}")
  num_seqs_max, pages_per_seq = block_tables.shape
  _check_int_array("block_tables", block_tables, block_tables.shape)
  _check_int_array("kv_lens", kv_lens, (num_seqs_max,))
  _check_int_array("cu_q_lens", cu_q_lens, (num_seqs_max + 1,))
  if isinstance(num_seqs, (int, np.integer)) and not isinstance(num_seqs, bool):
    _check_int("num_seqs", int(num_seqs), 0, num_seqs_max)
  elif not (hasattr(num_seqs, "shape") and tuple(num_seqs.shape) in ((), (1,))
            and jnp.issubdtype(num_seqs.dtype, jnp.integer)):
    raise TypeError(f"num_seqs must be an int or an integer scalar array, got {num_seqs!r}")
  for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
    if scales is None:
      continue
    if tuple(scales.shape) != (num_kv_heads, num_blocks, block_size):
      raise ValueError(f"{name} must have shape {(num_kv_heads, num_blocks, block_size)}, "
                       f"got {tuple(scales.shape)}")
    if not jnp.issubdtype(scales.dtype, jnp.floating):
      raise TypeError(f"{name} must be a float array, got {jnp.dtype(scales.dtype).name}")

  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else _check_positive_float(
      "sm_scale", sm_scale)
  cap = None if soft_cap is None else _check_positive_float("soft_cap", soft_cap)
  if sliding_window is not None:
    _check_int("sliding_window", sliding_window, 1)
    sliding_window = int(sliding_window)

  group = num_q_heads // num_kv_heads
  group_p = next_pow2(group)
  min_tile = max(1, MIN_DOT_ROWS // group_p)
  head_dim_p = tuning.padded_head_dim(head_dim)
  tune = tuning.ragged_defaults(q.dtype, head_dim_p, padded=head_dim_p != head_dim,
                                page_dtype=k_pages.dtype)
  default_long, default_short = default_q_per_tile(group, tune.rows)
  q_per_tile = default_long if q_per_tile is None else q_per_tile
  _check_int("q_per_tile", q_per_tile, min_tile, 1024, pow2=True)
  if short_q_per_tile is None:
    short_q_per_tile = min(default_short, q_per_tile)
  _check_int("short_q_per_tile", short_q_per_tile, min_tile, q_per_tile, pow2=True)
  num_warps = tune.num_warps if num_warps is None else num_warps
  num_stages = tune.num_stages if num_stages is None else num_stages
  _check_int("num_stages", num_stages, 1, 4)
  buffers = tuning.kv_buffers("ragged", num_stages)
  rows = q_per_tile * group_p
  top = tuning.max_tile(head_dim_p, k_pages.dtype, q.dtype, buffers, rows)
  if kv_per_tile is None:
    kv_per_tile = min(tune.kv_per_tile, top)
  _check_int("kv_per_tile", kv_per_tile, 16, 1024, pow2=True)
  tuning.check_shared_memory(knob="q_per_tile/kv_per_tile",
                             value=f"{q_per_tile}/{kv_per_tile}", tile=kv_per_tile,
                             head_dim_p=head_dim_p, page_dtype=k_pages.dtype,
                             compute_dtype=q.dtype, buffers=buffers, q_rows=rows)
  if kv_splits is None:
    if interpret:
      kv_splits = 1  # the interpreter runs programs one by one: splitting only costs time
    else:
      first = tile_classes(num_tokens, q_per_tile, short_q_per_tile, 1)[0]
      kv_splits = default_kv_splits(
          max_query_tiles(num_tokens, num_seqs_max, first.q_per_tile, first.min_q_len,
                          first.max_q_len),
          num_kv_heads, pages_per_seq * block_size, kv_per_tile)
  _check_int("kv_splits", kv_splits, 1, 256)
  _check_int("num_warps", num_warps, 1, 16)
  if num_warps not in NUM_WARPS:
    raise ValueError(f"num_warps must be one of {NUM_WARPS}, got {num_warps}")
  return RaggedConfig(sm_scale=scale, soft_cap=cap, sliding_window=sliding_window,
                      q_per_tile=int(q_per_tile), short_q_per_tile=int(short_q_per_tile),
                      kv_per_tile=int(kv_per_tile),
                      kv_splits=int(kv_splits), num_warps=int(num_warps),
                      num_stages=int(num_stages))


class QueryTiles(NamedTuple):
  """Per-tile metadata, each i32[num_tiles]; idle tiles have num_rows == 0."""
  seq: jax.Array        # sequence id, clamped into [0, S)
  row_start: jax.Array  # first q row
  num_rows: jax.Array   # valid rows in the tile (<= q_per_tile)
  pos_start: jax.Array  # position of the first row within its sequence


def query_tiles(cu_q_lens, kv_lens, num_seqs, *, num_tokens: int, q_per_tile: int,
                min_q_len: int = 1, max_q_len: Optional[int] = None) -> QueryTiles:
  """Cuts the query rows of each live sequence with min_q_len <= q_len <= max_q_len
  into tiles of q_per_tile rows (jnp, jittable).

  Args:
    cu_q_lens: i32[S + 1]; kv_lens: i32[S]; num_seqs: i32[] live sequences.
    num_tokens: T, rows of q (static). q_per_tile: rows per tile (static).
    min_q_len, max_q_len: the class of sequences to tile (static; None: no upper bound).
  Returns:
    QueryTiles with max_query_tiles(T, S, q_per_tile, min_q_len, max_q_len) entries.
    Rows past T (malformed cu_q_lens) are dropped; tiles beyond the real count are idle.
  """
  num_seqs_max = kv_lens.shape[0]
  num_tiles = max_query_tiles(num_tokens, num_seqs_max, q_per_tile, min_q_len, max_q_len)
  cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
  live = jnp.arange(num_seqs_max, dtype=jnp.int32) < jnp.reshape(num_seqs, ())
  q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
  in_class = live & (q_lens >= min_q_len)
  if max_q_len is not None:
    in_class &= q_lens <= max_q_len
  q_lens = jnp.where(in_class, q_lens, 0)
  tiles_per_seq = (q_lens + q_per_tile - 1) // q_per_tile
  tile_ends = jnp.cumsum(tiles_per_seq).astype(jnp.int32)           # [S]
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  # Sequence of each tile: how many sequences end at or before it (a [tiles, S] compare
  # and sum, one fusion; jnp.searchsorted would be a while loop of tiny kernels).
  seq = jnp.sum(tile_ends[None, :] <= tile[:, None], axis=1, dtype=jnp.int32)
  active = seq < num_seqs_max
  seq = jnp.minimum(seq, num_seqs_max - 1)
  first_tile_of_seq = tile_ends[seq] - tiles_per_seq[seq]
  local = tile - first_tile_of_seq                                    # tile index in seq
  row_start = cu[seq] + local * q_per_tile
  num_rows = jnp.clip(q_lens[seq] - local * q_per_tile, 0, q_per_tile)
  num_rows = jnp.where(active, num_rows, 0)
  row_start = jnp.where(active, row_start, 0)
  pos_start = kv_lens[seq].astype(jnp.int32) - q_lens[seq] + local * q_per_tile
  return QueryTiles(seq=seq, row_start=row_start.astype(jnp.int32),
                    num_rows=num_rows.astype(jnp.int32),
                    pos_start=pos_start.astype(jnp.int32))
