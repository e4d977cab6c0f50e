"""The prefix cache's state: `PrefixCacheState`, `init`, and the chex checks every op runs
at its boundary (`check_states`). The ops live in `core` (lookup, attach, register) and
`evict` (LRU release and eviction); see the package docstring.

Per-block fields live as columns of one i32[NB, 11 + block_size] array (`block_meta`) and
per-slot chain fields as columns of one i32[S, 6] array (`chain`), so registering a block
is one row scatter into each (not ten and five), and the engine's step passes two arrays
where it passed fifteen. Read-only properties name the columns (`cache.block_parent`,
`cache.cached`, ...); the ops write columns through the column indices below.
"""

from __future__ import annotations

from typing import Optional

import chex
import flax
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig

_I32, _U32 = jnp.int32, jnp.uint32
HASH_MODES = ("chained", "constant")
ROOT_HASH = (0x2545F491, 0x6A09E667)          # parent hash of a depth-0 block

# Columns of `block_meta` (i32[NB, 11 + block_size]); HASH and PARENT_HASH are two columns
# each, TOKENS the rest.
HASH, PARENT, PARENT_GEN, GEN, DEPTH, LAST_USED, CACHED, TABLE_POS, PARENT_HASH, TOKENS = (
    0, 2, 3, 4, 5, 6, 7, 8, 9, 11)
# Columns of an `events` row (i32[E, 5]): what `events.py` decodes into a KV cache event.
EV_KIND, EV_HASH, EV_PARENT_HASH = 0, 1, 3
EV_STORED, EV_REMOVED = 1, 2
EVENT_COLS = 5
# Columns of `chain` (i32[S, 6]); C_HASH is two columns.
C_BLOCK, C_GEN, C_HASH, C_LEN, C_OK = 0, 1, 2, 4, 5
CHAIN_COLS = 6


def as_i32(x):
  """i32 with the same bits as u32 `x` (hash lanes stored in an int32 array)."""
  return lax.bitcast_convert_type(x, _I32)


def as_u32(x):
  """u32 with the same bits as i32 `x`."""
  return lax.bitcast_convert_type(x, _U32)


@flax.struct.dataclass
class PrefixCacheState:
  """Prefix-cache metadata beside a `BlockState` (NB blocks, S slots, H table slots).

  Attributes:
    block_meta: i32[NB, 11 + block_size], one row per block; columns (read them through
      the properties of the same names):
        block_hash (HASH, 2 columns, u32 bits): chained hash of each cached block;
        block_parent (PARENT): physical parent block in the chain (-1 at depth 0);
        block_parent_gen (PARENT_GEN): parent's generation when this block registered
          (depth 0: the salt tag of its request, 0 unsalted; `salt.salt_key`);
        block_gen (GEN): bumped on every (re)registration of the block;
        block_depth (DEPTH): logical block index within its sequence;
        last_used (LAST_USED): `clock` value of the last hit / register / release;
        cached (CACHED, 0 / 1): block is registered (holds the cache's reference);
        table_pos (TABLE_POS): the block's slot in `table` (-1 when not cached);
        block_parent_hash (PARENT_HASH, 2 columns, u32 bits): the chained hash its own
          hash was computed from (the parent's, or the salt's root at depth 0): what a
          KV event's `parent_block_hash` and the host tier report;
        block_tokens (TOKENS.., block_size columns): token ids held (exact verification).
    table: i32[H], block id per hash-table slot, -1 empty.
    chain: i32[S, 6], per slot; columns (properties of the same names):
        chain_block, chain_gen (C_BLOCK, C_GEN): canonical cached block (and its
          generation) of the slot's last registered logical block; -1 / the salt tag
          before the first;
        chain_hash (C_HASH, 2 columns, u32 bits): its hash (the salt's root hash before
          the first);
        chain_len (C_LEN): logical blocks of the slot registered or hit so far;
        chain_ok (C_OK, 0 / 1): the slot may register further blocks.
    clock: i32[], logical time, advanced by every op that uses blocks.
    hit_blocks, query_blocks: i32[], blocks hit / looked up by `attach`.
    evictions: i32[], cached blocks evicted so far.
    lru_ring, lru_stamp: i32[R] (R a power of two >= 2 * num_blocks), released
      cached blocks in eviction order with their `last_used` at release; an
      entry is live while the block is cached, unheld and unused since.
    lru_head, lru_tail: i32[], ring counters (index = counter & (R - 1)).
    events: i32[E, 5], the blocks stored in / removed from the cache since the engine
      last read the log (`events.py`: one row per block: kind, hash, parent hash), in
      the order they happened; the engine's step returns it and starts it over.
    num_events: i32[], rows appended since (may exceed E: the rows past E are dropped,
      and the reader then takes the cache's contents instead: `Engine.kv_events`).
    block_size, max_probe, hash_mode: static.
    eviction_policy: static, a name in `paged_jax.eviction_policy.EVICTION_POLICIES`
      (`CacheConfig.eviction_policy`); only "lru" uses the ring.
  """
  block_meta: jax.Array
  table: jax.Array
  chain: jax.Array
  clock: jax.Array
  hit_blocks: jax.Array
  query_blocks: jax.Array
  evictions: jax.Array
  lru_ring: jax.Array
  lru_stamp: jax.Array
  lru_head: jax.Array
  lru_tail: jax.Array
  events: jax.Array
  num_events: jax.Array
  block_size: int = flax.struct.field(pytree_node=False)
  max_probe: int = flax.struct.field(pytree_node=False)
  hash_mode: str = flax.struct.field(pytree_node=False)
  eviction_policy: str = flax.struct.field(pytree_node=False, default="lru")

  @property
  def num_blocks(self) -> int:
    return self.block_meta.shape[0]

  @property
  def table_size(self) -> int:
    return self.table.shape[0]

  # Views of `block_meta`'s columns: [NB] (block_hash u32[NB, 2], block_tokens [NB, bs]).
  block_hash = property(lambda self: as_u32(self.block_meta[:, HASH:HASH + 2]))
  block_parent = property(lambda self: self.block_meta[:, PARENT])
  block_parent_gen = property(lambda self: self.block_meta[:, PARENT_GEN])
  block_gen = property(lambda self: self.block_meta[:, GEN])
  block_depth = property(lambda self: self.block_meta[:, DEPTH])
  last_used = property(lambda self: self.block_meta[:, LAST_USED])
  cached = property(lambda self: self.block_meta[:, CACHED] != 0)
  table_pos = property(lambda self: self.block_meta[:, TABLE_POS])
  block_parent_hash = property(lambda self: as_u32(self.block_meta[:, PARENT_HASH:PARENT_HASH + 2]))
  block_tokens = property(lambda self: self.block_meta[:, TOKENS:])
  # Views of `chain`'s columns: [S] (chain_hash u32[S, 2]).
  chain_block = property(lambda self: self.chain[:, C_BLOCK])
  chain_gen = property(lambda self: self.chain[:, C_GEN])
  chain_hash = property(lambda self: as_u32(self.chain[:, C_HASH:C_HASH + 2]))
  chain_len = property(lambda self: self.chain[:, C_LEN])
  chain_ok = property(lambda self: self.chain[:, C_OK] != 0)


def put_row(x, i, row):
  """`x` with row `i` (i32[], in range) set to `row`: a dynamic-update-slice, which XLA
  does in place inside loops (`x.at[i].set(row, mode="drop")` with an out-of-range `i`
  for "no write" lowers to a bounds select that makes XLA:CPU copy `x`). Callers pass
  the old row where nothing is to be written."""
  return lax.dynamic_update_index_in_dim(x, jnp.asarray(row, x.dtype), i, 0)


def empty_chain(num_slots: int, root=ROOT_HASH, tag=0):
  """i32[num_slots, 6]: chains before any block (block -1, the salt's tag and root hash)."""
  row = jnp.concatenate([jnp.asarray([-1, tag], _I32), as_i32(jnp.asarray(root, _U32)),
                         jnp.zeros((2,), _I32)])
  return jnp.broadcast_to(row, (num_slots, CHAIN_COLS))


def default_event_capacity(cache_config: CacheConfig) -> int:
  """Rows of the event log: room for a busy step's registrations and evictions (a step
  that logs more is still exact: `Engine.kv_events` then reads the cache itself)."""
  return 64 + 4 * cache_config.max_seqs + 2 * cache_config.max_blocks_per_seq


def init(cache_config: CacheConfig, *, max_probe: int = 16, table_factor: int = 2,
         hash_mode: str = "chained", event_capacity: Optional[int] = None
         ) -> PrefixCacheState:
  """An empty cache for `cache_config`'s block pool.

  Args:
    max_probe: hash-table slots searched per block (1..1024).
    table_factor: table slots per block, rounded up to a power of two (>= 1).
    hash_mode: "chained" (the 64-bit chained hash) or "constant" (every block
      hashes alike: for tests showing collisions never share wrong K/V).
    event_capacity: rows of the event log (default `default_event_capacity`).
  """
  if not isinstance(cache_config, CacheConfig):
    raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
  if not isinstance(max_probe, int) or not 1 <= max_probe <= 1024:
    raise ValueError(f"max_probe must be an int in [1, 1024], got {max_probe!r}")
  if not isinstance(table_factor, int) or not 1 <= table_factor <= 64:
    raise ValueError(f"table_factor must be an int in [1, 64], got {table_factor!r}")
  if hash_mode not in HASH_MODES:
    raise ValueError(f"hash_mode must be one of {HASH_MODES}, got {hash_mode!r}")
  if event_capacity is None:
    event_capacity = default_event_capacity(cache_config)
  if not isinstance(event_capacity, int) or not 1 <= event_capacity <= 2**20:
    raise ValueError(f"event_capacity must be an int in [1, 2**20], got {event_capacity!r}")
  nb, s, bs = cache_config.num_blocks, cache_config.max_seqs, cache_config.block_size
  h = 1 << max(int(np.ceil(np.log2(table_factor * nb))), int(np.ceil(np.log2(max_probe))), 1)
  ring = 1 << int(np.ceil(np.log2(max(2 * nb, 2 * s * cache_config.max_blocks_per_seq, 2))))
  z = lambda *shape: jnp.zeros(shape, _I32)
  meta = np.zeros((nb, TOKENS + bs), np.int32)
  meta[:, [PARENT, TABLE_POS]] = -1
  return PrefixCacheState(
      block_meta=jnp.asarray(meta), table=jnp.full((h,), -1, _I32), chain=empty_chain(s),
      clock=z(), hit_blocks=z(), query_blocks=z(), evictions=z(),
      lru_ring=jnp.full((ring,), -1, _I32), lru_stamp=z(ring), lru_head=z(), lru_tail=z(),
      events=z(event_capacity, EVENT_COLS), num_events=z(),
      block_size=bs, max_probe=max_probe, hash_mode=hash_mode,
      eviction_policy=cache_config.eviction_policy)


_COUNTERS = ("clock", "hit_blocks", "query_blocks", "evictions", "lru_head", "lru_tail",
             "num_events")


def check_states(cache: PrefixCacheState, blocks: Optional[bm.BlockState] = None) -> None:
  """chex: every array of `cache` has the shape and dtype `init` gives it and, with
  `blocks`, both were built for the same pool (blocks, slots, block size). Shapes and
  dtypes are static: inside jit this runs once at trace time and costs nothing."""
  chex.assert_rank([cache.block_meta, cache.chain, cache.events], 2,
                   custom_message="PrefixCacheState")
  chex.assert_rank([cache.table, cache.lru_ring], 1, custom_message="PrefixCacheState")
  nb, bs, s = cache.block_meta.shape[0], cache.block_size, cache.chain.shape[0]
  shapes = dict(block_meta=(nb, TOKENS + bs), chain=(s, CHAIN_COLS), table=cache.table.shape,
                lru_ring=cache.lru_ring.shape, lru_stamp=cache.lru_ring.shape,
                events=(cache.events.shape[0], EVENT_COLS),
                **dict.fromkeys(_COUNTERS, ()))
  for name, shape in shapes.items():
    x = getattr(cache, name)
    chex.assert_shape(x, shape, custom_message=f"PrefixCacheState.{name}")
    chex.assert_type(x, _I32, custom_message=f"PrefixCacheState.{name}")
  if blocks is not None:
    bm.check_state(blocks)
    chex.assert_shape(blocks.ref_count, (nb,),
                      custom_message="blocks.ref_count vs the cache's num_blocks")
    chex.assert_shape(blocks.seq_lens, (s,), custom_message="blocks.seq_lens vs the cache's slots")
    chex.assert_equal(blocks.block_size, bs, custom_message="blocks vs the cache's block_size")


# ---- counters ------------------------------------------------------------------------

def num_cached_blocks(cache: PrefixCacheState):
  """i32[]: blocks registered in the cache."""
  return jnp.sum(cache.cached.astype(_I32))


def num_evictable(cache: PrefixCacheState, blocks: bm.BlockState):
  """i32[]: cached blocks no sequence holds (the cache's reference is their only one)."""
  return jnp.sum((cache.cached & (blocks.ref_count == 1)).astype(_I32))


def hit_rate(cache: PrefixCacheState):
  """f32[]: hit blocks / looked-up blocks over all `attach` calls (0 when none)."""
  return jnp.where(cache.query_blocks > 0,
                   cache.hit_blocks / jnp.maximum(cache.query_blocks, 1), 0.0)


# ---- the event log ---------------------------------------------------------------------

def log_events(cache: PrefixCacheState, kind: int, blocks, mask) -> PrefixCacheState:
  """`cache` with one `kind` (EV_STORED / EV_REMOVED) row appended per block of `blocks`
  (i32[n], in range where `mask` bool[n] holds), in order: the block's hash and parent
  hash as `block_meta` holds them now. One scatter; rows past the log's end are dropped
  (`num_events` still counts them)."""
  e = cache.events.shape[0]
  nb = cache.block_meta.shape[0]
  meta = cache.block_meta[jnp.clip(blocks, 0, nb - 1)]
  rows = jnp.concatenate([jnp.full(blocks.shape + (1,), kind, _I32), meta[:, HASH:HASH + 2],
                          meta[:, PARENT_HASH:PARENT_HASH + 2]], axis=1)
  at = jnp.where(mask, cache.num_events + jnp.cumsum(mask.astype(_I32)) - 1, e)
  return cache.replace(events=cache.events.at[jnp.where(at < e, at, e)].set(rows, mode="drop"),
                       num_events=cache.num_events + jnp.sum(mask.astype(_I32)))


