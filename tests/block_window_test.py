"""Hybrid KV's sliding pool (`paged_jax.block_window`): the release of blocks that slid out
of every window, against the plain-Python allocator model (`BlockModel`) after every op of
random op sequences (allocate, append with copy-on-write, fork, free, release), plus the
per-sequence bound the engine sizes the pool with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax import block_window
from paged_jax.config import (CacheConfig, OK, cdiv, sliding_blocks_per_seq,
                             sliding_pool_blocks)
from paged_jax.testing import BlockModel

from block_manager_support import assert_matches_model, j_allocate, j_append, j_fork, j_free

CFG = CacheConfig(block_size=4, num_blocks=24, max_seqs=6, max_blocks_per_seq=12)
S = CFG.max_seqs
j_release = jax.jit(block_window.release_out_of_window, static_argnums=1)


def _check_window_invariants(state, window):
  """Each active slot holds exactly the blocks from first_visible_block to its last one;
  ref counts equal the table entries; the free stack is exactly the unreferenced blocks."""
  tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
  ref, nf = np.asarray(state.ref_count), int(state.num_free)
  np.testing.assert_array_equal(np.bincount(tables[tables >= 0], minlength=ref.size), ref)
  assert set(np.asarray(state.free_stack)[:nf].tolist()) == set(np.nonzero(ref == 0)[0])
  for s in range(S):
    n = cdiv(int(lens[s]), state.block_size)
    first = max(int(lens[s]) - window + 1, 0) // state.block_size
    assert (tables[s, :min(first, n)] == -1).all() and (tables[s, first:n] >= 0).all()
    assert (tables[s, n:] == -1).all()


@pytest.mark.parametrize("window,seed", [(1, 0), (5, 1), (9, 2), (16, 3)])
def test_random_ops_with_release_match_the_model(window, seed):
  rng = np.random.default_rng(seed)
  state, model = bm.init(CFG), BlockModel.from_config(CFG)
  released = 0
  for _ in range(60):
    op = rng.choice(["allocate", "append", "fork", "free"], p=[0.3, 0.4, 0.15, 0.15])
    if op == "allocate":
      slot, n = int(rng.integers(0, S)), int(rng.integers(1, 12))
      state, st = j_allocate(state, jnp.int32(slot), jnp.int32(n))
      assert int(st) == model.allocate([slot], [n])[0]
    elif op == "append":
      mask = rng.random(S) < 0.6
      counts = rng.integers(0, 7, size=S)
      state, st, cow = j_append(state, jnp.asarray(mask), jnp.asarray(counts, jnp.int32))
      want, want_cow = model.append(mask.tolist(), counts.tolist())
      np.testing.assert_array_equal(st, want)
      np.testing.assert_array_equal(cow, np.asarray(want_cow, np.int32))
    elif op == "fork":
      src, dst = (int(x) for x in rng.integers(0, S, size=2))
      state, st = j_fork(state, jnp.int32(src), jnp.int32(dst))
      assert int(st) == model.fork([src], [dst])[0]
    else:
      slot = int(rng.integers(0, S))
      state, st = j_free(state, jnp.int32(slot))
      assert int(st) == model.free([slot])[0]
    before = int(state.num_free)
    state = j_release(state, window)
    model.release_out_of_window(window)
    released += int(state.num_free) - before
    assert_matches_model(state, model)
    _check_window_invariants(state, window)
  assert released > 0   # the sequences did outgrow their windows


def test_shared_blocks_return_only_when_the_last_holder_lets_go():
  # Slot 0: 10 tokens (blocks 0, 1, 2); slot 1 forks it, then only slot 0 grows: it copies
  # the shared partial block 2 to 3 and adds 4, 5.
  state = bm.init(CFG)
  state, _ = j_allocate(state, jnp.int32(0), jnp.int32(10))
  state, _ = j_fork(state, jnp.int32(0), jnp.int32(1))
  state, st, _ = j_append(state, jnp.arange(S) == 0, 8)      # slot 0 -> 18 tokens
  assert (np.asarray(st) == OK).all()
  free0 = int(state.num_free)
  state = j_release(state, 5)   # slot 0 sees from 14: logical blocks 0-2 out; slot 1: 0 out
  np.testing.assert_array_equal(np.asarray(state.block_tables[0, :5]), [-1, -1, -1, 4, 5])
  np.testing.assert_array_equal(np.asarray(state.block_tables[1, :3]), [-1, 1, 2])
  assert int(state.num_free) == free0 + 2     # blocks 0 and 3; 1 and 2 slot 1 still holds
  np.testing.assert_array_equal(np.asarray(state.ref_count[:3]), [0, 1, 1])
  np.testing.assert_array_equal(np.asarray(block_window.held_blocks(state))[:2], [2, 2])


@pytest.mark.parametrize("window,bs,step", [(1, 4, 1), (7, 4, 3), (64, 16, 256), (4096, 16, 512)])
def test_a_sequence_never_holds_more_than_the_bound(window, bs, step):
  """Grow one sequence step by step (chunks of 1..step tokens): its holding right after a
  step's reservation (the peak, before the release) never passes sliding_blocks_per_seq,
  and the bound is reached (it is tight for some chunk sizes)."""
  bound = sliding_blocks_per_seq(window, bs, step)
  rng = np.random.default_rng(window)
  cfg = CacheConfig(block_size=bs, num_blocks=bound, max_seqs=1,
                    max_blocks_per_seq=cdiv(window + 40 * step, bs))
  state = bm.init(cfg)
  state, st = j_allocate(state, jnp.int32(0), jnp.int32(step))
  peak = int(block_window.held_blocks(state)[0])
  for _ in range(40):
    state = j_release(state, window)
    n = step if rng.random() < 0.5 else int(rng.integers(1, step + 1))
    state, st, _ = j_append(state, jnp.ones((1,), bool), jnp.asarray([n], jnp.int32))
    assert int(st[0]) == OK
    peak = max(peak, int(block_window.held_blocks(state)[0]))
  assert peak <= bound
  assert peak >= bound - 1


@pytest.mark.parametrize("window,bs,slots,budget,steps", [(6, 4, 4, 8, 1), (33, 8, 5, 24, 3)])
def test_the_pool_sized_by_sliding_pool_blocks_never_runs_short(window, bs, slots, budget,
                                                                steps):
  """Every slot grows; each step splits at most `budget` tokens among the slots (one gets
  a big chunk, others decode) plus `steps - 1` each: the pool never runs out, and the
  total held right after the reservations comes within a few blocks of the bound."""
  pool = sliding_pool_blocks(window, bs, slots, budget, steps)
  cfg = CacheConfig(block_size=bs, num_blocks=pool, max_seqs=slots, max_blocks_per_seq=200)
  rng = np.random.default_rng(slots)
  state = bm.init(cfg)
  state, st = j_allocate(state, jnp.arange(slots, dtype=jnp.int32), jnp.int32(1))
  peak = 0
  for _ in range(40):
    counts = np.ones(slots, np.int64)                 # budget tokens in all, then the
    counts[rng.integers(0, slots)] = budget - (slots - 1)   # decode loop's steps - 1 each
    counts += steps - 1
    state, st, _ = j_append(state, jnp.ones((slots,), bool), jnp.asarray(counts, jnp.int32))
    assert (np.asarray(st) == OK).all()
    peak = max(peak, pool - int(state.num_free))
    state = j_release(state, window)
  assert peak <= pool
  assert peak >= pool - slots - 2
