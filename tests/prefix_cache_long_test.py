"""The prefix cache's longer op sequences (no model): hits that never come (a prefix under
one block; the last prompt token), LRU eviction order, the LRU ring's overflow, reset. Each
case runs jitted in the default tier and eagerly, op by op, in the slow tier."""

from absl.testing import absltest, parameterized
import chex
import numpy as np
import pytest

from paged_jax import prefix_cache as pc
from prefix_cache_support import NB, Driver, Ops


def _prefix_shorter_than_one_block_never_hits(ops: Ops):
  d = Driver(ops=ops)
  for slot, toks in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2], [1, 2, 3, 4]]):
    assert d.admit(slot, toks) == 0        # at most (len - 1) // BS = 0 blocks can hit
  assert int(d.cache.hit_blocks) == 0 and float(pc.hit_rate(d.cache)) == 0.0
  d.check_invariants()


def _last_prompt_token_is_always_recomputed(ops: Ops):
  d = Driver(ops=ops)
  toks = list(range(1, 13))                # exactly 3 full blocks
  d.admit(0, toks)
  d.free(0)
  assert d.admit(1, toks) == 8             # blocks 0, 1 hit; block 2 is recomputed
  assert d.admit(2, toks + [5]) == 12


def _eviction_order_lru_then_tail_first_and_free_blocks_first(ops: Ops):
  d = Driver(ops=ops)
  rng = np.random.default_rng(3)
  seqs = [[int(t) for t in rng.integers(0, 99, 13)] for _ in range(3)]   # 3 full + 1 partial
  for slot, s in enumerate(seqs):
    d.admit(slot, s)
  owned = [np.asarray(d.blocks.block_tables[slot, :3]).tolist() for slot in range(3)]
  for slot in (1, 0, 2):                   # release order = LRU order: 1, then 0, then 2
    d.free(slot)
  assert int(pc.num_evictable(d.cache, d.blocks)) == 9
  victims = np.asarray(ops.lru_victims(d.cache, d.blocks, 9, max_evict=12)).tolist()
  assert victims[:9] == owned[1][::-1] + owned[0][::-1] + owned[2][::-1]
  assert victims[9:] == [-1] * 3
  # Free never-cached blocks are used before any cached one.
  free_now = int(d.blocks.num_free)
  cache, blocks, n = ops.ensure_free(d.cache, d.blocks, free_now, max_evict=8)
  assert int(n) == 0 and int(pc.num_cached_blocks(cache)) == 9
  cache, blocks, n = ops.ensure_free(cache, blocks, free_now + 2, max_evict=8)
  assert int(n) == 2 and int(blocks.num_free) == free_now + 2
  d.cache, d.blocks = cache, blocks
  d.check_invariants()
  # The two evicted were slot 1's tail blocks: its head still hits, its tail not.
  assert d.lookup(seqs[1])[0] == 1 and d.lookup(seqs[0])[0] == 3


def _ring_overflow_evicts_oldest_and_never_loses_an_evictable_block(ops: Ops):
  d = Driver(ops=ops)
  r = d.cache.lru_ring.shape[0]
  old = list(range(50, 63))                  # released once: live entries at the ring's head
  d.admit(0, old)
  d.free(0)
  toks = list(range(13))                     # 3 cached blocks, re-released every round
  for _ in range(r // 3 + 8):                # stale entries pile up past the ring's size
    d.admit(0, toks)
    d.free(0)
    d.check_invariants()
  assert int(d.cache.lru_tail) - int(d.cache.lru_head) <= r
  assert d.lookup(toks + [1])[0] == 3        # the recently used blocks stay cached ...
  assert d.lookup(old + [1])[0] == 0 and int(d.cache.evictions) == 3   # ... the oldest went
  evictable = int(pc.num_evictable(d.cache, d.blocks))
  d.cache, d.blocks, n = ops.ensure_free(d.cache, d.blocks, NB, max_evict=NB)
  assert int(n) == evictable and int(d.blocks.num_free) == NB
  d.check_invariants()


def _reset_returns_unheld_blocks_and_keeps_held_ones(ops: Ops):
  d = Driver(ops=ops)
  d.admit(0, list(range(13)))
  d.admit(1, list(range(100, 113)))
  d.free(0)
  free0 = int(d.blocks.num_free)
  d.cache, d.blocks = ops.reset(d.cache, d.blocks)
  assert int(pc.num_cached_blocks(d.cache)) == 0 and int(d.cache.hit_blocks) == 0
  assert int(d.blocks.num_free) == free0 + 3          # slot 0's cached blocks
  assert d.lookup(list(range(13)))[0] == 0
  d.check_invariants()
  d.free(1)
  assert int(d.blocks.num_free) == NB


_LONG_CASES = (_prefix_shorter_than_one_block_never_hits, _last_prompt_token_is_always_recomputed,
               _eviction_order_lru_then_tail_first_and_free_blocks_first,
               _ring_overflow_evicts_oldest_and_never_loses_an_evictable_block,
               _reset_returns_unheld_blocks_and_keeps_held_ones)


class PrefixCacheLongCasesTest(chex.TestCase):
  """The longer cases, jitted."""

  # Jitted here, eagerly in PrefixCacheLongCasesEagerTest (slow). Eagerly,
  # each attach / register traces and compiles its lax loop again (~0.3 / 0.8 s of CPU).
  @chex.variants(with_jit=True)
  @parameterized.named_parameters((case.__name__[1:], case) for case in _LONG_CASES)
  def test_long_case(self, case):
    case(Ops.under(self.variant))


@pytest.mark.slow
class PrefixCacheLongCasesEagerTest(chex.TestCase):
  """The longer cases, run eagerly (op by op)."""

  @chex.variants(without_jit=True)
  @parameterized.named_parameters((case.__name__[1:], case) for case in _LONG_CASES)
  def test_long_case(self, case):
    case(Ops.under(self.variant))


if __name__ == "__main__":
  absltest.main()
