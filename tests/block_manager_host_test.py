"""The host-side `BlockManager` wrapper: errors, all-or-nothing batches, and agreement
with the plain-Python model."""

from absl.testing import absltest
import chex
import numpy as np

from paged_jax.block_manager_host import BlockManager
from paged_jax.config import CacheConfig, OutOfBlocksError
from paged_jax.testing import BlockModel

from block_manager_support import (CFG, MAX_LEN, S, assert_matches_model, assert_same_state,
                                   snapshot)


class HostManagerTest(chex.TestCase):

  def _mgr(self):
    mgr = BlockManager(CFG)
    mgr.allocate(0, 6)
    return mgr

  def test_errors_name_argument_and_range(self):
    mgr = self._mgr()
    cases = [
        (lambda: mgr.allocate(S, 3), ValueError, r"slot must be in \[0, 5\], got 6"),
        (lambda: mgr.allocate(-1, 3), ValueError, r"slot must be in \[0, 5\]"),
        (lambda: mgr.allocate(1, 0), ValueError, r"num_tokens must be in \[1, 20\], got 0"),
        (lambda: mgr.allocate(1, MAX_LEN + 1), ValueError, r"num_tokens must be in \[1, 20\]"),
        (lambda: mgr.allocate([1, 2], [3, -4]), ValueError, r"num_tokens\[1\] must be in"),
        (lambda: mgr.allocate(0, 3), ValueError, r"slot=0 is already active"),
        (lambda: mgr.allocate([1, 1], 3), ValueError, r"slot\[1\]=1 repeats"),
        (lambda: mgr.allocate(1.0, 3), TypeError, r"slot must be an int"),
        (lambda: mgr.append(1), ValueError, r"slot=1 is not active"),
        (lambda: mgr.append(0, 0), ValueError, r"num_new_tokens must be in \[1, 14\], got 0"),
        (lambda: mgr.append(0, 15), ValueError, r"num_new_tokens must be in \[1, 14\]"),
        (lambda: mgr.free(3), ValueError, r"slot=3 is not active"),
        (lambda: mgr.fork(0, 0), ValueError, r"dst_slot=0 is already active"),
        (lambda: mgr.fork(2, 1), ValueError, r"src_slot=2 is not active"),
        (lambda: mgr.fork(0, 9), ValueError, r"dst_slot must be in \[0, 5\]"),
        (lambda: BlockManager("cfg"), TypeError, r"cache_config"),
        (lambda: CacheConfig(block_size=12), ValueError, r"block_size must be a power of two"),
    ]
    before = snapshot(mgr.state)
    for i, (call, err, pattern) in enumerate(cases):
      with self.assertRaisesRegex(err, pattern, msg=f"case {i}"):
        call()
      assert_same_state(before, mgr.state)

  def test_out_of_blocks_error_leaves_state(self):
    mgr = self._mgr()   # 2 blocks used
    mgr.allocate([1, 2, 3], [MAX_LEN, MAX_LEN, MAX_LEN])  # 15 more: 3 free
    mgr.fork(0, 4)
    before = snapshot(mgr.state)
    with self.assertRaisesRegex(OutOfBlocksError, "needs 4 blocks, only 3 free"):
      mgr.allocate(5, 13)
    assert_same_state(before, mgr.state)
    mgr.allocate(5, 12)
    before = snapshot(mgr.state)
    with self.assertRaisesRegex(OutOfBlocksError, r"slots \[0, 4\]"):
      mgr.append([0, 4], 1)  # slot 0 must copy the shared block; none free
    assert_same_state(before, mgr.state)

  def test_host_round_trip_matches_model(self):
    mgr, model = BlockManager(CFG), BlockModel.from_config(CFG)
    mgr.allocate([0, 1], [6, 9]); model.allocate([0, 1], [6, 9])
    mgr.fork(0, [2, 3]); model.fork([0, 0], [2, 3])
    cow = mgr.append([0, 2, 3], [1, 4, 2])
    _, cow_expected = model.append([s in (0, 2, 3) for s in range(S)], [1, 0, 4, 2, 0, 0])
    np.testing.assert_array_equal(cow, [c for c in cow_expected if c[0] >= 0])
    self.assertLen(cow, 2)
    mgr.free([0, 1]); model.free([0, 1])
    assert_matches_model(mgr.state, model)
    self.assertEqual(mgr.block_table(2), model.tables[2])
    self.assertEqual(mgr.seq_len(3), 8)
    np.testing.assert_array_equal(mgr.token_slots([2, 3, -1], [0, 7, 0]),
                                  model.token_slots([2, 3, -1], [0, 7, 0]))

  def test_state_is_donated_except_by_append(self):
    mgr = self._mgr()
    old = mgr.state.ref_count
    mgr.allocate(1, 3)
    self.assertTrue(old.is_deleted())
    old = mgr.state.ref_count
    mgr.append(0, 1)   # runs undonated so a short pool can leave the state as it was
    self.assertFalse(old.is_deleted())


if __name__ == "__main__":
  absltest.main()


if __name__ == "__main__":
  absltest.main()
