"""Automatic prefix caching: chained block hashes, exact lookup, eviction by policy
(LRU by default; `paged_jax.eviction_policy`).

Pure, jittable ops over `block_manager.BlockState`; the engine runs them inside
its one jitted step. Modules (imports run one way: step -> evict, core -> state):

  state  PrefixCacheState, init, the chex shape / dtype checks every op runs first, counters
  core   hashing, lookup / attach, register, fork_chain
  evict  release, free, uncache, ensure_free, reset: the LRU ring, `policy_victims`
         for other policies (and the O(num_blocks) reference order `lru_victims`)
  salt   salt_key: a request's cache salt as the root of its hash chain
  step   the engine-step pieces: free, attach, evict_for, after (PrefixStepState)
  events KV cache events (stored / removed / cleared, per medium) from the cache's log
  host_tier  the host-memory tier under the cache (numpy; its transfers: engine.tier)

    from paged_jax import prefix_cache as pc
    cache = pc.init(cache_config)
    cache, blocks, hit_tokens, status = pc.attach(cache, blocks, slot, tokens, length)
"""

from paged_jax.prefix_cache.core import attach, chain_hash, fork_chain, lookup, register
from paged_jax.prefix_cache.evict import (ensure_free, free, lru_victims, pick_victims,
                                          policy_victims, release, reset, touch, uncache)
from paged_jax.prefix_cache.state import (HASH_MODES, ROOT_HASH, PrefixCacheState,
                                          check_states, hit_rate, init, num_cached_blocks,
                                          num_evictable)
from paged_jax.prefix_cache.salt import salt_key

__all__ = ["HASH_MODES", "ROOT_HASH", "PrefixCacheState", "attach", "chain_hash",
           "check_states", "ensure_free", "fork_chain", "free", "hit_rate", "init", "lookup",
           "lru_victims", "num_cached_blocks", "num_evictable", "pick_victims",
           "policy_victims", "register", "release", "reset", "salt_key", "touch", "uncache"]
