"""The prefix cache's state: `PrefixCacheState`, `init`, and the chex checks every op runs
at its boundary (`check_states`). The ops live in `core` (lookup, attach, register) and
`evict` (LRU release and eviction); see the package docstring.
"""

from __future__ import annotations

from typing import Optional

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig

_I32, _U32 = jnp.int32, jnp.uint32
HASH_MODES = ("chained", "constant")
ROOT_HASH = (0x2545F491, 0x6A09E667)          # parent hash of a depth-0 block


@flax.struct.dataclass
class PrefixCacheState:
  """Prefix-cache metadata beside a `BlockState` (NB blocks, S slots, H table slots).

  Attributes:
    block_hash: u32[NB, 2], chained hash of each cached block.
    block_tokens: i32[NB, block_size], token ids held (exact verification).
    block_parent: i32[NB], physical parent block in the chain (-1 at depth 0).
    block_parent_gen: i32[NB], parent's generation when this block registered
      (depth 0: the salt tag of its request, 0 unsalted; `salt.salt_key`).
    block_gen: i32[NB], bumped on every (re)registration of the block.
    block_depth: i32[NB], logical block index within its sequence.
    cached: bool[NB], block is registered (holds the cache's reference).
    last_used: i32[NB], `clock` value of the last hit / register / release.
    table_pos: i32[NB], the block's slot in `table` (-1 when not cached).
    table: i32[H], block id per hash-table slot, -1 empty.
    chain_block, chain_gen: i32[S], canonical cached block (and its generation)
      of the slot's last registered logical block; -1 / the salt tag before the first.
    chain_hash: u32[S, 2], its hash (the salt's root hash before the first).
    chain_len: i32[S], logical blocks of the slot registered or hit so far.
    chain_ok: bool[S], the slot may register further blocks.
    clock: i32[], logical time, advanced by every op that uses blocks.
    hit_blocks, query_blocks: i32[], blocks hit / looked up by `attach`.
    evictions: i32[], cached blocks evicted so far.
    lru_ring, lru_stamp: i32[R] (R a power of two >= 2 * num_blocks), released
      cached blocks in eviction order with their `last_used` at release; an
      entry is live while the block is cached, unheld and unused since.
    lru_head, lru_tail: i32[], ring counters (index = counter & (R - 1)).
    block_size, max_probe, hash_mode: static.
  """
  block_hash: jax.Array
  block_tokens: jax.Array
  block_parent: jax.Array
  block_parent_gen: jax.Array
  block_gen: jax.Array
  block_depth: jax.Array
  cached: jax.Array
  last_used: jax.Array
  table_pos: jax.Array
  table: jax.Array
  chain_block: jax.Array
  chain_gen: jax.Array
  chain_hash: jax.Array
  chain_len: jax.Array
  chain_ok: jax.Array
  clock: jax.Array
  hit_blocks: jax.Array
  query_blocks: jax.Array
  evictions: jax.Array
  lru_ring: jax.Array
  lru_stamp: jax.Array
  lru_head: jax.Array
  lru_tail: jax.Array
  block_size: int = flax.struct.field(pytree_node=False)
  max_probe: int = flax.struct.field(pytree_node=False)
  hash_mode: str = flax.struct.field(pytree_node=False)

  @property
  def num_blocks(self) -> int:
    return self.cached.shape[0]

  @property
  def table_size(self) -> int:
    return self.table.shape[0]


def init(cache_config: CacheConfig, *, max_probe: int = 16, table_factor: int = 2,
         hash_mode: str = "chained") -> PrefixCacheState:
  """An empty cache for `cache_config`'s block pool.

  Args:
    max_probe: hash-table slots searched per block (1..1024).
    table_factor: table slots per block, rounded up to a power of two (>= 1).
    hash_mode: "chained" (the 64-bit chained hash) or "constant" (every block
      hashes alike: for tests showing collisions never share wrong K/V).
  """
  if not isinstance(cache_config, CacheConfig):
    raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
  if not isinstance(max_probe, int) or not 1 <= max_probe <= 1024:
    raise ValueError(f"max_probe must be an int in [1, 1024], got {max_probe!r}")
  if not isinstance(table_factor, int) or not 1 <= table_factor <= 64:
    raise ValueError(f"table_factor must be an int in [1, 64], got {table_factor!r}")
  if hash_mode not in HASH_MODES:
    raise ValueError(f"hash_mode must be one of {HASH_MODES}, got {hash_mode!r}")
  nb, s, bs = cache_config.num_blocks, cache_config.max_seqs, cache_config.block_size
  h = 1 << max(int(np.ceil(np.log2(table_factor * nb))), int(np.ceil(np.log2(max_probe))), 1)
  ring = 1 << int(np.ceil(np.log2(max(2 * nb, 2 * s * cache_config.max_blocks_per_seq, 2))))
  z = lambda *shape: jnp.zeros(shape, _I32)
  return PrefixCacheState(
      block_hash=jnp.zeros((nb, 2), _U32), block_tokens=z(nb, bs),
      block_parent=jnp.full((nb,), -1, _I32), block_parent_gen=z(nb), block_gen=z(nb),
      block_depth=z(nb), cached=jnp.zeros((nb,), jnp.bool_), last_used=z(nb),
      table_pos=jnp.full((nb,), -1, _I32), table=jnp.full((h,), -1, _I32),
      chain_block=jnp.full((s,), -1, _I32), chain_gen=z(s),
      chain_hash=jnp.broadcast_to(jnp.asarray(ROOT_HASH, _U32), (s, 2)),
      chain_len=z(s), chain_ok=jnp.zeros((s,), jnp.bool_), clock=z(), hit_blocks=z(),
      query_blocks=z(), evictions=z(), lru_ring=jnp.full((ring,), -1, _I32),
      lru_stamp=z(ring), lru_head=z(), lru_tail=z(), block_size=bs, max_probe=max_probe,
      hash_mode=hash_mode)


# Fields by shape: [num_blocks], [max_seqs], scalar counters; dtypes other than int32.
_PER_BLOCK = ("block_parent", "block_parent_gen", "block_gen", "block_depth", "cached",
              "last_used", "table_pos")
_PER_SLOT = ("chain_block", "chain_gen", "chain_len", "chain_ok")
_COUNTERS = ("clock", "hit_blocks", "query_blocks", "evictions", "lru_head", "lru_tail")
_DTYPES = dict(block_hash=_U32, chain_hash=_U32, cached=jnp.bool_, chain_ok=jnp.bool_)


def check_states(cache: PrefixCacheState, blocks: Optional[bm.BlockState] = None) -> None:
  """chex: every array of `cache` has the shape and dtype `init` gives it and, with
  `blocks`, both were built for the same pool (blocks, slots, block size). Shapes and
  dtypes are static: inside jit this runs once at trace time and costs nothing."""
  nb, bs, s = cache.cached.shape[0], cache.block_size, cache.chain_len.shape[0]
  chex.assert_rank([cache.table, cache.lru_ring], 1, custom_message="PrefixCacheState")
  shapes = dict(block_hash=(nb, 2), block_tokens=(nb, bs), chain_hash=(s, 2),
                table=cache.table.shape, lru_ring=cache.lru_ring.shape,
                lru_stamp=cache.lru_ring.shape, **dict.fromkeys(_PER_BLOCK, (nb,)),
                **dict.fromkeys(_PER_SLOT, (s,)), **dict.fromkeys(_COUNTERS, ()))
  for name, shape in shapes.items():
    x = getattr(cache, name)
    chex.assert_shape(x, shape, custom_message=f"PrefixCacheState.{name}")
    chex.assert_type(x, _DTYPES.get(name, _I32), custom_message=f"PrefixCacheState.{name}")
  if blocks is not None:
    bm.check_state(blocks)
    chex.assert_shape(blocks.ref_count, (nb,),
                      custom_message="blocks.ref_count vs the cache's num_blocks")
    chex.assert_shape(blocks.seq_lens, (s,), custom_message="blocks.seq_lens vs the cache's slots")
    chex.assert_equal(blocks.block_size, bs, custom_message="blocks vs the cache's block_size")
