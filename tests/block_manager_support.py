"""Helpers shared by the block manager tests: a small pool where shortages are common,
jitted ops, state snapshots, and checks against the plain-Python model
(`paged_jax.testing.BlockModel`) and the structural invariants."""

import jax
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, cdiv
from paged_jax.testing import BlockModel

# 6 slots x 5 blocks could want 30 blocks; only 20 exist, so shortages are common.
CFG = CacheConfig(block_size=4, num_blocks=20, max_seqs=6, max_blocks_per_seq=5)
S, P, BS, NB, MAX_LEN = 6, 5, 4, 20, 20

j_allocate = jax.jit(bm.allocate, static_argnames=("max_num_tokens",))
j_append = jax.jit(bm.append, static_argnames=("max_new_tokens",))
j_free = jax.jit(bm.free)
j_fork = jax.jit(bm.fork)
j_token_slots = jax.jit(bm.token_slots)


def snapshot(state) -> list:
  return [np.array(x) for x in jax.tree_util.tree_leaves(state)]


def assert_same_state(before: list, state) -> None:
  after = snapshot(state)
  assert len(before) == len(after)
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)
    assert a.dtype == b.dtype


def assert_matches_model(state, model: BlockModel) -> None:
  num_free = int(state.num_free)
  assert num_free == len(model.stack)
  np.testing.assert_array_equal(np.asarray(state.free_stack)[:num_free], model.stack)
  np.testing.assert_array_equal(np.asarray(state.ref_count), model.ref)
  tables = np.full((model.max_seqs, model.max_blocks_per_seq), -1, np.int32)
  for s, row in enumerate(model.tables):
    tables[s, :len(row)] = row
  np.testing.assert_array_equal(np.asarray(state.block_tables), tables)
  np.testing.assert_array_equal(np.asarray(state.seq_lens), model.lens)
  np.testing.assert_array_equal(np.asarray(state.active), model.active)


def check_invariants(state) -> None:
  """Structural invariants, from the JAX state alone."""
  ref = np.asarray(state.ref_count)
  tables = np.asarray(state.block_tables)
  lens = np.asarray(state.seq_lens)
  active = np.asarray(state.active)
  num_free = int(state.num_free)
  nb, bs = ref.shape[0], state.block_size
  free = np.asarray(state.free_stack)[:num_free]
  assert 0 <= num_free <= nb
  assert len(set(free.tolist())) == num_free, "a block is on the free stack twice"
  held = tables[tables >= 0]
  np.testing.assert_array_equal(np.bincount(held, minlength=nb), ref,
                                "ref_count != table entries pointing at the block")
  assert set(free.tolist()) == set(np.nonzero(ref == 0)[0].tolist()), \
      "free stack != unreferenced blocks (a block is both free and referenced, or leaked)"
  column_of = {}
  for s in range(tables.shape[0]):
    n = cdiv(int(lens[s]), bs)
    assert active[s] or lens[s] == 0
    assert (tables[s, :n] >= 0).all() and (tables[s, n:] == -1).all()
    assert len(set(tables[s, :n].tolist())) == n, "a slot holds one block twice"
    for c, b in enumerate(tables[s, :n].tolist()):  # sharers agree on the logical index
      assert column_of.setdefault(b, c) == c
