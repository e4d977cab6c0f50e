"""Prefix-cache eviction policies (`CacheConfig(eviction_policy=...)`).

Block level: the blocks `ensure_free` evicts, for every shipped policy, equal a plain-Python
model of the policy's order (its key written out again here, over the host copy of the
cache's arrays: sorted(), not the policy function); a fixed case shows protect_shallow
keeping a shared head LRU drops. Engine level: greedy outputs under each policy equal
caching off and the dense oracle while blocks are evicted and requests preempted.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from paged_jax import prefix_cache as pc
from paged_jax.config import CacheConfig
from paged_jax.eviction_policy import EVICTION_POLICIES
from prefix_cache_support import BS, NB, P, S, Driver, churn, j_ensure

import prefix_engine_support as pe

POLICIES = tuple(EVICTION_POLICIES)

# The plain-Python model: each policy's order as a Python sort key over one block's
# (last_used, depth, block id); smallest first.
MODEL_KEYS = {
    "lru": lambda lu, depth, blk: (lu, -depth),
    "protect_shallow": lambda lu, depth, blk: (-depth, lu),
}


def model_order(cache, blocks, policy):
  """Every evictable block (cached, held only by the cache), in the model's order, as
  (key, block) pairs."""
  cached, ref = np.asarray(cache.cached), np.asarray(blocks.ref_count)
  lu, depth = np.asarray(cache.last_used), np.asarray(cache.block_depth)
  key = MODEL_KEYS[policy]
  return sorted((key(int(lu[b]), int(depth[b]), b), b)
                for b in range(len(cached)) if cached[b] and ref[b] == 1)


def test_bad_policy_is_a_one_line_error_naming_the_argument():
  with pytest.raises(ValueError, match=r"^eviction_policy must be one of lru, protect_shallow, "
                                       r"got 'mru'$"):
    CacheConfig(eviction_policy="mru")
  with pytest.raises(ValueError, match="eviction_policy"):
    CacheConfig(eviction_policy=None)
  assert CacheConfig().eviction_policy == "lru"
  assert set(MODEL_KEYS) == set(POLICIES)     # every shipped policy has a model


@pytest.mark.parametrize("policy", POLICIES)
def test_a_shared_head_survives_only_where_the_policy_protects_it(policy):
  # X = head (2 blocks) + tail (2), released; then Y (4 other blocks), released: the pool
  # of 8 is all cache. Evicting 4: LRU takes all of X (oldest; deepest first), dropping
  # the head; protect_shallow takes depth 3 then depth 2 of both (older X first).
  cfg = CacheConfig(block_size=BS, num_blocks=8, max_seqs=S, max_blocks_per_seq=P,
                    eviction_policy=policy)
  d = Driver(cfg)
  head, x, y = list(range(1, 9)), list(range(9, 17)), list(range(20, 36))
  d.admit(0, head + x)
  d.free(0)
  d.admit(0, y)
  d.free(0)
  # Each cached block by (depth, its first token).
  ids = {(int(d.cache.block_depth[b]), int(d.cache.block_tokens[b, 0])): b for b in range(8)}
  xs = [ids[(j, (head + x)[j * BS])] for j in range(4)]
  ys = [ids[(j, y[j * BS])] for j in range(4)]
  assert int(d.blocks.num_free) == 0
  free0 = int(d.blocks.num_free)
  cache, blocks, n = j_ensure(d.cache, d.blocks, 4, max_evict=P)
  got = np.asarray(blocks.free_stack)[free0:int(blocks.num_free)].tolist()
  want = {"lru": xs[::-1], "protect_shallow": [xs[3], ys[3], xs[2], ys[2]]}[policy]
  assert got == want and int(n) == 4
  d.cache, d.blocks = cache, blocks
  assert d.lookup(head + [99])[0] == (0 if policy == "lru" else 2)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_evictions_follow_the_plain_python_model(policy, seed):
  # Shared prefixes, re-hits of released blocks, blocks held by live slots, slots freed
  # together; every eviction must take the model's first `short` blocks (equal up to ties
  # of the key) and only evictable ones.
  rng = np.random.default_rng(seed)
  cfg = CacheConfig(block_size=BS, num_blocks=NB, max_seqs=S, max_blocks_per_seq=P,
                    eviction_policy=policy)
  d = Driver(cfg)

  def make_room(need):
    c0, b0 = d.cache, d.blocks
    order = model_order(c0, b0, policy)
    short = min(need - int(b0.num_free), len(order))
    d.cache, d.blocks, n = j_ensure(c0, b0, need, max_evict=P)
    got = np.asarray(d.blocks.free_stack)[int(b0.num_free):int(d.blocks.num_free)].tolist()
    evictable = {b for _, b in order}
    assert int(n) == short and set(got) <= evictable and len(set(got)) == len(got)
    key = {b: k for k, b in order}
    assert [key[b] for b in got] == [k for k, _ in order[:short]]
    return len(got)

  evicted = churn(d, rng, make_room)
  assert evicted > 0


@pytest.mark.slow   # ~90 s per policy on a loaded 2-core machine
@pytest.mark.parametrize("policy", POLICIES)
def test_engine_outputs_equal_caching_off_and_the_oracle_while_evicting(policy):
  rng = np.random.default_rng(2)
  prompts = pe.shared_prefix_prompts(rng, 10, 24, max_suffix=16)
  prompts += [prompts[1], prompts[3] + [5, 6, 7, 8, 9]]
  off = pe.outputs(pe.make(False).generate(prompts, pe.greedy(10)))
  cc = pe.MC.cache_config(block_size=pe.BS, num_blocks=pe.NUM_BLOCKS, max_seqs=pe.MAX_SEQS,
                          max_blocks_per_seq=pe.ORACLE_LEN // pe.BS,
                          enable_prefix_caching=True, eviction_policy=policy)
  eng = pe.Engine(pe.MC, pe.PARAMS, cc, max_num_batched_tokens=pe.BUDGET,
                  attention_backend="reference")
  on = pe.outputs(eng.generate(prompts, pe.greedy(10)))
  assert on == off
  assert [o[0] for o in on[:3]] == [pe.dense_greedy(p, 10) for p in prompts[:3]]
  s = eng.prefix_stats()
  assert s["evictions"] > 0 and s["hit_blocks"] > 0
