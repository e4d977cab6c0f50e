"""Prefix caching over a sliding-window KV group (hybrid KV): the sliding layers' blocks
of cached prefixes, kept as *companions* of the main pool's cached blocks.

With hybrid KV (`CacheConfig.sliding_layers`) the sliding-window layers keep their K/V in
a pool of their own, with the main pool's slots, lengths and logical blocks. The prefix
cache hashes and verifies the main (full-attention) pool's blocks only; the sliding group
needs no hash table of its own, because the main pool's block `b` at logical index j of a
slot names exactly the token prefix whose sliding K/V that slot's sliding block at j holds.
So a map over the main pool's blocks records which sliding block holds the sliding layers'
K/V of each cached main block (its companion); a companion holds one reference of the
sliding pool (the cache's), as a cached main block holds one of the main pool.

Life of a companion (all pure ops inside the engine's one jitted step):
  adopt       at the end of a step, every slot's sliding block at logical j whose main
              twin (the slot's main block at j) is cached and has no live companion
              becomes that block's companion (ref + 1), before the window's release, so
              a block that slides out (or whose sequence finishes) stays, cache-held;
  hit_rule    a lookup's hit of n main blocks is cut to the largest n' <= n such that
              every logical block a sliding query at positions >= n' * block_size can
              read, j >= first_visible_block(n' * block_size) (`block_window`), has a live
              companion; n' = 0 always qualifies, and a window of 1 needs none;
  attach_write the attached slot's sliding row gets those companions (ref + 1), earlier
              entries -1 (as `release_out_of_window` leaves them), the same length;
  evict_for   when the step's worst-case need of sliding blocks exceeds the free ones,
              cache-only companions are evicted (stale ones, i.e. of main blocks this
              step's main eviction took, first, then least recently used main twin,
              deepest first); the sliding pool is sized so that blocks live sequences
              hold never run it short (`config.sliding_pool_blocks`: a window per
              slot, or the main pool's size, each sliding block in use being the twin
              of a distinct main one), so evicting companions always makes room;
  drop_stale  a companion whose main twin was evicted (or re-registered: its generation
              moved on) is released at the end of the step (once: O(NSB)).
A companion is live iff `owner[s] == b`, `sliding_of[b] == s`, `sliding_gen[b]` equals
b's generation and b is cached: a stale record can never be hit (exact, like the main
cache's parent-generation check). vLLM v1's hybrid KV-cache manager is the anchor: one
hit length for all groups, the shortest each group can serve; a sliding group needs only
the window before the hit point.
"""

from __future__ import annotations

import flax
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import block_window
from paged_jax.prefix_cache import state as st
from paged_jax.prefix_cache.state import PrefixCacheState

_I32 = jnp.int32
_INT_MAX = np.iinfo(np.int32).max


@flax.struct.dataclass
class Companions:
  """The sliding group's side of the prefix cache (NB main blocks, NSB sliding blocks).

  Attributes:
    sliding_of: i32[NB], per main block, the sliding block holding its sliding layers'
      K/V (-1 none; live only with the checks in the module docstring).
    sliding_gen: i32[NB], the main block's generation when its companion was recorded.
    owner: i32[NSB], per sliding block, the main block it is the companion of (-1: not a
      companion); every companion holds one reference of the sliding pool.
    window: the sliding window W in tokens (static).
  """
  sliding_of: jax.Array
  sliding_gen: jax.Array
  owner: jax.Array
  window: int = flax.struct.field(pytree_node=False)


def init(num_blocks: int, num_sliding_blocks: int, window: int) -> Companions:
  """No companion yet."""
  return Companions(sliding_of=jnp.full((num_blocks,), -1, _I32),
                    sliding_gen=jnp.zeros((num_blocks,), _I32),
                    owner=jnp.full((num_sliding_blocks,), -1, _I32), window=window)


def live(comp: Companions, cache: PrefixCacheState, ids):
  """bool[...]: main blocks `ids` (-1 = none) have a live companion."""
  nb, nsb = comp.sliding_of.shape[0], comp.owner.shape[0]
  bc = jnp.clip(ids, 0, nb - 1)
  s = comp.sliding_of[bc]
  meta = cache.block_meta[bc]
  return ((ids >= 0) & (s >= 0) & (comp.owner[jnp.clip(s, 0, nsb - 1)] == ids)
          & (comp.sliding_gen[bc] == meta[..., st.GEN]) & (meta[..., st.CACHED] != 0))


def hit_rule(comp: Companions, cache: PrefixCacheState, n_hit, ids):
  """i32[]: the longest hit <= n_hit (main blocks `ids` i32[P], -1 past n_hit) whose
  window before its end the sliding group can serve (every block j in
  [first_visible_block(n' * bs), n') has a live companion). O(P)."""
  p, bs = ids.shape[0], cache.block_size
  good = (lax.iota(_I32, p) < n_hit) & live(comp, cache, ids)
  bad = jnp.concatenate([jnp.zeros((1,), _I32), jnp.cumsum((~good).astype(_I32))])  # [P+1]
  cand = lax.iota(_I32, p + 1)                                 # candidate hit lengths
  first = block_window.first_visible_block(cand * bs, bs, comp.window)
  ok = (cand <= n_hit) & (bad[cand] == bad[first])
  return jnp.max(jnp.where(ok, cand, 0))


def attach_write(comp: Companions, sliding: bm.BlockState, row, ids, n_hit):
  """The sliding side of one `core.attach_write`: slot `row` (max_seqs: none) gets the
  companions of its hit blocks `ids` (i32[P], -1 past `n_hit`) inside the window before
  the hit's end (ref + 1 each), -1 before it; its length is n_hit * block_size."""
  bs, nsb = sliding.block_size, sliding.num_blocks
  j = lax.iota(_I32, ids.shape[0])
  first = block_window.first_visible_block(n_hit * bs, bs, comp.window)
  keep = (j >= first) & (j < n_hit) & (ids >= 0)
  sids = jnp.where(keep, comp.sliding_of[jnp.clip(ids, 0, comp.sliding_of.shape[0] - 1)], -1)
  return sliding.replace(
      ref_count=sliding.ref_count.at[jnp.where(sids >= 0, sids, nsb)].add(1, mode="drop"),
      block_tables=sliding.block_tables.at[row].set(sids, mode="drop"),
      seq_lens=sliding.seq_lens.at[row].set(n_hit * bs, mode="drop"),
      active=sliding.active.at[row].set(True, mode="drop"))


def adopt(comp: Companions, cache: PrefixCacheState, main: bm.BlockState,
          sliding: bm.BlockState, lanes=None, num_cols: int = 0):
  """Every (slot, j) whose main block is cached without a live companion and whose sliding
  block is no companion yet: that sliding block becomes the main block's companion (one
  per main block and per sliding block: the first such entry in lane-major order).
  Call after registration and before the window's release. `lanes` (i32[n], S pads;
  default every slot): the slots whose blocks may have been registered, holding blocks
  in their first `num_cols` columns only (0: all); a slot left out only misses its
  companions (shorter hits later, never a wrong one). O(n x num_cols + NB + NSB)."""
  nb, nsb, s_max = main.num_blocks, sliding.num_blocks, main.max_seqs
  lanes = lax.iota(_I32, s_max) if lanes is None else lanes
  cols = num_cols or main.max_blocks_per_seq
  lc = jnp.clip(lanes, 0, s_max - 1)
  use = ((lanes < s_max) & main.active[lc])[:, None]
  b = jnp.where(use, main.block_tables[lc, :cols], -1)                # [n, cols]
  s = jnp.where(use, sliding.block_tables[lc, :cols], -1)
  bc, sc = jnp.clip(b, 0, nb - 1), jnp.clip(s, 0, nsb - 1)
  cand = ((b >= 0) & (s >= 0) & (cache.block_meta[bc, st.CACHED] != 0)
          & ~live(comp, cache, b) & (comp.owner[sc] < 0))
  flat = lax.iota(_I32, b.size).reshape(b.shape)
  first_b = jnp.full((nb,), _INT_MAX, _I32).at[jnp.where(cand, b, nb)].min(flat, mode="drop")
  first_s = jnp.full((nsb,), _INT_MAX, _I32).at[jnp.where(cand, s, nsb)].min(flat, mode="drop")
  take = cand & (first_b[bc] == flat) & (first_s[sc] == flat)
  bi, si = jnp.where(take, b, nb), jnp.where(take, s, nsb)
  comp = comp.replace(sliding_of=comp.sliding_of.at[bi].set(s, mode="drop"),
                      sliding_gen=comp.sliding_gen.at[bi].set(
                          cache.block_meta[bc, st.GEN], mode="drop"),
                      owner=comp.owner.at[si].set(b, mode="drop"))
  return comp, sliding.replace(ref_count=sliding.ref_count.at[si].add(1, mode="drop"))


def _release(comp: Companions, sliding: bm.BlockState, victims):
  """Drops the cache's reference on companions `victims` (i32[k], distinct, -1 pad)."""
  nsb = sliding.num_blocks
  sliding = bm.release_references(sliding, victims)
  return comp.replace(owner=comp.owner.at[jnp.where(victims >= 0, victims, nsb)].set(
      -1, mode="drop")), sliding


def drop_stale(comp: Companions, cache: PrefixCacheState, sliding: bm.BlockState):
  """Releases every companion whose main twin lost it (evicted, re-registered). O(NSB)."""
  s = lax.iota(_I32, sliding.num_blocks)
  b = comp.owner
  nb = comp.sliding_of.shape[0]
  stale = (b >= 0) & ~(live(comp, cache, b) & (comp.sliding_of[jnp.clip(b, 0, nb - 1)] == s))
  return _release(comp, sliding, jnp.where(stale, s, -1))


def victims(comp: Companions, cache: PrefixCacheState, sliding: bm.BlockState, num,
            max_evict: int):
  """i32[max_evict]: the `num` cache-only companions to evict first (stale, then least
  recently used main twin, deepest first; then block id), -1 pad. One sort of the pool."""
  nsb = sliding.num_blocks
  k = min(max_evict, nsb)
  b = comp.owner
  bc = jnp.clip(b, 0, comp.sliding_of.shape[0] - 1)
  evictable = (b >= 0) & (sliding.ref_count == 1)
  fresh = jnp.where(evictable, live(comp, cache, b).astype(_I32), 0)
  used = jnp.where(evictable, cache.block_meta[bc, st.LAST_USED], 0)
  deep = jnp.where(evictable, -cache.block_meta[bc, st.DEPTH], 0)
  out = lax.sort((jnp.where(evictable, 0, 1).astype(_I32), fresh, used, deep,
                  lax.iota(_I32, nsb)), num_keys=5)[-1][:k]
  num = jnp.minimum(jnp.minimum(num, jnp.sum(evictable.astype(_I32))), k)
  out = jnp.where(lax.iota(_I32, k) < num, out, -1)
  return jnp.pad(out, (0, max_evict - k), constant_values=-1) if k < max_evict else out


def evict_for(comp: Companions, cache: PrefixCacheState, sliding: bm.BlockState, need,
              max_evict: int):
  """Evicts cache-only companions until `need` (i32[], the step's worst-case pops of the
  sliding pool) is free, or none is left. The sort runs only on steps that evict."""
  short = jnp.clip(need - sliding.num_free, 0, max_evict)
  out = lax.cond(short > 0, lambda: victims(comp, cache, sliding, short, max_evict),
                 lambda: jnp.full((max_evict,), -1, _I32))
  return _release(comp, sliding, out)


def num_companions(comp: Companions):
  """i32[]: sliding blocks held as companions (the cache's reference)."""
  return jnp.sum((comp.owner >= 0).astype(_I32))
