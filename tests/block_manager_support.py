"""Helpers shared by the block manager tests: a small pool where shortages are common,
jitted ops, state snapshots, and checks against the plain-Python model
(`paged_jax.testing.BlockModel`) and the structural invariants."""

from typing import Callable, NamedTuple

import chex
import jax
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, cdiv
from paged_jax.testing import BlockModel

# 6 slots x 5 blocks could want 30 blocks; only 20 exist, so shortages are common.
CFG = CacheConfig(block_size=4, num_blocks=20, max_seqs=6, max_blocks_per_seq=5)
S, P, BS, NB, MAX_LEN = 6, 5, 4, 20, 20


class Ops(NamedTuple):
  """The pure block ops under one transform: `jax.jit`, or a `chex.variants` test's
  `self.variant` (jitted, or run eagerly op by op)."""
  allocate: Callable
  append: Callable
  free: Callable
  fork: Callable
  token_slots: Callable

  @classmethod
  def under(cls, transform: Callable) -> "Ops":
    return cls(allocate=transform(bm.allocate, static_argnames=("max_num_tokens",)),
               append=transform(bm.append, static_argnames=("max_new_tokens",)),
               free=transform(bm.free), fork=transform(bm.fork),
               token_slots=transform(bm.token_slots))


JIT = Ops.under(jax.jit)
j_allocate, j_append, j_free, j_fork, j_token_slots = JIT


def snapshot(state):
  """A host copy of `state` (same pytree, numpy leaves): it outlives a donated state."""
  return jax.tree_util.tree_map(np.array, state)


def assert_same_state(before, state) -> None:
  """Bit-identical to `before` (a `snapshot`): same structure, static fields, shapes,
  dtypes and values."""
  chex.assert_trees_all_equal(before, snapshot(state), strict=True)


def model_arrays(model: BlockModel) -> dict:
  """The model's state as the arrays `BlockState` holds (the free stack's live part)."""
  tables = np.full((model.max_seqs, model.max_blocks_per_seq), -1, np.int32)
  for s, row in enumerate(model.tables):
    tables[s, :len(row)] = row
  return dict(free_stack=np.asarray(model.stack, np.int32).reshape(-1),
              ref_count=np.asarray(model.ref, np.int32), block_tables=tables,
              seq_lens=np.asarray(model.lens, np.int32),
              active=np.asarray(model.active, np.bool_))


def assert_matches_model(state, model: BlockModel) -> None:
  """Exact block ids, ref counts, tables, lengths and the free stack's live part."""
  got = dict(free_stack=np.asarray(state.free_stack)[:int(state.num_free)],
             ref_count=state.ref_count, block_tables=state.block_tables,
             seq_lens=state.seq_lens, active=state.active)
  chex.assert_trees_all_equal(got, model_arrays(model), strict=True)


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
