"""A contiguous token arena with first-fit placement (the pre-paging allocator).

Each request gets one contiguous span `[offset, offset + size)` of the KV
memory, as in Orca and FasterTransformer. Spans are freed when requests finish,
leaving holes; a new span goes into the lowest-addressed hole large enough
(first fit). Free memory split across holes too small for the next request is
external fragmentation: it is real here, not assumed.

Host-side Python; sizes are in tokens (KV slots).
"""

from __future__ import annotations

import bisect
from typing import Dict, Hashable, List, Optional, Tuple

from paged_jax.config import check_int


class ContiguousArena:
  """First-fit allocator over `capacity` token slots.

  Attributes:
    capacity: slots in the arena.
  """

  def __init__(self, capacity: int):
    check_int("capacity", capacity, 1)
    self.capacity = capacity
    self._offsets: List[int] = []             # sorted start offsets of live spans
    self._spans: Dict[int, Tuple[int, Hashable]] = {}   # offset -> (size, owner)
    self._owner_offset: Dict[Hashable, int] = {}

  # -- queries ---------------------------------------------------------------
  def holes(self) -> List[Tuple[int, int]]:
    """Free spans as (offset, size), in address order."""
    out, cursor = [], 0
    for off in self._offsets:
      if off > cursor:
        out.append((cursor, off - cursor))
      cursor = off + self._spans[off][0]
    if cursor < self.capacity:
      out.append((cursor, self.capacity - cursor))
    return out

  @property
  def used(self) -> int:
    """Slots inside live spans."""
    return sum(size for size, _ in self._spans.values())

  @property
  def free(self) -> int:
    return self.capacity - self.used

  def largest_hole(self) -> int:
    return max((size for _, size in self.holes()), default=0)

  def span(self, owner: Hashable) -> Tuple[int, int]:
    """(offset, size) held by `owner`."""
    off = self._owner_offset[owner]
    return off, self._spans[off][0]

  def __contains__(self, owner: Hashable) -> bool:
    return owner in self._owner_offset

  def __len__(self) -> int:
    return len(self._owner_offset)

  # -- updates ---------------------------------------------------------------
  def find(self, size: int) -> Optional[int]:
    """Offset first fit would place `size` slots at, or None if no hole fits."""
    for off, hole in self.holes():
      if hole >= size:
        return off
    return None

  def allocate(self, owner: Hashable, size: int) -> Optional[int]:
    """Places `size` slots for `owner` first-fit; returns the offset or None (unchanged)."""
    check_int("size", size, 1, self.capacity)
    if owner in self._owner_offset:
      raise ValueError(f"owner {owner!r} already holds a span")
    off = self.find(size)
    if off is None:
      return None
    bisect.insort(self._offsets, off)
    self._spans[off] = (size, owner)
    self._owner_offset[owner] = off
    return off

  def release(self, owner: Hashable) -> int:
    """Frees `owner`'s span; returns its size."""
    if owner not in self._owner_offset:
      raise KeyError(f"owner {owner!r} holds no span")
    off = self._owner_offset.pop(owner)
    size, _ = self._spans.pop(off)
    self._offsets.pop(bisect.bisect_left(self._offsets, off))
    return size
