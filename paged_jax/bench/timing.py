"""Timing primitives the benchmarks share: interleaved samples, medians, copy bandwidth.

    t = timing.time_interleaved({"a": (f, args), "b": (g, args)}, repeats=5, calls=1)
    t["a"]["median_s"], t["b"]["min_s"]
    timing.copy_bandwidth(repeats=5, calls=1)          # bytes/s of an elementwise copy

Samples of several methods go round-robin so load from other processes on a shared
machine hits every method alike. `clock` arguments read seconds (tests pass fake ones).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict


def time_interleaved(fns: Dict[str, tuple], repeats: int, calls: int,
                     clock: Callable[[], float] = time.perf_counter) -> Dict[str, dict]:
  """Times several (fn, args) pairs with their samples interleaved round-robin, so load
  from other processes hits every method alike.

  Each fn is run twice untimed (compile + warm-up); then `repeats` rounds, each timing
  `calls` back-to-back calls of every method and blocking on the last output. Returns
  {name: {"median_s", "min_s", "samples"}} in seconds per call. A method that fails to
  compile or run gets {"error": "<type>: <message>"} and is dropped from the rounds.
  `clock` reads seconds (tests pass a fake one).
  """
  import jax  # pylint: disable=g-import-not-at-top
  results: Dict[str, dict] = {}
  live = {}
  for name, (fn, args) in fns.items():
    try:
      jax.block_until_ready(fn(*args))  # compile + first run
      jax.block_until_ready(fn(*args))
      live[name] = (fn, args)
    except Exception as e:  # pylint: disable=broad-except
      results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  samples = {name: [] for name in live}
  for _ in range(repeats):
    for name, (fn, args) in live.items():
      t0 = clock()
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
      samples[name].append((clock() - t0) / calls)
  for name, xs in samples.items():
    results[name] = {"median_s": statistics.median(xs), "min_s": min(xs), "samples": len(xs)}
  return results


def time_call(fn: Callable, args, repeats: int, calls: int,
              clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
  """Median / min seconds per call of `fn(*args)` after warm-up (see time_interleaved)."""
  return time_interleaved({"f": (fn, args)}, repeats, calls, clock)["f"]


def copy_bandwidth(repeats: int, calls: int, nbytes: int = 2 << 30,
                   clock: Callable[[], float] = time.perf_counter) -> float:
  """Device copy bandwidth in bytes/s: x * 2 over an `nbytes` float32 array reads and
  writes it once (2 * nbytes moved per call), median over `repeats` samples."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda x: x * 2)
  t = time_call(f, (x,), repeats, calls, clock)["median_s"]
  del x
  return 2 * nbytes / t
