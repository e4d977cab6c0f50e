"""Compiled executables kept within what the process can map (an LRU of per-shape jits).

    from paged_jax import executables
    fn = executables.BUDGET.get(key, lambda: executables.shape_jit(step, donate_argnums=(1,),
                                                                    width=w))
    state, out = fn(params, state, inputs)     # compiles (or loads from disk) on first use
    executables.BUDGET.stats()                 # live, created, released, maps, peak_maps ...

Why: XLA:CPU loads each kernel of an executable as an object of its own, and LLVM's JIT
memory manager maps each object's code, constants and data apart: ~650 memory maps per
step shape of the shipped model (`experiments/compile_maps.py`; the same on jax 0.10 and
0.11, and for an executable loaded from the persistent cache; no XLA:CPU flag lowers it
much). Linux caps a process at `vm.max_map_count` maps (65,530; raising it needs root),
and LLVM aborts the process when a compile meets the cap. JAX keeps every executable a
jit compiled as long as the jit lives, and it cannot drop one executable of a jit.

How: each step shape gets a jit of its own (`shape_jit`), held in one process-wide LRU
(`BUDGET`, shared by every engine). Dropping a jit gives its executable's maps back at
once, and arrays it produced stay valid (a donated state included: XLA's outputs are
buffers of their own). Before a key not held is made, `get` reads the process's map count
(/proc/self/maps) and releases the least recently used jits until `reserve_maps` maps stay
free below `max_maps`, room for the next compile and everything else the process maps.
A released shape that comes back is traced again and compiled, or loaded from JAX's
persistent cache when `paged_jax.compile_cache` is on (~0.6 s instead of 3+ s a step).
Where /proc is absent the bound is a count of live jits (`max_live`).

Bounds (defaults; `configure` changes them, $PAGED_JAX_MAX_MAPS lowers `max_maps`):
  max_maps      the process's map limit (/proc/sys/vm/max_map_count);
  reserve_maps  a quarter of max_maps (16,382 of 65,530: ~20 executables' worth);
  max_live      none where maps can be read, else 64.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
from typing import Any, Callable, Dict, Hashable, Optional, Sequence

import jax

log = logging.getLogger("paged_jax.executables")

MAPS_FILE = "/proc/self/maps"
MAX_MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"
ENV_MAX_MAPS = "PAGED_JAX_MAX_MAPS"
DEFAULT_MAX_LIVE = 64          # live jits where the map count cannot be read
MIN_RESERVE_MAPS = 1024        # one executable of a small model, the compile's own maps


def map_count(path: str = MAPS_FILE) -> Optional[int]:
  """The process's memory maps now (lines of /proc/self/maps), or None where unreadable.
  Costs ~5 us a map (the kernel writes each line): ~50 ms at 10,000 maps."""
  try:
    with open(path, "rb") as f:
      return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
  except OSError:
    return None


def map_limit(path: str = MAX_MAP_COUNT_FILE) -> Optional[int]:
  """The process's map limit: vm.max_map_count, lowered by $PAGED_JAX_MAX_MAPS when set
  (a positive int); None where neither is known. A bad $PAGED_JAX_MAX_MAPS is a
  ValueError naming it."""
  limit = None
  try:
    with open(path, encoding="ascii") as f:
      limit = int(f.read().strip())
  except (OSError, ValueError):
    pass
  env = os.environ.get(ENV_MAX_MAPS, "").strip()
  if env:
    if not env.isdigit() or int(env) < 1:
      raise ValueError(f"${ENV_MAX_MAPS} must be a positive int of memory maps, got {env!r}")
    limit = int(env) if limit is None else min(limit, int(env))
  return limit


def shape_jit(fn: Callable[..., Any], *, donate_argnums: Sequence[int] = (),
              **static: Any) -> Callable[..., Any]:
  """`jax.jit(fn)` with the keyword arguments `static` bound: a jit of its own, whose
  executables (one per argument shapes) go when it is dropped. The compiled function
  keeps `fn`'s name (JAX's persistent cache files are named after it)."""
  return jax.jit(functools.partial(fn, **static), donate_argnums=tuple(donate_argnums))


def _check_bound(name: str, value: Any) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                            or value < 1):
    raise ValueError(f"{name} must be a positive int or None, got {value!r}")


class ExecutableBudget:
  """An LRU of callables (per-shape jits) bounded by the process's memory-map headroom.

  Args:
    max_maps: memory maps the process may hold (default `map_limit()`); None: no map
      bound (then `max_live` bounds).
    reserve_maps: maps kept free below `max_maps` for the next compile and everything
      else in the process (default max_maps // 4, at least MIN_RESERVE_MAPS).
    max_live: live callables at most (default: none where maps are read, else
      DEFAULT_MAX_LIVE).
    read_maps: () -> the map count now or None (default `map_count`; tests pass a fake).

  Thread-safe; `get` is the hook a dispatch calls.
  """

  def __init__(self, *, max_maps: Optional[int] = None, reserve_maps: Optional[int] = None,
               max_live: Optional[int] = None,
               read_maps: Callable[[], Optional[int]] = map_count):
    self._lock = threading.RLock()
    self._live: "collections.OrderedDict[Hashable, Any]" = collections.OrderedDict()
    self._cost: Dict[Hashable, int] = {}     # key -> maps its first use added (measured)
    self._read_maps = read_maps
    self._pending: Optional[tuple] = None   # (key, maps when it was made)
    self._stats = collections.Counter()
    self._last_maps: Optional[int] = None    # the last reading of the map count
    self._warned = False    # logged: nothing left to release
    self._hinted = False    # logged: the persistent cache is off
    self.configure(max_maps=max_maps, reserve_maps=reserve_maps, max_live=max_live)

  def configure(self, *, max_maps: Optional[int] = None, reserve_maps: Optional[int] = None,
                max_live: Optional[int] = None) -> None:
    """Sets the bounds (None: the default of each; see the class doc). Takes effect at the
    next key `get` makes."""
    for name, value in (("max_maps", max_maps), ("reserve_maps", reserve_maps),
                        ("max_live", max_live)):
      _check_bound(name, value)
    with self._lock:
      self.maps_readable = self._read_maps() is not None
      self.max_maps = (max_maps if max_maps is not None else
                       map_limit() if self.maps_readable else None)
      if reserve_maps is None and self.max_maps is not None:
        reserve_maps = max(self.max_maps // 4, MIN_RESERVE_MAPS)
      self.reserve_maps = reserve_maps or 0
      if self.max_maps is not None and self.reserve_maps >= self.max_maps:
        raise ValueError(f"reserve_maps must be < max_maps={self.max_maps}, "
                         f"got {self.reserve_maps}")
      self.max_live = (max_live if max_live is not None else
                       None if self.max_maps is not None else DEFAULT_MAX_LIVE)

  def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
    """The callable held for `key`, marked most recently used; else `make()`'s, after
    releasing least recently used callables while the map headroom (or `max_live`) is
    short. `key` must name everything the callable's executable depends on."""
    with self._lock:
      fn = self._live.get(key)
      if fn is not None:
        self._live.move_to_end(key)
        self._stats["hits"] += 1
        return fn
      maps = self._make_room()
      fn = make()
      self._live[key] = fn
      self._pending = (key, maps)
      self._stats["created"] += 1
      return fn

  def _make_room(self) -> Optional[int]:
    """Releases LRU callables until the bounds leave room for one more; the map count
    after (None where not read)."""
    maps = self._maps_now()
    released = 0
    while self.max_live is not None and len(self._live) >= self.max_live:
      released += self._release_oldest()
    while maps is not None and self._live and self.max_maps - maps < self.reserve_maps:
      # Release about what the shortfall needs (the measured costs of the oldest), then
      # read again: the costs are estimates, the count is not.
      short = self.reserve_maps - (self.max_maps - maps)
      freed = 0
      while self._live and freed < short:
        freed += self._cost.get(next(iter(self._live))) or short
        released += self._release_oldest()
      maps = self._read_maps()
    if released:
      self._stats["released"] += released
      log.info("paged_jax executables: released %d least recently used (%d live, %s of %s "
               "memory maps)", released, len(self._live), maps, self.max_maps)
      if not self._hinted and not jax.config.jax_compilation_cache_dir:
        self._hinted = True
        log.info("paged_jax executables: a released shape compiles again when it comes "
                 "back; paged_jax.compile_cache.enable() loads it from disk instead")
    if maps is not None:
      self._last_maps = maps
      self._stats["peak_maps"] = max(self._stats["peak_maps"], maps)
      if self.max_maps - maps < self.reserve_maps and not self._warned:
        self._warned = True
        log.warning("paged_jax executables: %d of %d memory maps used with nothing left to "
                    "release; the process is near Linux's vm.max_map_count", maps,
                    self.max_maps)
    return maps

  def _maps_now(self) -> Optional[int]:
    """The map count (None: no map bound), charging the maps added since the last key
    was made to that key: its compile. Read at every new key: ~5 us a map, under a tenth
    of a compile even near the limit, and an estimate could miss a larger executable."""
    if self.max_maps is None:
      return None
    maps = self._read_maps()
    if maps is not None and self._pending is not None:
      key, before = self._pending
      if before is not None and key in self._live:
        self._cost[key] = max(maps - before, 0)
        self._stats["measured"] += 1
        self._stats["measured_maps"] += self._cost[key]
    return maps

  def _release_oldest(self) -> int:
    key, fn = self._live.popitem(last=False)
    self._cost.pop(key, None)
    if self._pending is not None and self._pending[0] == key:
      self._pending = None
    clear = getattr(fn, "clear_cache", None)
    if clear is not None:   # a reference held elsewhere must not keep the executables
      clear()
    return 1

  def release(self, key: Optional[Hashable] = None) -> int:
    """Drops `key`'s callable (default: every one); how many were dropped."""
    with self._lock:
      keys = [key] if key is not None else list(self._live)
      n = 0
      for k in keys:
        if k in self._live:
          self._live.move_to_end(k, last=False)
          n += self._release_oldest()
      self._stats["released"] += n
      return n

  def __contains__(self, key: Hashable) -> bool:
    return key in self._live

  def __len__(self) -> int:
    return len(self._live)

  def stats(self) -> Dict[str, Any]:
    """{"live", "created", "hits", "released", "maps" (the last reading, at a new key),
    "peak_maps" (of the readings), "maps_per_executable" (mean maps a new key's first use
    added, where measured), "max_maps", "reserve_maps", "max_live"}."""
    with self._lock:
      measured = self._stats["measured"]
      return {"live": len(self._live), "created": self._stats["created"],
              "hits": self._stats["hits"], "released": self._stats["released"],
              "maps": self._last_maps, "peak_maps": self._stats["peak_maps"],
              "maps_per_executable": (self._stats["measured_maps"] / measured
                                      if measured else None),
              "max_maps": self.max_maps, "reserve_maps": self.reserve_maps,
              "max_live": self.max_live}


BUDGET = ExecutableBudget()   # the process's one budget: maps are counted per process


def configure(*, max_maps: Optional[int] = None, reserve_maps: Optional[int] = None,
              max_live: Optional[int] = None) -> None:
  """`BUDGET.configure`: the process-wide bounds (None: defaults)."""
  BUDGET.configure(max_maps=max_maps, reserve_maps=reserve_maps, max_live=max_live)
