"""The host tier of the prefix cache: K/V blocks the device cache evicted, kept in host
memory by chained hash, least recently used out first (`CacheConfig.num_host_blocks`).

This module is the host side only: the pool, its index and its LRU order, all plain
numpy and Python (the host owns this memory: it is the tier's one source of truth, not a
mirror of the device). The transfers to and from the device, and when they run, are in
`paged_jax.engine.tier`.

A block is found by its chained hash (`core.chain_hash`, which covers the salt's root
and every token before it) and checked against its depth and its own token ids, as the
device lookup checks them. The device also compares the parent's physical block and
generation, which a block that left the device no longer has: a host hit thus trusts the
64-bit chained hash for the prefix before the block (as vLLM's offloading does with its
block hashes); the "constant" test hash mode, where every block collides, is refused
(`Engine`).

Layout: per K/V field (`kv_cache.read_blocks`' fields), one array
[num_host_blocks, num_layers, num_kv_heads, block_size(, head_dim)]: a block is
contiguous, so storing or loading one is one copy. On CPU these are plain numpy arrays;
on a GPU or TPU the engine moves them with `jax.device_put` / `jax.device_get`.
"""

from __future__ import annotations

import collections
from typing import Dict, List, Sequence

import numpy as np

from paged_jax.prefix_cache.events import KVEvent


class HostTier:
  """`num_blocks` host blocks keyed by chained hash, LRU.

  Args:
    num_blocks: blocks of host memory (>= 1).
    block_size: tokens per block.
    fields: K/V field name -> (per-block shape [num_layers, num_kv_heads, block_size(,
      head_dim)], dtype), as `kv_cache.read_blocks` returns them (block axis dropped).

  Attributes:
    events: KV events (medium "host") not yet handed out (`take_events`).
  """

  def __init__(self, num_blocks: int, block_size: int, fields: Dict[str, tuple]):
    self.num_blocks, self.block_size = num_blocks, block_size
    self.pages = {f: np.zeros((num_blocks,) + tuple(shape), dtype)
                  for f, (shape, dtype) in fields.items()}
    self.depth = np.full((num_blocks,), -1, np.int32)
    self.tokens = np.zeros((num_blocks, block_size), np.int32)
    self.parent = [0] * num_blocks        # each entry's parent hash (for its events)
    self._lru: "collections.OrderedDict[int, int]" = collections.OrderedDict()  # hash -> entry
    self._free = list(range(num_blocks - 1, -1, -1))                            # a stack
    self.events: List[KVEvent] = []

  # ---- counts --------------------------------------------------------------------------
  @property
  def num_free(self) -> int:
    return len(self._free)

  def hashes(self) -> Dict[int, int]:
    """{hash: parent hash} of every held block (for tests and a full resync)."""
    return {h: self.parent[e] for h, e in self._lru.items()}

  # ---- lookup --------------------------------------------------------------------------
  def find(self, block_hash: int, depth: int, tokens: np.ndarray) -> int:
    """The entry holding this block (hash, depth and token ids equal), or -1."""
    e = self._lru.get(block_hash, -1)
    if e < 0 or self.depth[e] != depth or not np.array_equal(self.tokens[e], tokens):
      return -1
    return e

  def gather(self, entries: Sequence[int], size: int) -> Dict[str, np.ndarray]:
    """The K/V of `entries` in `kv_cache.write_blocks`' form: field -> [num_layers,
    num_kv_heads, size, block_size(, head_dim)], entry i at index i, zeros after."""
    out = {}
    for f, pool in self.pages.items():
      buf = np.zeros((size,) + pool.shape[1:], pool.dtype)
      buf[:len(entries)] = pool[np.asarray(entries, np.int64)]
      out[f] = np.moveaxis(buf, 0, 2)
    return out

  def touch(self, entries: Sequence[int]) -> None:
    """Marks entries used now (a hit brought them back to the device)."""
    by_entry = {e: h for h, e in self._lru.items()} if entries else {}
    for e in entries:
      self._lru.move_to_end(by_entry[e])

  # ---- store ---------------------------------------------------------------------------
  def store(self, meta: Dict[str, np.ndarray], pages: Dict[str, np.ndarray]) -> None:
    """Keeps the blocks the device evicted, in eviction order.

    Args:
      meta: "hash", "parent" (ints, [n]), "depth" i32[n], "tokens" i32[n, block_size].
      pages: field -> [num_layers, num_kv_heads, >= n, block_size(, head_dim)]
        (`kv_cache.read_blocks`' form; block i at index i).
    A block already held is only marked used. When the pool is full the least recently
    used block leaves (a "removed" event), then the new one is stored ("stored").
    """
    for i, h in enumerate(meta["hash"]):
      h = int(h)
      if h in self._lru:
        self._lru.move_to_end(h)
        continue
      if not self._free:
        old, e = self._lru.popitem(last=False)
        self._free.append(e)
        self.events.append(KVEvent("removed", (old,), "host"))
      e = self._free[-1]
      for f, pool in self.pages.items():
        pool[e] = pages[f][:, :, i]
      self.depth[e], self.tokens[e] = meta["depth"][i], meta["tokens"][i]
      self.parent[e] = int(meta["parent"][i])
      self._free.pop()
      self._lru[h] = e
      self.events.append(KVEvent("stored", (h,), "host", self.parent[e]))

  def clear(self) -> None:
    """Drops every block (one "cleared" event when any was held)."""
    if self._lru:
      self.events.append(KVEvent("cleared", (), "host"))
    self._lru.clear()
    self._free = list(range(self.num_blocks - 1, -1, -1))
    self.depth[:] = -1

  def take_events(self) -> List[KVEvent]:
    out, self.events = self.events, []
    return out
