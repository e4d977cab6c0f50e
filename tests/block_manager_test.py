"""Tests for paged_jax.block_manager against a plain-Python sequential model.

The model (`paged_jax.testing.BlockModel`) predicts exact block ids, ref
counts, free-stack contents and per-slot statuses; separately, structural
invariants are checked on the JAX state alone.
"""

from absl.testing import absltest
import chex
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, INVALID, OK, OUT_OF_BLOCKS, TOO_LONG

from paged_jax.testing import BlockModel

from block_manager_support import (CFG, MAX_LEN, NB, S, assert_matches_model, check_invariants,
                                   j_allocate, j_append, j_fork, j_free)


def run_random_ops(seed: int, num_steps: int, cfg: CacheConfig = CFG) -> dict:
  """Random batched ops on JAX and model; compares after every step."""
  rng = np.random.default_rng(seed)
  state, model = bm.init(cfg), BlockModel.from_config(cfg)
  s_max, max_len = cfg.max_seqs, cfg.max_seq_len
  seen = {"status": set(), "cow": 0}
  for _ in range(num_steps):
    op = rng.choice(["allocate", "append", "append_int", "append_bound", "free", "fork"],
                    p=[0.2, 0.3, 0.1, 0.05, 0.15, 0.2])
    if op == "allocate":
      slots = rng.integers(-1, s_max, size=3)
      counts = np.where(rng.random(3) < 0.9, rng.integers(1, 13, size=3),
                        rng.integers(-2, max_len + 3, size=3))
      state, status = j_allocate(state, jnp.asarray(slots, jnp.int32),
                                 jnp.asarray(counts, jnp.int32))
      expected = model.allocate(slots.tolist(), counts.tolist())
    elif op.startswith("append"):
      mask = rng.random(s_max) < 0.6
      if op == "append_int":
        state, status, cow = j_append(state, jnp.asarray(mask), 1)
        expected, cow_expected = model.append(mask.tolist(), [1] * s_max)
      else:
        counts = np.where(rng.random(s_max) < 0.9, rng.integers(0, 6, size=s_max),
                          rng.integers(-2, max_len + 3, size=s_max))
        bound = 3 if op == "append_bound" else None
        state, status, cow = j_append(state, jnp.asarray(mask), jnp.asarray(counts, jnp.int32),
                                      max_new_tokens=bound)
        expected, cow_expected = model.append(mask.tolist(), counts.tolist(), bound)
      np.testing.assert_array_equal(np.asarray(cow), np.asarray(cow_expected, np.int32))
      seen["cow"] += int((np.asarray(cow)[:, 0] >= 0).sum())
    elif op == "free":
      slots = rng.integers(-1, s_max, size=2)
      state, status = j_free(state, jnp.asarray(slots, jnp.int32))
      expected = model.free(slots.tolist())
    else:
      srcs, dsts = rng.integers(-1, s_max, size=2), rng.integers(-1, s_max, size=2)
      live = np.flatnonzero(model.active)
      idle = np.flatnonzero(~np.asarray(model.active))
      if rng.random() < 0.7 and live.size and idle.size:  # mostly valid forks
        srcs[0], dsts[0] = rng.choice(live), rng.choice(idle)
      state, status = j_fork(state, jnp.asarray(srcs, jnp.int32), jnp.asarray(dsts, jnp.int32))
      expected = model.fork(srcs.tolist(), dsts.tolist())
    np.testing.assert_array_equal(np.asarray(status), expected, f"op {op}")
    seen["status"].update(np.asarray(status).tolist())
    assert_matches_model(state, model)
    check_invariants(state)
  # Tear down: freeing every slot returns every block.
  state, _ = j_free(state, jnp.arange(s_max, dtype=jnp.int32))
  model.free(list(range(s_max)))
  assert_matches_model(state, model)
  assert int(state.num_free) == cfg.num_blocks
  return seen


class RandomOpsTest(chex.TestCase):

  def test_random_sequences_match_model(self):
    seen = {"status": set(), "cow": 0}
    for seed in range(3):
      out = run_random_ops(seed, 150)
      seen["status"] |= out["status"]
      seen["cow"] += out["cow"]
    # The run must actually have exercised every outcome and copy-on-write.
    self.assertEqual(seen["status"], {OK, OUT_OF_BLOCKS, TOO_LONG, INVALID})
    self.assertGreater(seen["cow"], 10)


class BlockMachine(RuleBasedStateMachine):
  """Hypothesis-driven op sequences; model and invariants checked after every step."""

  def __init__(self):
    super().__init__()
    self.state, self.model = bm.init(CFG), BlockModel.from_config(CFG)

  slot = st.integers(-1, S - 1)

  @rule(slots=st.lists(slot, min_size=3, max_size=3),
        counts=st.lists(st.integers(0, MAX_LEN + 1), min_size=3, max_size=3))
  def allocate(self, slots, counts):
    self.state, status = j_allocate(self.state, jnp.asarray(slots, jnp.int32),
                                    jnp.asarray(counts, jnp.int32))
    np.testing.assert_array_equal(status, self.model.allocate(slots, counts))

  @rule(mask=st.lists(st.booleans(), min_size=S, max_size=S),
        counts=st.lists(st.integers(0, 9), min_size=S, max_size=S))
  def append(self, mask, counts):
    self.state, status, cow = j_append(self.state, jnp.asarray(mask),
                                       jnp.asarray(counts, jnp.int32))
    expected, cow_expected = self.model.append(mask, counts)
    np.testing.assert_array_equal(status, expected)
    np.testing.assert_array_equal(cow, np.asarray(cow_expected, np.int32))

  @rule(slots=st.lists(slot, min_size=2, max_size=2))
  def free(self, slots):
    self.state, status = j_free(self.state, jnp.asarray(slots, jnp.int32))
    np.testing.assert_array_equal(status, self.model.free(slots))

  @rule(srcs=st.lists(slot, min_size=2, max_size=2), dsts=st.lists(slot, min_size=2, max_size=2))
  def fork(self, srcs, dsts):
    self.state, status = j_fork(self.state, jnp.asarray(srcs, jnp.int32),
                                jnp.asarray(dsts, jnp.int32))
    np.testing.assert_array_equal(status, self.model.fork(srcs, dsts))

  @invariant()
  def agrees(self):
    assert_matches_model(self.state, self.model)
    check_invariants(self.state)

  def teardown(self):
    state, _ = j_free(self.state, jnp.arange(S, dtype=jnp.int32))
    assert int(state.num_free) == NB and not np.asarray(state.ref_count).any()


class BlockMachineTest(BlockMachine.TestCase):
  settings = settings(max_examples=20, stateful_step_count=30, deadline=None)  # ~600 steps


@pytest.mark.slow
class BlockMachineLongTest(BlockMachine.TestCase):
  settings = settings(max_examples=150, stateful_step_count=40, deadline=None)  # ~6000 steps


@pytest.mark.slow
class RandomOpsLongTest(chex.TestCase):

  def test_long_random_sequences_match_model(self):
    for seed in range(100, 110):
      run_random_ops(seed, 500)


if __name__ == "__main__":
  absltest.main()
