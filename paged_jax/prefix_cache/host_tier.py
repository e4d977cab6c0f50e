"""The host tier of the prefix cache: K/V blocks the device cache evicted, kept in host
memory by chained hash, least recently used out first (`CacheConfig.num_host_blocks`).

This module is the host side: the pool, its index and its LRU order, and the two jitted
copies of a pool in pinned host memory (the host owns this memory: it is the tier's one
source of truth, not a mirror of the device). When the transfers run is
`paged_jax.engine.tier`'s.

A block is found by its chained hash (`core.chain_hash`, which covers the salt's root
and every token before it) and checked against its depth and its own token ids, as the
device lookup checks them. The device also compares the parent's physical block and
generation, which a block that left the device no longer has: a host hit thus trusts the
64-bit chained hash for the prefix before the block (as vLLM's offloading does with its
block hashes); the "constant" test hash mode, where every block collides, is refused
(`Engine`).

Where the pool lives (`host_memory_kind`, chosen once from the device the KV pages are on):

  - a GPU or TPU (a device with a `pinned_host` memory apart from its own): each K/V field
    is one jax array [num_host_blocks, R, 128] in pinned host memory, a block flattened
    and zero-padded to R = ceil(block elements / 128) rows of 128, so one block is a
    slice of the untiled leading axis (a TPU v6e compile refused the block's own layout
    [.., block_size, head_dim 64]: "Lane slice updating is not supported in async dynamic
    update slice", and a flat [num_host_blocks, elements] bf16 pool: "Sublane slicing
    size must be multiple of element packing factor"). The copies run inside jit:
    `_fetch` reads a step's promoted blocks out of host memory into one device buffer
    (host -> device), `_stash` writes the evicted blocks from the device into their host
    entries (device -> host, the pool donated); each is one call for all of a step's
    blocks and fields, a loop of one-block dynamic slices that XLA compiles to
    host-memory copies (tests/host_tier_transfer_test.py compiles both for an H200 and a
    TPU v6e). No device buffer holds more than the step's blocks.
  - a CPU, or pages over several devices: plain numpy arrays [num_host_blocks,
    num_layers, num_kv_heads, block_size(, head_dim)] (a block contiguous, storing or
    loading one is one copy), moved by `engine.tier`'s `jax.device_put` / `jax.device_get`.
    A CPU lists a `pinned_host` memory too (jax 0.10 / 0.11), but its device memory is
    host memory already: staging there would only add a copy.

The index (hashes, depths, token ids, LRU order) is numpy and Python on both paths.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Dict, List, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from paged_jax.checks import consumed
from paged_jax.prefix_cache.events import KVEvent
from pallas_kernels.common import next_pow2


LANES = 128


def host_memory_kind(device) -> Optional[str]:
  """The memory the host pool is staged in for KV pages on `device` (None: pages over
  several devices): "pinned_host" where the device has it apart from its own memory (a GPU
  or TPU), else None, and the pool is plain numpy (a CPU, whose device memory is host
  memory already)."""
  if device is None or device.platform == "cpu":
    return None
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # pylint: disable=broad-except  (a backend without memory spaces)
    return None
  return "pinned_host" if "pinned_host" in kinds else None


def block_rows(shape: Sequence[int]) -> int:
  """Rows of LANES a block of `shape` takes in a pinned host pool."""
  return -(-math.prod(shape) // LANES)


def _unflat(x, shape):
  """[n, R, LANES] -> [n, *shape] (the padding dropped)."""
  n = x.shape[0]
  return x.reshape(n, -1)[:, :math.prod(shape)].reshape((n,) + tuple(shape))


def _flat(block, rows: int):
  """A block [*shape] -> [1, rows, LANES], zero-padded."""
  flat = block.reshape(1, -1)
  return jnp.pad(flat, ((0, 0), (0, rows * LANES - flat.shape[1]))).reshape(1, rows, LANES)


@functools.partial(jax.jit, static_argnames=("shapes",))
def _fetch(pools, entries, *, shapes):
  """Host -> device, one call: pools field -> [num_host_blocks, R, LANES] (pinned host
  memory), entries i32[n], shapes ((field, block shape), ...). Returns field ->
  [num_layers, Hkv, n, bs(, D)] on the device (`kv_cache.write_blocks`' form)."""
  def body(i, bufs):
    return {f: lax.dynamic_update_slice_in_dim(b, jax.device_put(
        lax.dynamic_slice_in_dim(pools[f], entries[i], 1, 0), jax.memory.Space.Device),
                                               i, 0) for f, b in bufs.items()}
  n = entries.shape[0]
  bufs = lax.fori_loop(0, n, body, {f: jnp.zeros((n,) + p.shape[1:], p.dtype)
                                    for f, p in pools.items()})
  return {f: jnp.moveaxis(_unflat(bufs[f], shape), 0, 2) for f, shape in shapes}


@functools.partial(jax.jit, donate_argnums=(0,))
def _stash(pools, entries, index, blocks):
  """Device -> host, one call: block index[i] of blocks (field -> [num_layers, Hkv, m,
  bs(, D)] on the device) into entry entries[i] of pools (field -> [num_host_blocks, R,
  LANES], pinned host memory, donated), i in order. Returns the pools."""
  def body(i, pools):
    return {f: lax.dynamic_update_slice_in_dim(p, jax.device_put(_flat(
        lax.dynamic_index_in_dim(blocks[f], index[i], 2, keepdims=False), p.shape[1]),
        jax.memory.Space.Host), entries[i], 0) for f, p in pools.items()}
  return lax.fori_loop(0, entries.shape[0], body, pools)


class HostTier:
  """`num_blocks` host blocks keyed by chained hash, LRU.

  Args:
    num_blocks: blocks of host memory (>= 1).
    block_size: tokens per block.
    fields: K/V field name -> (per-block shape [num_layers, num_kv_heads, block_size(,
      head_dim)], dtype), as `kv_cache.read_blocks` returns them (block axis dropped).
    device: the device the KV pages are on (None: several, or unknown): the pool is
      staged in its `host_memory_kind`, else numpy.

  Attributes:
    memory_kind: "pinned_host" (pages are jax arrays there) or None (numpy).
    events: KV events (medium "host") not yet handed out (`take_events`).
  """

  def __init__(self, num_blocks: int, block_size: int, fields: Dict[str, tuple],
               device=None):
    self.num_blocks, self.block_size = num_blocks, block_size
    self.memory_kind = host_memory_kind(device)
    self._shapes = tuple((f, tuple(shape)) for f, (shape, _) in fields.items())
    self._fields, self._device = fields, device
    self.pages = self._new_pool()
    self.depth = np.full((num_blocks,), -1, np.int32)
    self.tokens = np.zeros((num_blocks, block_size), np.int32)
    self.parent = [0] * num_blocks        # each entry's parent hash (for its events)
    self._lru: "collections.OrderedDict[int, int]" = collections.OrderedDict()  # hash -> entry
    self._free = list(range(num_blocks - 1, -1, -1))                            # a stack
    self.events: List[KVEvent] = []

  def _new_pool(self) -> dict:
    """An empty pool: field -> numpy [num_blocks, *block shape], or (pinned) a jax array
    [num_blocks, R, LANES] in the device's pinned host memory."""
    if self.memory_kind is None:
      return {f: np.zeros((self.num_blocks,) + tuple(shape), dtype)
              for f, (shape, dtype) in self._fields.items()}
    where = NamedSharding(Mesh(np.array([self._device]), ("x",)), PartitionSpec(),
                          memory_kind=self.memory_kind)
    return {f: jax.device_put(np.zeros((self.num_blocks, block_rows(shape), LANES), dtype),
                              where) for f, (shape, dtype) in self._fields.items()}

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
    num_kv_heads, size, block_size(, head_dim)], entry i at index i, zeros after (numpy;
    in pinned host memory: on the device already, one `_fetch`, filler after)."""
    if self.memory_kind is not None:
      idx = np.zeros((size,), np.int32)
      idx[:len(entries)] = entries
      return _fetch(self.pages, idx, shapes=self._shapes)
    out = {}
    for f, pool in self.pages.items():
      buf = np.zeros((size,) + pool.shape[1:], pool.dtype)
      buf[:len(entries)] = pool[np.asarray(entries, np.int64)]
      out[f] = np.moveaxis(buf, 0, 2)
    return out

  def touch(self, entries: Sequence[int]) -> None:
    """Marks entries used now (a hit brought them back to the device); an entry no longer
    held (a failed store dropped it) is skipped."""
    by_entry = {e: h for h, e in self._lru.items()} if entries else {}
    for e in entries:
      if e in by_entry:
        self._lru.move_to_end(by_entry[e])

  # ---- store ---------------------------------------------------------------------------
  def store(self, meta: Dict[str, np.ndarray], pages: Dict[str, np.ndarray],
            index: Optional[Sequence[int]] = None) -> None:
    """Keeps the blocks the device evicted, in eviction order.

    Args:
      meta: "hash", "parent" (ints, [n]), "depth" i32[n], "tokens" i32[n, block_size].
      pages: field -> [num_layers, num_kv_heads, m, block_size(, head_dim)]
        (`kv_cache.read_blocks`' form): numpy, or device arrays with a pinned pool.
      index: i32[n], the pages' index of block i (None: i).
    A block already held is only marked used. When the pool is full the least recently
    used block leaves (a "removed" event), then the new one is stored ("stored"). The
    K/V are written last, in one copy; if that raises, the blocks stored now leave again
    (their "removed" events), so the index never names a block it does not hold. If the
    failed copy had already taken the donated pinned pool, every block is gone: the tier
    starts again empty (a "cleared" event), a cache miss later, never a wrong block.
    """
    index = np.arange(len(meta["hash"])) if index is None else np.asarray(index)
    writes, new = {}, []             # entry -> pages' index (last wins); hashes stored
    for i, h in enumerate(meta["hash"]):
      h = int(h)
      if h in self._lru:
        self._lru.move_to_end(h)
        continue
      if not self._free:
        old, e = self._lru.popitem(last=False)
        self._free.append(e)
        self.events.append(KVEvent("removed", (old,), "host"))
      e = self._free.pop()
      writes[e] = int(index[i])
      self.depth[e], self.tokens[e] = meta["depth"][i], meta["tokens"][i]
      self.parent[e] = int(meta["parent"][i])
      self._lru[h] = e
      new.append(h)
      self.events.append(KVEvent("stored", (h,), "host", self.parent[e]))
    try:
      self._write(list(writes), list(writes.values()), pages)
    except BaseException:
      for h in new:
        if h in self._lru:
          e = self._lru.pop(h)
          self._free.append(e)
          self.depth[e] = -1
          self.events.append(KVEvent("removed", (h,), "host"))
      if consumed(self.pages):          # `_stash` took the donated pool before it failed
        self.clear()
        self.pages = self._new_pool()
      raise

  def _write(self, entries: List[int], index: List[int], pages) -> None:
    """pool[entries[i]] = block index[i] of `pages` (entries distinct)."""
    if not entries:
      return
    if self.memory_kind is None:
      for f, pool in self.pages.items():
        pool[np.asarray(entries)] = np.moveaxis(np.asarray(pages[f])[:, :, index], 2, 0)
      return
    n = next_pow2(len(entries))                   # a few shapes; the last pair repeats
    pad = lambda x: np.asarray(x + x[-1:] * (n - len(x)), np.int32)
    self.pages = _stash(self.pages, pad(entries), pad(index), pages)

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
