"""Swap of a group whose sequences share blocks (`engine/swap.py`): the host copy holds
each shared block once, and the swap-in restores the same sharing over fresh blocks,
checked against the plain-Python allocator (`paged_jax.testing.BlockModel.restore`),
the allocator's invariants and the page contents (int8 scales in either layout: blocks,
or the TPU kernels' scale rows); a swap-in that cannot fit or names a bad slot changes
nothing."""

import jax
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax.config import INVALID, OK, OUT_OF_BLOCKS, CacheConfig, cdiv
from paged_jax.engine import swap
from paged_jax.engine.step import init_state
from paged_jax.kv_cache import KVPages
from paged_jax.testing import BlockModel

from block_manager_support import assert_matches_model, check_invariants

BS = 4


def config(dtype="float32", num_blocks=40):
  return CacheConfig(block_size=BS, num_blocks=num_blocks, max_seqs=10, max_blocks_per_seq=6,
                     num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)


def random_pages(cfg, rng, rows=False) -> KVPages:
  """Every block's pages distinct, so a mix-up of blocks shows. `rows`: int8 scales held
  as scale rows [L, Hkv, ceil(NB * BS / 128), 128] (padding zero)."""
  shape = (cfg.num_layers, cfg.num_kv_heads, cfg.num_blocks, BS, cfg.head_dim)
  if cfg.dtype == "int8":
    q = lambda: rng.integers(-127, 128, shape).astype(np.int8)
    s = lambda: as_rows(rng.random(shape[:-1]).astype(np.float32)) if rows else (
        rng.random(shape[:-1]).astype(np.float32))
    return KVPages.from_stacked(q(), q(), s(), s())
  return KVPages.from_stacked(rng.standard_normal(shape).astype(np.float32),
                              rng.standard_normal(shape).astype(np.float32))


def both(state, model, op, *args):
  """Applies a block op to the JAX state and the model alike; both must say OK."""
  blocks, status = getattr(bm, op)(state.blocks, *[np.asarray(a) for a in args])[:2]
  assert (np.asarray(status) == OK).all()
  expect = getattr(model, op)(*args)
  assert (expect[0] if op == "append" else expect) == list(np.asarray(status).reshape(-1))
  return state.with_full(blocks=blocks)


def as_rows(s):
  """[L, Hkv, NB, BS] -> [L, Hkv, R, 128] (numpy, by hand)."""
  flat = s.reshape(s.shape[:2] + (-1,))
  out = np.zeros(s.shape[:2] + (-(-flat.shape[2] // 128) * 128,), np.float32)
  out[..., :flat.shape[2]] = flat
  return out.reshape(s.shape[:2] + (-1, 128))


def forked_group(cfg, seed, rows=False):
  """A pool with an unrelated sequence and a group forked from one prompt (slot 1)
  into slots 2..4, a beam-like fork of a fork (slot 5 from 3), every member then
  appending its own tokens (copy-on-write of a shared partial last block).
  Returns (state, model, group slots, their token counts)."""
  rng = np.random.default_rng(seed)
  state = init_state(cfg, scale_rows=rows)
  pages = random_pages(cfg, rng, rows)
  assert pages.scale_rows == rows and (jax.tree_util.tree_structure(pages)
                                       == jax.tree_util.tree_structure(state.pages))
  state = state.with_full(pages=pages)
  model = BlockModel.from_config(cfg)
  prompt = int(rng.integers(5, 11))
  state = both(state, model, "allocate", [0, 1], [7, prompt])
  state = both(state, model, "fork", [1, 1, 1], [2, 3, 4])
  grow = np.zeros(cfg.max_seqs, np.int32)
  grow[[1, 2, 3, 4]] = rng.integers(0, 5, 4)
  state = both(state, model, "append", grow > 0, grow)
  state = both(state, model, "fork", [3], [5])
  grow = np.zeros(cfg.max_seqs, np.int32)
  grow[[3, 5]] = rng.integers(1, 4, 2)
  state = both(state, model, "append", grow > 0, grow)
  slots = [1, 2, 3, 4, 5]
  return state, model, slots, [model.lens[s] for s in slots]


def pages_of(state):
  """Every field as numpy [L, Hkv, NB, BS(, D)], read from the arrays themselves (scale
  rows by hand: their padding must stay zero)."""
  pages, nb = state.pages, state.blocks.num_blocks
  out = {f: np.asarray(getattr(pages, f)) for f in ("k", "v", "k_scale", "v_scale")
         if getattr(pages, f) is not None}
  for f in ("k_scale", "v_scale") if pages.scale_rows else ():
    flat = out[f].reshape(out[f].shape[:2] + (-1,))
    assert not flat[..., nb * BS:].any()
    out[f] = flat[..., :nb * BS].reshape(flat.shape[:2] + (nb, BS))
  return out


@pytest.mark.parametrize("dtype,rows", [("float32", False), ("int8", False), ("int8", True)],
                         ids=["float32", "int8", "int8_scale_rows"])
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))])
def test_group_swap_keeps_sharing_blocks_and_pages(seed, dtype, rows):
  cfg = config(dtype)
  state, model, slots, lens = forked_group(cfg, seed, rows)
  old_tables = np.asarray(state.blocks.block_tables)[slots]
  old_pages = pages_of(state)
  distinct = {int(b) for row, n in zip(old_tables, lens) for b in row[:cdiv(n, BS)]}

  saved = swap.swap_out(state, slots, lens)
  assert saved.num_blocks == len(distinct)          # each shared block copied once
  assert saved.num_blocks < sum(cdiv(n, BS) for n in lens)

  state = both(state, model, "free", slots)
  new_slots = [9, 6, 2, 8, 1]                       # anywhere free, any order
  state, status = swap.swap_in(state, new_slots, saved)
  assert int(status) == OK
  assert model.restore(new_slots, saved.tables, lens, saved.num_blocks) == OK
  assert_matches_model(state.blocks, model)         # exact ids, ref counts, free stack
  check_invariants(state.blocks)

  new_tables = np.asarray(state.blocks.block_tables)[new_slots]
  new_pages = pages_of(state)
  cells = [(i, c) for i, n in enumerate(lens) for c in range(cdiv(n, BS))]
  for i, c in cells:   # the same pages, and shared exactly where they were
    for f in old_pages:
      np.testing.assert_array_equal(new_pages[f][:, :, new_tables[i, c]],
                                    old_pages[f][:, :, old_tables[i, c]])
    for j, d in cells:
      assert (new_tables[i, c] == new_tables[j, d]) == (old_tables[i, c] == old_tables[j, d])


def test_single_sequence_swap_pops_as_allocate_does():
  cfg = config()
  state, model, _, _ = forked_group(cfg, 0)
  saved = swap.swap_out(state, 0, 7)                # the unrelated 7-token sequence
  assert saved.num_blocks == 2 and saved.tables[0, :3].tolist() == [0, 1, -1]
  state = both(state, model, "free", [0])
  state, status = swap.swap_in(state, 7, saved)
  assert int(status) == OK and model.allocate([7], [7]) == [OK]
  assert_matches_model(state.blocks, model)


@pytest.mark.parametrize("case", ["out_of_blocks", "active_slot", "repeated_slot"])
def test_failed_swap_in_changes_nothing(case):
  cfg = config(num_blocks=16)
  state, model, slots, lens = forked_group(cfg, 1)
  saved = swap.swap_out(state, slots, lens)
  state = both(state, model, "free", slots)
  new_slots, expect = [9, 6, 2, 8, 7], OUT_OF_BLOCKS
  if case == "out_of_blocks":   # new sequences leave one block too few
    take = int(state.blocks.num_free) - saved.num_blocks + 1
    for slot in (3, 4, 5):
      n = min(take, cfg.max_blocks_per_seq)
      if n:
        state = both(state, model, "allocate", [slot], [n * BS])
      take -= n
    assert int(state.blocks.num_free) == saved.num_blocks - 1
  elif case == "active_slot":
    new_slots, expect = [9, 6, 0, 8, 7], INVALID    # slot 0 is held
  else:
    new_slots, expect = [9, 6, 9, 8, 7], INVALID
  before = jax.tree_util.tree_leaves(jax.device_get(state.blocks))
  state, status = swap.swap_in(state, new_slots, saved)
  assert int(status) == expect
  assert model.restore(new_slots, saved.tables, lens, saved.num_blocks) == expect
  for a, b in zip(before, jax.tree_util.tree_leaves(state.blocks)):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert_matches_model(state.blocks, model)


def test_swap_out_rejects_a_slot_that_does_not_hold_its_tokens():
  cfg = config()
  state, _, slots, lens = forked_group(cfg, 2)
  with pytest.raises(RuntimeError, match="slot 7 does not hold 3 tokens"):
    swap.swap_out(state, [1, 7], [lens[0], 3])
  with pytest.raises(ValueError, match="equally long"):
    swap.swap_out(state, [1, 2], [lens[0]])
