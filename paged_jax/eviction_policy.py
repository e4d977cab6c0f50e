"""Prefix-cache eviction policies: which cache-only block goes first, as a sort key.

A policy is a pure function `key(cache) -> tuple of i32[NB]` over a `PrefixCacheState`'s
arrays (`cache.last_used`, `cache.block_depth`, `cache.block_parent`, `cache.clock`, ...):
keys compared lexicographically, the smallest evicted first. Only evictable blocks
(cached, held by no sequence) are ranked; the caller masks the rest. The policy is
chosen by name in `CacheConfig(eviction_policy=...)`, statically (it is traced into the
jitted engine step), so adding one is one function and one entry in `EVICTION_POLICIES`:

    def newest_first(cache):
      return (-cache.last_used,)
    EVICTION_POLICIES["newest_first"] = newest_first
    CacheConfig(..., eviction_policy="newest_first")

Shipped:
  lru              least recently used first; among blocks last used at the same time, the
                   deepest (a sequence's tail) first. The default, and the only policy with
                   the amortized O(1) ring (`prefix_cache.evict`); any other policy ranks
                   the pool (one O(NB log NB) sort per step that evicts). Measured on
                   this 2-core CPU (XLA:CPU, 16 blocks evicted from an all-cached
                   pool): 16K blocks 0.5 ms LRU vs 9-10 ms sorted; 256K blocks
                   5-7 ms vs ~250 ms.
  protect_shallow  deepest block first, LRU among equal depths: a chain loses its tail
                   before its head, so a shared system-prompt head (depth 0, 1, ...) is the
                   last to go.

This module imports no other part of paged_jax (config validates names against it).
docs/extending.md walks through adding a policy.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

KeyFn = Callable[[Any], Tuple[Any, ...]]


def lru(cache):
  """Oldest `last_used` first, deepest first among ties."""
  return (cache.last_used, -cache.block_depth)


def protect_shallow(cache):
  """Deepest first, oldest `last_used` first among equal depths."""
  return (-cache.block_depth, cache.last_used)


EVICTION_POLICIES: Dict[str, KeyFn] = {"lru": lru, "protect_shallow": protect_shallow}


def check(name) -> str:
  """`name` if it names a policy; a one-line ValueError otherwise."""
  if not isinstance(name, str) or name not in EVICTION_POLICIES:
    raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                     f"got {name!r}")
  return name
