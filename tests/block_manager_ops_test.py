"""Block manager ops one by one: copy-on-write, all-or-nothing on bad input,
token slots, tracing, boundary checks, in-place updates, and successes after a shortfall
in one batch (each against the plain-Python model)."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, INVALID, OK, OUT_OF_BLOCKS, TOO_LONG
from paged_jax.testing import BlockModel

from block_manager_support import (BS, CFG, JIT, MAX_LEN, NB, S, Ops, assert_matches_model,
                                   assert_same_state, check_invariants, j_allocate, j_append,
                                   j_fork, j_free, snapshot)


def _shared_partial_state(num_holders: int, cfg: CacheConfig = CFG, length: int = 6,
                          ops: Ops = JIT):
  """Slot 0 holds `length` tokens; slots 1..num_holders-1 fork it (block 1 partial)."""
  state, model = bm.init(cfg), BlockModel.from_config(cfg)
  state, _ = ops.allocate(state, jnp.int32(0), jnp.int32(length))
  model.allocate([0], [length])
  if num_holders > 1:
    dsts = list(range(1, num_holders))
    state, _ = ops.fork(state, jnp.zeros(len(dsts), jnp.int32), jnp.asarray(dsts, jnp.int32))
    model.fork([0] * len(dsts), dsts)
  return state, model


def _no_cow():
  return -np.ones((S, 2), np.int32)


class CopyOnWriteTest(chex.TestCase):
  """Each case jitted and eagerly (op by op), against the same model."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_cow_pair_then_in_place(self):
    ops = Ops.under(self.variant)
    state, _ = _shared_partial_state(2, ops=ops)  # blocks [0, 1], block 1 holds 2 of 4 tokens
    mask = jnp.array([False, True, False, False, False, False])
    state, status, cow = ops.append(state, mask, 1)
    self.assertEqual(int(status[1]), OK)
    np.testing.assert_array_equal(cow[1], [1, 2])  # fresh block 2 replaces shared block 1
    np.testing.assert_array_equal(state.block_tables[1, :2], [0, 2])
    np.testing.assert_array_equal(state.ref_count[:3], [2, 1, 1])
    # Slot 0 is now block 1's only holder: it writes in place.
    state, status, cow = ops.append(state, mask.at[0].set(True).at[1].set(False), 1)
    chex.assert_trees_all_equal(cow, _no_cow(), strict=True)
    np.testing.assert_array_equal(state.block_tables[0, :2], [0, 1])

  @chex.variants(with_jit=True, without_jit=True)
  def test_full_shared_block_needs_no_copy(self):
    ops = Ops.under(self.variant)
    state, _ = _shared_partial_state(2, length=8, ops=ops)  # both blocks full
    state, status, cow = ops.append(state, jnp.arange(S) < 2, 1)
    chex.assert_trees_all_equal((status, cow), (np.zeros(S, np.int32), _no_cow()), strict=True)
    np.testing.assert_array_equal(state.block_tables[:2, :3], [[0, 1, 2], [0, 1, 3]])

  @chex.variants(with_jit=True, without_jit=True)
  def test_many_holders_append_together(self):
    ops = Ops.under(self.variant)
    for writers in ([0, 1, 2], [0, 1, 2, 3], [1, 3], [3]):
      state, model = _shared_partial_state(4, ops=ops)
      mask = np.isin(np.arange(S), writers)
      state, status, cow = ops.append(state, jnp.asarray(mask), 2)
      expected, cow_expected = model.append(mask.tolist(), [2] * S)
      chex.assert_trees_all_equal((status, cow), (np.asarray(expected, np.int32),
                                                  np.asarray(cow_expected, np.int32)),
                                  strict=True)
      assert_matches_model(state, model)
      copies = int((np.asarray(cow)[:, 0] >= 0).sum())
      # All four holders writing: the last one writes in place.
      self.assertEqual(copies, len(writers) - (len(writers) == 4))
      self.assertEqual(int(state.ref_count[1]), 4 - copies)

  @chex.variants(with_jit=True, without_jit=True)
  def test_many_holders_short_of_blocks(self):
    # 4 holders of blocks [0, 1]; leave exactly one free block, then all append.
    ops = Ops.under(self.variant)
    cfg = CFG.replace(num_blocks=3)
    state, model = _shared_partial_state(4, cfg, ops=ops)
    state, status, cow = ops.append(state, jnp.arange(S) < 4, 1)
    expected, cow_expected = model.append([s < 4 for s in range(S)], [1] * S)
    np.testing.assert_array_equal(status, [OK, OUT_OF_BLOCKS, OUT_OF_BLOCKS, OUT_OF_BLOCKS, OK, OK])
    chex.assert_trees_all_equal((status, cow), (np.asarray(expected, np.int32),
                                                np.asarray(cow_expected, np.int32)), strict=True)
    assert_matches_model(state, model)


class TransactionalTest(chex.TestCase):

  def _busy_state(self, ops):
    state, model = _shared_partial_state(3, ops=ops)
    state, _ = ops.allocate(state, jnp.int32(4), jnp.int32(9))
    model.allocate([4], [9])
    return state, model

  @chex.variants(with_jit=True, without_jit=True)
  def test_failing_ops_leave_state_bit_identical(self):
    ops = Ops.under(self.variant)
    state, _ = self._busy_state(ops)
    before = snapshot(state)
    cases = [
        lambda s: ops.allocate(s, jnp.int32(5), jnp.int32(NB * BS)),   # TOO_LONG
        lambda s: ops.allocate(s, jnp.array([3, 5], jnp.int32), jnp.array([0, -3], jnp.int32)),
        lambda s: ops.allocate(s, jnp.int32(0), jnp.int32(3)),         # active
        lambda s: ops.allocate(s, jnp.int32(-1), jnp.int32(3)),        # padding
        lambda s: ops.free(s, jnp.int32(5)),                           # inactive
        lambda s: ops.fork(s, jnp.int32(5), jnp.int32(3)),             # inactive src
        lambda s: ops.fork(s, jnp.int32(0), jnp.int32(1)),             # active dst
        lambda s: ops.append(s, jnp.arange(S) == 5, 1)[:2],            # inactive
        lambda s: ops.append(s, jnp.arange(S) == 0, MAX_LEN)[:2],      # TOO_LONG
        lambda s: ops.append(s, jnp.arange(S) == 0, jnp.full((S,), -1, jnp.int32))[:2],
    ]
    for i, op in enumerate(cases):
      new_state, status = op(state)
      self.assertTrue((np.asarray(status) != OK).any(), f"case {i}")
      assert_same_state(before, new_state)

  @chex.variants(with_jit=True, without_jit=True)
  def test_out_of_blocks_exact_boundary(self):
    ops = Ops.under(self.variant)
    state = bm.init(CFG)
    state, _ = ops.allocate(state, jnp.array([0, 1, 2, 3], jnp.int32),
                            jnp.array([MAX_LEN, MAX_LEN, MAX_LEN, 13], jnp.int32))
    state, _ = ops.fork(state, jnp.int32(3), jnp.int32(4))  # share 4 blocks, last holds 1 token
    self.assertEqual(int(state.num_free), 1)
    before = snapshot(state)
    new_state, status = ops.allocate(state, jnp.int32(5), jnp.int32(BS + 1))  # needs 2
    self.assertEqual(int(status), OUT_OF_BLOCKS)
    assert_same_state(before, new_state)
    state, status = ops.allocate(state, jnp.int32(5), jnp.int32(BS))  # needs exactly 1
    self.assertEqual(int(status), OK)
    self.assertEqual(int(state.num_free), 0)
    before = snapshot(state)
    # With no block free, writing into the shared partial block needs a copy: fails.
    for slot, n in ((4, 1), (3, 3)):
      new_state, status, cow = ops.append(state, jnp.arange(S) == slot, n)
      self.assertEqual(int(status[slot]), OUT_OF_BLOCKS)
      chex.assert_trees_all_equal(cow, _no_cow(), strict=True)
      assert_same_state(before, new_state)
    state, _ = ops.free(state, jnp.int32(5))
    state, status, cow = ops.append(state, jnp.arange(S) == 4, 1)   # the one free block
    self.assertEqual(int(status[4]), OK)
    np.testing.assert_array_equal(cow[4], [int(state.block_tables[3, 3]), 19])
    self.assertEqual(int(state.num_free), 0)
    state, status, cow = ops.append(state, jnp.arange(S) == 3, 3)   # now sole holder: in place
    self.assertEqual(int(status[3]), OK)
    self.assertEqual(int(state.seq_lens[3]), 16)
    check_invariants(state)

  @chex.variants(with_jit=True, without_jit=True)
  def test_one_block_left_goes_to_first_slot_in_order(self):
    ops = Ops.under(self.variant)
    cfg = CFG.replace(num_blocks=3)
    state, model = bm.init(cfg), BlockModel.from_config(cfg)
    # Later, smaller requests still succeed after a larger one fails (sequential policy).
    slots, counts = [0, 1, 2, 3], [5, 9, 4, 1]
    state, status = ops.allocate(state, jnp.asarray(slots, jnp.int32),
                                 jnp.asarray(counts, jnp.int32))
    np.testing.assert_array_equal(status, [OK, OUT_OF_BLOCKS, OK, OUT_OF_BLOCKS])
    np.testing.assert_array_equal(status, model.allocate(slots, counts))
    assert_matches_model(state, model)

  @chex.variants(with_jit=True, without_jit=True)
  def test_too_long_boundary(self):
    ops = Ops.under(self.variant)
    state = bm.init(CFG)
    state, status = ops.allocate(state, jnp.array([0, 1], jnp.int32),
                                 jnp.array([MAX_LEN, MAX_LEN + 1], jnp.int32))
    np.testing.assert_array_equal(status, [OK, TOO_LONG])
    state, status, _ = ops.append(state, jnp.arange(S) == 0, 1)
    self.assertEqual(int(status[0]), TOO_LONG)
    self.assertEqual(int(state.seq_lens[0]), MAX_LEN)

  @chex.variants(with_jit=True, without_jit=True)
  def test_batch_duplicates_and_chains(self):
    ops = Ops.under(self.variant)
    state, model = bm.init(CFG), BlockModel.from_config(CFG)
    state, status = ops.allocate(state, jnp.array([2, 2], jnp.int32),
                                 jnp.array([3, 5], jnp.int32))
    np.testing.assert_array_equal(status, [OK, INVALID])
    model.allocate([2, 2], [3, 5])
    state, status = ops.fork(state, jnp.array([2, 3, 4], jnp.int32),
                             jnp.array([3, 4, 4], jnp.int32))
    np.testing.assert_array_equal(status, [OK, OK, INVALID])  # chain 2 -> 3 -> 4
    np.testing.assert_array_equal(status, model.fork([2, 3, 4], [3, 4, 4]))
    self.assertEqual(int(state.ref_count[0]), 3)
    state, status = ops.free(state, jnp.array([3, 3, 2, 4], jnp.int32))
    np.testing.assert_array_equal(status, [OK, INVALID, OK, OK])
    np.testing.assert_array_equal(status, model.free([3, 3, 2, 4]))
    assert_matches_model(state, model)
    self.assertEqual(int(state.num_free), NB)


class TokenSlotsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_python(self):
    ops = Ops.under(self.variant)
    rng = np.random.default_rng(5)
    for seed in range(3):
      state, model = bm.init(CFG), BlockModel.from_config(CFG)
      # Build a random state with sharing through the ops themselves.
      for s, n in enumerate(rng.integers(1, 12, size=4)):
        state, _ = ops.allocate(state, jnp.int32(s), jnp.int32(n))
        model.allocate([s], [int(n)])
      state, _ = ops.fork(state, jnp.int32(seed), jnp.int32(5))
      model.fork([seed], [5])
      counts = rng.integers(0, 6, size=S)
      state, _, _ = ops.append(state, jnp.ones(S, bool), jnp.asarray(counts, jnp.int32))
      model.append([True] * S, counts.tolist())
      seq = rng.integers(-2, S + 1, size=64)
      pos = rng.integers(-2, MAX_LEN + 2, size=64)
      got = ops.token_slots(state, jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32))
      np.testing.assert_array_equal(got, model.token_slots(seq.tolist(), pos.tolist()))
      self.assertGreater(int((np.asarray(got) >= 0).sum()), 10)


class TracingTest(chex.TestCase):

  def test_append_traces_once(self):
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, mask, counts):
      return bm.append(state, mask, counts)

    rng = np.random.default_rng(0)
    state = bm.init(CFG)
    state, _ = j_allocate(state, jnp.arange(S, dtype=jnp.int32), jnp.int32(1))
    for _ in range(6):
      state, _, _ = step(state, jnp.asarray(rng.random(S) < 0.5),
                         jnp.asarray(rng.integers(0, 3, size=S), jnp.int32))

  @chex.variants(with_jit=True, without_jit=True)
  def test_ops_jit_and_eager_agree_with_model(self):
    allocate, append = self.variant(bm.allocate), self.variant(bm.append)
    free, fork = self.variant(bm.free), self.variant(bm.fork)
    state, model = bm.init(CFG), BlockModel.from_config(CFG)
    state, status = allocate(state, jnp.array([0, 1], jnp.int32), jnp.array([6, 3], jnp.int32))
    np.testing.assert_array_equal(status, model.allocate([0, 1], [6, 3]))
    state, status = fork(state, jnp.array([0], jnp.int32), jnp.array([2], jnp.int32))
    np.testing.assert_array_equal(status, model.fork([0], [2]))
    counts = jnp.array([1, 5, 2, 0, 0, 0], jnp.int32)
    state, status, cow = append(state, jnp.arange(S) < 3, counts)
    expected, cow_expected = model.append([s < 3 for s in range(S)], counts.tolist())
    np.testing.assert_array_equal(status, expected)
    np.testing.assert_array_equal(cow, np.asarray(cow_expected, np.int32))
    state, status = free(state, jnp.array([0, 2], jnp.int32))
    np.testing.assert_array_equal(status, model.free([0, 2]))
    assert_matches_model(state, model)


class BoundaryChecksTest(chex.TestCase):
  """chex checks at the public ops: eagerly they raise before any work; under jit they
  raise at trace time (and cost nothing once traced)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_wrong_shapes_and_dtypes_are_named(self):
    state, _ = bm.allocate(bm.init(CFG), jnp.array([0, 1], jnp.int32), jnp.int32(5))
    i32 = lambda *x: jnp.array(x, jnp.int32)
    cases = [
        (bm.allocate, (state, jnp.array([2.0]), i32(3)), r"float32 but expected.*\[slot\]"),
        (bm.allocate, (state, i32(2), jnp.array([3.5])), r"\[num_tokens\]"),
        (bm.append, (state, jnp.ones(S - 1, bool), i32(*[1] * S)), r"\(5,\).*\[slot_mask\]"),
        (bm.append, (state, jnp.ones(S, jnp.int32), i32(*[1] * S)), r"bool.*\[slot_mask\]"),
        (bm.append, (state, jnp.ones(S, bool), i32(1, 2)), r"\[num_new_tokens\]"),
        (bm.free, (state, i32(0, 1).reshape(1, 2)), r"rank 2.*\[slot\]"),
        (bm.fork, (state, i32(0), jnp.array([True])), r"\[dst_slot\]"),
        (bm.token_slots, (state, i32(0, 1, 1), i32(0, 1)), r"\[seq_slot, positions\]"),
        (bm.free, (state.replace(seq_lens=jnp.zeros((S + 1,), jnp.int32)), i32(0)),
         r"shape \(7,\)"),
    ]
    for i, (op, args, pattern) in enumerate(cases):
      with self.assertRaisesRegex(AssertionError, pattern, msg=f"case {i}"):
        self.variant(op)(*args)


class InPlaceTest(chex.TestCase):
  """With the state donated, no op copies an O(num_blocks) array (cost independent of the pool)."""

  def test_no_num_blocks_sized_copy_when_donated(self):
    nb = 4099  # a length no other array has, to find it in the compiled HLO
    cfg = CacheConfig(block_size=4, num_blocks=nb, max_seqs=8, max_blocks_per_seq=6)
    state = bm.init(cfg)
    slots = jnp.arange(3, dtype=jnp.int32)
    ops = {
        "allocate": (bm.allocate, (state, slots, jnp.ones(3, jnp.int32))),
        "append": (bm.append, (state, jnp.ones(8, bool), jnp.ones(8, jnp.int32))),
        "append_int": (lambda st, m: bm.append(st, m, 1), (state, jnp.ones(8, bool))),
        "free": (bm.free, (state, slots)),
        "fork": (bm.fork, (state, slots, slots + 3)),
    }

    def big_copies(fn, args, donate):
      kw = {"donate_argnums": 0} if donate else {}
      text = jax.jit(fn, **kw).lower(*args).compile().as_text()
      return [l for l in text.splitlines() if f"s32[{nb}]" in l and " copy(" in l]

    for name, (fn, args) in ops.items():
      self.assertEqual(big_copies(fn, args, donate=True), [], name)
    # The check can fail: without donation the updated ref_count must be copied.
    self.assertNotEmpty(big_copies(bm.free, ops["free"][1], donate=False))


def _ok_after_shortfall(status) -> int:
  """Requests that succeed after an earlier one of the same batch ran out of blocks."""
  status = np.asarray(status).reshape(-1).tolist()
  first = status.index(OUT_OF_BLOCKS) if OUT_OF_BLOCKS in status else len(status)
  return sum(s == OK for s in status[first + 1:])


class ShortfallTailTest(chex.TestCase):
  """Batches whose requests keep succeeding after a shortfall, one at a time: the block
  manager decides them without a scan or a lax.cond (a prefix sum up to the first
  shortfall, then one vector round per later success), so these must match the model."""

  def test_successes_after_a_shortfall_match_model(self):
    cfg = CacheConfig(block_size=2, num_blocks=14, max_seqs=8, max_blocks_per_seq=7)
    s_max, nb = cfg.max_seqs, cfg.num_blocks
    seen = {"allocate": 0, "append": 0, "append_cow": 0, "bounded_invalid": 0}
    for seed in range(56):
      rng = np.random.default_rng(seed)
      state, model = bm.init(cfg), BlockModel.from_config(cfg)
      # Large first requests so a later, smaller one often still fits; duplicate slots
      # whose first request ran short may take the slot.
      # Seeds from 40 on with a static bound on prompt length (the engine step passes
      # its token bucket): narrower pop window and rounds, longer prompts INVALID.
      slots = rng.integers(0, s_max, size=8)
      counts = rng.integers(1, cfg.max_seq_len + 1, size=8)
      bound = 9 if seed >= 40 else None
      state, status = j_allocate(state, jnp.asarray(slots, jnp.int32),
                                 jnp.asarray(counts, jnp.int32), max_num_tokens=bound)
      np.testing.assert_array_equal(
          status, model.allocate(slots.tolist(), counts.tolist(), max_num_tokens=bound))
      seen["allocate"] += _ok_after_shortfall(status)
      seen["bounded_invalid"] += int(bound is not None and np.any(counts > bound))
      assert_matches_model(state, model)
      live = np.flatnonzero(model.active)
      if live.size:  # share blocks, so appends also copy on write
        srcs = rng.choice(live, size=4)
        dsts = rng.integers(0, s_max, size=4)
        state, status = j_fork(state, jnp.asarray(srcs, jnp.int32), jnp.asarray(dsts, jnp.int32))
        np.testing.assert_array_equal(status, model.fork(srcs.tolist(), dsts.tolist()))
      for bound in (None, 5):
        mask = rng.random(s_max) < 0.9
        counts = rng.integers(0, 6, size=s_max)
        state, status, cow = j_append(state, jnp.asarray(mask), jnp.asarray(counts, jnp.int32),
                                      max_new_tokens=bound)
        expected, cow_expected = model.append(mask.tolist(), counts.tolist(), bound)
        np.testing.assert_array_equal(status, expected)
        np.testing.assert_array_equal(cow, np.asarray(cow_expected, np.int32))
        seen["append"] += _ok_after_shortfall(status)
        tail = np.asarray(status).tolist()
        after = tail.index(OUT_OF_BLOCKS) + 1 if OUT_OF_BLOCKS in tail else s_max
        seen["append_cow"] += int((np.asarray(cow)[after:, 0] >= 0).sum())
        assert_matches_model(state, model)
        check_invariants(state)
      state, _ = j_free(state, jnp.arange(s_max, dtype=jnp.int32))
      assert int(state.num_free) == nb
    # The batches must have exercised successes (and copies) past a shortfall.
    self.assertGreater(seen["allocate"], 10, seen)
    self.assertGreater(seen["append"], 10, seen)
    self.assertGreater(seen["append_cow"], 0, seen)
    self.assertGreater(seen["bounded_invalid"], 5, seen)


if __name__ == "__main__":
  absltest.main()
