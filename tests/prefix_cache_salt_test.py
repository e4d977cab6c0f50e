"""Cache salts (`SamplingParams(cache_salt=...)`) at the block level: requests of different
salts never share a cached block, even when every hash collides (the Driver of
tests/prefix_cache_support.py runs whole requests through the pure ops)."""

import jax
import numpy as np
import pytest

from paged_jax import prefix_cache as pc
from prefix_cache_support import Driver


@pytest.mark.parametrize("mode", pc.HASH_MODES)
def test_cache_salts_never_share_blocks_even_when_every_hash_collides(mode):
  d = Driver(hash_mode=mode, max_probe=64)
  a = [int(t) for t in np.random.default_rng(7).integers(0, 50, 17)]   # 4 full blocks + 1
  assert d.admit(0, a, salt="tenant-a") == 0
  # Same tokens: another salt and the unsalted namespace miss from the first block
  # (in "constant" mode every hash is equal: only the exact salt tag keeps them apart).
  assert d.lookup(a, salt="tenant-b")[0] == 0 and d.lookup(a)[0] == 0
  assert d.lookup(a, salt="tenant-a")[0] == 4
  assert d.admit(1, a, salt="tenant-b") == 0          # registers its own copy
  assert d.admit(2, a, salt="tenant-a") == 16 and d.admit(3, a, salt="tenant-b") == 16
  c = jax.device_get(d.cache)
  depth0 = np.asarray(c.cached) & (np.asarray(c.block_depth) == 0)
  assert depth0.sum() == 2                            # one first block per salt
  assert d.lookup(a)[0] == 0
  d.check_invariants()
  assert pc.salt_key("tenant-a") != pc.salt_key("tenant-b") and pc.salt_key(None)[1] == 0
