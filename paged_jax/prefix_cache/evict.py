"""Release and eviction of cached blocks (re-exported by `paged_jax.prefix_cache`).

The order is the cache's eviction policy (`cache.eviction_policy`, a key function in
`paged_jax.eviction_policy`, chosen statically by `CacheConfig`). Any policy but "lru"
ranks the evictable blocks by its key with one sort per evicting call
(`policy_victims`, O(NB log NB)); "lru" keeps the ring below.

LRU order: least recently used first; among blocks last used at the same
time, the deepest (a sequence's tail) first. A cached block's last use is the
moment its last holder released it (`release`, called on every free), so the
order is kept by an append-only ring: each `release` pushes the released
cached blocks, deepest first, stamped with the release time. `ensure_free`
pops from the ring's head, skipping stale entries (the block was used again
since, is held again, or is no longer cached; a later release re-pushes it),
so an eviction costs O(evicted + skipped) work, amortized O(1) per block, not
O(num_blocks). Every evictable block has a live entry (a full ring evicts its
oldest live entries rather than forgetting them), so no scan is needed;
`lru_victims`, an O(num_blocks) `lax.top_k` over the same order, is the
reference the tests compare with.
"""

from __future__ import annotations

import functools

import chex
from jax import lax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import eviction_policy
from paged_jax.prefix_cache import state as st
from paged_jax.prefix_cache.state import PrefixCacheState, check_states

_I32 = jnp.int32

_INT_MAX = np.iinfo(np.int32).max


def _slot_mask(cache: PrefixCacheState, blocks: bm.BlockState, slot_mask):
  """chex: both states from one pool, and `slot_mask` a bool[max_seqs]."""
  check_states(cache, blocks)
  slot_mask = jnp.asarray(slot_mask)
  chex.assert_type(slot_mask, bool, custom_message="slot_mask")
  chex.assert_shape(slot_mask, (blocks.max_seqs,), custom_message="slot_mask [max_seqs]")
  return slot_mask


def touch(cache: PrefixCacheState, blocks: bm.BlockState, slot_mask):
  """Marks every block of the masked slots (bool[max_seqs]) as used now (no ring push)."""
  slot_mask = _slot_mask(cache, blocks, slot_mask)
  nb = blocks.num_blocks
  held = jnp.where(slot_mask[:, None] & (blocks.block_tables >= 0), blocks.block_tables, nb)
  return cache.replace(block_meta=cache.block_meta.at[held.reshape(-1), st.LAST_USED].set(
      cache.clock, mode="drop"), clock=cache.clock + 1)


def _live(cache: PrefixCacheState, blocks: bm.BlockState, idx):
  """(block ids, bool: entry `idx` (ring counter values) still names an evictable
  block unused since it was pushed)."""
  r, nb = cache.lru_ring.shape[0], blocks.num_blocks
  blk = cache.lru_ring[idx & (r - 1)]
  bc = jnp.clip(blk, 0, nb - 1)
  m = cache.block_meta[bc]
  return blk, ((idx >= cache.lru_head) & (idx < cache.lru_tail) & (blk >= 0)
               & (m[..., st.CACHED] != 0)
               & (m[..., st.LAST_USED] == cache.lru_stamp[idx & (r - 1)])
               & (blocks.ref_count[bc] == 1))


def release(cache: PrefixCacheState, blocks: bm.BlockState, slot_mask,
            num_lanes: int = 0, num_cols: int = 0):
  """Touches the masked slots' blocks and pushes their cached ones on the LRU ring.

  Call right before `block_manager.free` of those slots. Ring order within one
  release: deeper blocks first (evicted first), each block once. If the ring
  would overflow (stale entries pile up while nothing is evicted), the oldest
  entries are dropped and the live ones among them evicted now: they are the
  least recently used, and no evictable block is ever lost to the ring.
  `num_lanes` (static, default max_seqs): at most that many slots are masked; the
  work runs on their rows only (num_lanes x max_blocks_per_seq entries). `num_cols`
  (static, default max_blocks_per_seq): the masked slots hold no block past that many
  table columns (the engine step's width bucket bounds its rows); only those are read.
  Returns (cache, blocks).

  Most engine steps free no slot: they skip the work and only advance the clock, as a
  release of no block does. With slots to free, the release costs what they hold:
  the freed rows' block ids are deduplicated by a scatter over the pool (no sort),
  and the ring-overflow eviction runs only when the ring overflows.
  """
  slot_mask = _slot_mask(cache, blocks, slot_mask)
  lanes = jnp.nonzero(slot_mask, size=num_lanes or blocks.max_seqs,
                      fill_value=blocks.max_seqs)[0].astype(_I32)
  cols = min(num_cols or blocks.max_blocks_per_seq, blocks.max_blocks_per_seq)
  return lax.cond(jnp.any(slot_mask), functools.partial(_release, num_cols=cols),
                  _release_nothing, cache, blocks, lanes)


def _release_nothing(cache: PrefixCacheState, blocks: bm.BlockState, lanes):
  del lanes
  return cache.replace(clock=cache.clock + 1), blocks


def _release(cache: PrefixCacheState, blocks: bm.BlockState, lanes, num_cols: int):
  """`release` of the slots `lanes` (i32[n], ascending, padded with max_seqs), whose
  blocks lie in their first `num_cols` table columns."""
  nb, s_max = blocks.num_blocks, blocks.max_seqs
  stamp = cache.clock
  rows = blocks.block_tables[jnp.clip(lanes, 0, s_max - 1), :num_cols]
  tables = jnp.where((lanes < s_max)[:, None], rows, -1)                 # [n, num_cols]
  held = jnp.where(tables >= 0, tables, nb).reshape(-1)
  cache = cache.replace(block_meta=cache.block_meta.at[held, st.LAST_USED].set(stamp, mode="drop"),
                        clock=stamp + 1)                                # `touch`
  if cache.eviction_policy != "lru":          # static: only LRU keeps the ring
    return cache, blocks
  # Column-major from the last column: depth-descending order.
  ids = tables[:, ::-1].T.reshape(-1)
  idc = jnp.clip(ids, 0, nb - 1)
  valid = (ids >= 0) & cache.cached[idc]
  m = ids.shape[0]
  pos = lax.iota(_I32, m)
  first = jnp.full((nb,), m, _I32).at[jnp.where(valid, ids, nb)].min(pos, mode="drop")
  keep = valid & (first[idc] == pos)                   # each block once, first place
  r = cache.lru_ring.shape[0]
  n_push = jnp.sum(keep.astype(_I32))
  over = jnp.maximum(cache.lru_tail + n_push - cache.lru_head - r, 0)    # <= m

  def drop_oldest(cache, blocks):
    old_idx = cache.lru_head + pos
    old_blk, old_live = _live(cache, blocks, old_idx)
    cache, blocks, _ = uncache(cache, blocks, jnp.where(old_live & (pos < over), old_blk, -1))
    return cache, blocks

  cache, blocks = lax.cond(over > 0, drop_oldest, lambda c, b: (c, b), cache, blocks)
  rank = jnp.cumsum(keep.astype(_I32)) - 1
  at = jnp.where(keep, (cache.lru_tail + rank) & (r - 1), r)
  return cache.replace(lru_ring=cache.lru_ring.at[at].set(ids, mode="drop"),
                       lru_stamp=cache.lru_stamp.at[at].set(stamp, mode="drop"),
                       lru_tail=cache.lru_tail + n_push,
                       lru_head=cache.lru_head + over), blocks


def free(cache: PrefixCacheState, blocks: bm.BlockState, slot, num_cols: int = 0):
  """`release` then `block_manager.free` (slot: i32[] or i32[n], < 0 padding;
  `num_cols`: as for `release`).

  Cached blocks keep the cache's reference, so they stay off the free stack.
  """
  check_states(cache, blocks)
  s_max = blocks.max_seqs
  slots = bm.int_arg(slot, "slot").reshape(-1)
  mask = jnp.zeros((s_max,), jnp.bool_).at[jnp.where(slots >= 0, slots, s_max)].set(
      True, mode="drop")
  cache, blocks = release(cache, blocks, mask & blocks.active,
                          num_lanes=min(slots.shape[0], s_max), num_cols=num_cols)
  blocks, status = bm.free(blocks, slot)
  cache = cache.replace(chain=cache.chain.at[:, st.C_OK].set(
      jnp.where(mask, 0, cache.chain[:, st.C_OK])))
  return cache, blocks, status


def uncache(cache: PrefixCacheState, blocks: bm.BlockState, victims):
  """Drops the cache's reference on `victims` (i32[k], distinct, -1 pad); blocks
  reaching ref_count 0 are pushed on the free stack in `victims` order.
  Returns (cache, blocks, blocks pushed i32[])."""
  check_states(cache, blocks)
  victims = bm.int_arg(victims, "victims")
  chex.assert_rank(victims, 1, custom_message="victims")
  nb = blocks.num_blocks
  vc = jnp.clip(victims, 0, nb - 1)
  live = (victims >= 0) & cache.cached[vc]
  v = jnp.where(live, victims, nb)
  tpos = jnp.where(live, cache.table_pos[vc], cache.table_size)
  ref = blocks.ref_count.at[v].add(-1, mode="drop")
  zero = live & (ref[vc] == 0)
  rank = jnp.cumsum(zero.astype(_I32)) - 1
  push_at = jnp.where(zero, blocks.num_free + rank, nb)
  n_push = jnp.sum(zero.astype(_I32))
  blocks = blocks.replace(ref_count=ref,
                          free_stack=blocks.free_stack.at[push_at].set(victims, mode="drop"),
                          num_free=blocks.num_free + n_push)
  cache = st.log_events(cache, st.EV_REMOVED, victims, live)
  # CACHED and TABLE_POS are adjacent columns: one scatter clears both.
  cache = cache.replace(block_meta=cache.block_meta.at[v, st.CACHED:st.TABLE_POS + 1].set(
                            jnp.asarray([0, -1], _I32), mode="drop"),
                        table=cache.table.at[tpos].set(-1, mode="drop"),
                        evictions=cache.evictions + jnp.sum(live.astype(_I32)))
  return cache, blocks, n_push


def lru_victims(cache: PrefixCacheState, blocks: bm.BlockState, num, max_evict: int):
  """i32[max_evict]: the `num` (<= max_evict) cache-only blocks to evict first, in
  eviction order, -1 pad. Two O(num_blocks) `lax.top_k` passes (the reference
  order and `ensure_free`'s fallback)."""
  check_states(cache, blocks)
  num = bm.int_arg(num, "num", max_rank=0)
  k = min(max_evict, blocks.num_blocks)
  evictable = cache.cached & (blocks.ref_count == 1)
  num = jnp.minimum(jnp.minimum(num, jnp.sum(evictable.astype(_I32))), k)
  lu = jnp.where(evictable, cache.last_used, _INT_MAX)
  neg, idx = lax.top_k(-lu, k)                     # ascending last_used
  tau = -neg[jnp.maximum(num - 1, 0)]              # last_used of the num-th victim
  older = jnp.sum((lu < tau).astype(_I32))         # all of these go; they lead `idx`
  depth_key = jnp.where(evictable & (lu == tau), cache.block_depth, -1)
  _, deep = lax.top_k(depth_key, k)                # deepest first among the ties
  i = lax.iota(_I32, k)
  out = jnp.where(i < older, idx, deep[jnp.clip(i - older, 0, k - 1)])
  out = jnp.where(i < num, out, -1)
  # The set is decided; order it too (k elements): oldest first, deepest first.
  oc = jnp.clip(out, 0, blocks.num_blocks - 1)
  _, _, out = lax.sort((jnp.where(out >= 0, lu[oc], _INT_MAX),
                        jnp.where(out >= 0, -cache.block_depth[oc], _INT_MAX), out), num_keys=2)
  if k < max_evict:
    out = jnp.pad(out, (0, max_evict - k), constant_values=-1)
  return out


def policy_victims(cache: PrefixCacheState, blocks: bm.BlockState, num, max_evict: int):
  """i32[max_evict]: the `num` (<= max_evict) cache-only blocks to evict first under
  `cache.eviction_policy`'s key, in eviction order, -1 pad. One sort of the pool
  (evictable first, then the policy's keys, then block id)."""
  check_states(cache, blocks)
  num = bm.int_arg(num, "num", max_rank=0)
  nb = blocks.num_blocks
  k = min(max_evict, nb)
  evictable = cache.cached & (blocks.ref_count == 1)
  keys = eviction_policy.EVICTION_POLICIES[cache.eviction_policy](cache)
  keys = [jnp.where(evictable, jnp.asarray(x, _I32), 0) for x in keys]
  out = lax.sort((jnp.where(evictable, 0, 1).astype(_I32), *keys, lax.iota(_I32, nb)),
                 num_keys=len(keys) + 2)[-1][:k]
  num = jnp.minimum(jnp.minimum(num, jnp.sum(evictable.astype(_I32))), k)
  out = jnp.where(lax.iota(_I32, k) < num, out, -1)
  if k < max_evict:
    out = jnp.pad(out, (0, max_evict - k), constant_values=-1)
  return out


def _ring_victims(cache: PrefixCacheState, blocks: bm.BlockState, short, max_evict: int):
  """Pops up to `short` live entries off the ring; returns (cache, victims i32[max_evict])."""
  w = max(2 * max_evict, 32)
  iw = lax.iota(_I32, w)

  def cond(c):
    head, found, _ = c
    return (found < short) & (head < cache.lru_tail)

  def body(c):
    head, found, out = c
    idx = head + iw
    blk, ok = _live(cache, blocks, idx)
    cum = jnp.cumsum(ok.astype(_I32))
    take = ok & (cum <= short - found)
    out = out.at[jnp.where(take, found + cum - 1, max_evict)].set(blk, mode="drop")
    done = found + cum[-1] >= short
    last = jnp.max(jnp.where(take, iw, -1))
    head = jnp.where(done, head + last + 1, jnp.minimum(head + w, cache.lru_tail))
    return head, found + jnp.sum(take.astype(_I32)), out

  head, _, out = lax.while_loop(
      cond, body, (cache.lru_head, jnp.zeros((), _I32), jnp.full((max_evict,), -1, _I32)))
  return cache.replace(lru_head=head), out


def ensure_free(cache: PrefixCacheState, blocks: bm.BlockState, num_needed, *,
                max_evict: int):
  """Evicts cache-only blocks, in `cache.eviction_policy`'s order, until
  `num_free >= num_needed` (or none is left).

  Args:
    num_needed: i32[], blocks the coming allocation may pop.
    max_evict: static bound on blocks evicted per call.
  Returns:
    (cache, blocks, num_evicted i32[]). Never-cached free blocks are used
    first: nothing is evicted while `num_free >= num_needed`.
  """
  cache, victims = pick_victims(cache, blocks, num_needed, max_evict=max_evict)
  return uncache(cache, blocks, victims)


def pick_victims(cache: PrefixCacheState, blocks: bm.BlockState, num_needed, *,
                 max_evict: int):
  """`ensure_free`'s choice without the eviction: (cache, victims i32[max_evict], -1
  pad), the cache-only blocks to evict, in policy order, so that `num_free >=
  num_needed` after `uncache(cache, blocks, victims)` (or every evictable one). The
  LRU ring's head moves past them; the caller must uncache them (the host tier first
  copies them out: `engine.tier`)."""
  check_states(cache, blocks)
  num_needed = bm.int_arg(num_needed, "num_needed", max_rank=0)
  short = jnp.clip(num_needed - blocks.num_free, 0, max_evict)
  # No lax.cond over the (large) states: on XLA:CPU a conditional touching
  # them costs copies even when donated (measured 3 ms vs 0.5 ms per eviction
  # at 1M blocks). With short == 0 the ring loop does not iterate and
  # `uncache` scatters nothing.
  if cache.eviction_policy == "lru":
    return _ring_victims(cache, blocks, short, max_evict)
  # the sort only on steps that evict
  return cache, lax.cond(short > 0, lambda: policy_victims(cache, blocks, short, max_evict),
                         lambda: jnp.full((max_evict,), -1, _I32))


def reset(cache: PrefixCacheState, blocks: bm.BlockState):
  """Empties the cache: every cached block loses the cache's reference (those no
  sequence holds go back on the free stack), the table, ring and all chains are
  cleared and the counters zeroed. Generations keep counting."""
  nb = blocks.num_blocks
  cache, blocks, _ = uncache(cache, blocks, jnp.where(cache.cached, lax.iota(_I32, nb), -1))
  # Every block went: the reader reports one "cleared" event instead of a row each.
  return cache.replace(num_events=jnp.zeros((), _I32),
      table=jnp.full_like(cache.table, -1), chain=st.empty_chain(cache.chain.shape[0]),
      hit_blocks=jnp.zeros((), _I32), query_blocks=jnp.zeros((), _I32),
      evictions=jnp.zeros((), _I32), lru_head=cache.lru_tail), blocks
