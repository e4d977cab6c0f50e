"""KV cache events, as vLLM publishes them (BlockStored, BlockRemoved, AllBlocksCleared)
for routers such as llm-d: what the prefix cache stored and removed, per medium.

The device side is the prefix cache's event log (`state.log_events`: one row per block
that `core.register` stored or `evict.uncache` removed, appended where it happens); the
engine's step returns the log in its outputs and starts it over, so the events come from
what the step did, exactly, in order. The host tier (`host_tier.HostTier`) reports its
own stores and removals. `Engine.kv_events()` hands them out and drains them.

A block hash is the chained 64-bit hash of `hashing.chain_hash` as one int (lane 0 the low
32 bits); a block's parent hash is its parent's hash (at depth 0 the request's salt root,
`salt.salt_key`), so a consumer can rebuild the chains.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, List, Optional, Tuple

import numpy as np

from paged_jax.prefix_cache import state as st

KINDS = ("stored", "removed", "cleared")
MEDIA = ("device", "host")


@dataclasses.dataclass(frozen=True)
class KVEvent:
  """One KV cache event.

  Attributes:
    kind: "stored" (vLLM's BlockStored), "removed" (BlockRemoved) or "cleared"
      (AllBlocksCleared: every block of `medium` is gone; None: of both).
    block_hashes: the blocks' chained hashes (ints < 2**64), in chain order.
    medium: "device" (the accelerator's prefix cache) or "host" (the host tier).
    parent_block_hash: "stored" only: the hash `block_hashes[0]` chains from.
  """
  kind: str
  block_hashes: Tuple[int, ...]
  medium: Optional[str]
  parent_block_hash: Optional[int] = None


def hash_int(lanes) -> int:
  """The int of a hash given as two u32 lanes (or their int32 bits)."""
  lanes = np.asarray(lanes).astype(np.int64) & 0xFFFFFFFF
  return int(lanes[0]) | (int(lanes[1]) << 32)


def decode(rows: np.ndarray, medium: str = "device") -> List[KVEvent]:
  """Events of log rows i32[n, 5] (`state.log_events`), in order: consecutive stores
  that chain (each the parent of the next) become one "stored" event with several hashes,
  as vLLM batches them; each removal is its own event."""
  out: List[KVEvent] = []
  for row in np.asarray(rows):
    h = hash_int(row[st.EV_HASH:st.EV_HASH + 2])
    if row[st.EV_KIND] == st.EV_STORED:
      parent = hash_int(row[st.EV_PARENT_HASH:st.EV_PARENT_HASH + 2])
      last = out[-1] if out else None
      if (last is not None and last.kind == "stored" and last.medium == medium
          and last.block_hashes[-1] == parent):
        out[-1] = dataclasses.replace(last, block_hashes=last.block_hashes + (h,))
      else:
        out.append(KVEvent("stored", (h,), medium, parent))
    elif row[st.EV_KIND] == st.EV_REMOVED:
      out.append(KVEvent("removed", (h,), medium))
    else:
      raise ValueError(f"unknown event kind {int(row[st.EV_KIND])} in the prefix cache's log")
  return out


def diff(before: collections.Counter, after: collections.Counter, parents: dict,
         medium: str) -> List[KVEvent]:
  """The events that take a cache holding the hashes `before` (a multiset: under a hash
  collision two blocks may share one) to `after`, `parents` giving each new hash's parent:
  removals, then stores. For a log that overflowed (`Engine.kv_events` then reads the
  cache's contents)."""
  gone = [KVEvent("removed", (h,), medium) for h, n in (before - after).items()
          for _ in range(n)]
  new = [KVEvent("stored", (h,), medium, parents.get(h)) for h, n in (after - before).items()
         for _ in range(n)]
  return gone + new


class DeviceView:
  """The device cache's hashes as the published events left them (a multiset: under a
  hash collision two blocks may share one), so a log that overflowed can be replaced by
  the exact difference (`take`). A record of what was published, derived from the events
  alone; checked against the device only on overflow."""

  def __init__(self):
    self.hashes: collections.Counter = collections.Counter()

  def take(self, rows: np.ndarray, n: int,
           read_cache: Callable[[], Tuple[np.ndarray, np.ndarray, np.ndarray]]
           ) -> List[KVEvent]:
    """The events of a step's log: `rows` i32[E, 5], `n` rows appended (> E: overflowed;
    then `read_cache()` -> (cached bool[NB], hash i32[NB, 2], parent hash i32[NB, 2]),
    one device read, gives what the cache holds)."""
    if n <= rows.shape[0]:
      new = decode(rows[:n], "device")
    else:
      cached, h, parent = read_cache()
      idx = np.nonzero(np.asarray(cached))[0]
      now = collections.Counter(hash_int(h[i]) for i in idx)
      new = diff(self.hashes, now, {hash_int(h[i]): hash_int(parent[i]) for i in idx},
                 "device")
    for e in new:
      (self.hashes.update if e.kind == "stored" else self.hashes.subtract)(e.block_hashes)
    self.hashes = +self.hashes              # drops zero counts
    return new

  def clear(self) -> List[KVEvent]:
    """The cache was emptied: one "cleared" event if it held anything."""
    out = [KVEvent("cleared", (), "device")] if self.hashes else []
    self.hashes = collections.Counter()
    return out
