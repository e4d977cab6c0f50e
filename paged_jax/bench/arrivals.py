"""Time for online serving: seeded Poisson arrivals and the clocks a serve loop runs on.

    times = arrivals.arrival_times(rate=4.0, duration_s=10.0, seed=0)   # f64[n] seconds
    clock = arrivals.WallClock()          # real time; or StepClock(0.01): 10 ms per step

`paged_jax.bench.serving.serve_online` feeds requests into a running engine at these
times; `serving` re-exports the three names.
"""

from __future__ import annotations

import math
import time

import numpy as np


def arrival_times(rate: float, duration_s: float, seed: int) -> np.ndarray:
  """f64[n] arrival times (s) of a Poisson process at `rate` requests/s in [0, duration_s).

  Gaps are unit-rate exponentials from one seeded stream divided by `rate`, so a sweep's
  faster rate is the same stream compressed in time (common random numbers).
  """
  if not (math.isfinite(rate) and rate > 0):
    raise ValueError(f"request rate must be a finite number > 0 (requests/s), got {rate}")
  if not (math.isfinite(duration_s) and duration_s > 0):
    raise ValueError(f"duration_s must be a finite number > 0, got {duration_s}")
  rng = np.random.default_rng([seed, 11])
  need = rate * duration_s
  gaps = rng.exponential(1.0, int(need + 10 * math.sqrt(need) + 16))
  while gaps.sum() < need:   # practically never: the draw covers mean + 10 sd
    gaps = np.concatenate([gaps, rng.exponential(1.0, gaps.size)])
  times = np.cumsum(gaps) / rate
  return times[times < duration_s]


class WallClock:
  """Real time since construction (s); waiting sleeps."""

  name = "wall"

  def __init__(self):
    self.start()

  def start(self) -> None:
    """Time 0 is now (called when serving starts, after the engine compiled)."""
    self._t0 = time.perf_counter()

  def now(self) -> float:
    return time.perf_counter() - self._t0

  def stepped(self, swapped_tokens: int = 0) -> None:
    """Called after every engine step (real time moved by itself, copies included)."""
    del swapped_tokens

  def wait_until(self, t: float) -> None:
    time.sleep(max(0.0, t - self.now()))


# Swap traffic on the step clock, per token moved one way: the paper's OPT-13B holds
# 800 KB of K/V per token (arXiv:2309.06180 sec. 3), over PCIe 4.0 x16 at ~25 GB/s
# achieved (32 GB/s peak) between an A100 and pinned host memory.
OPT13B_SWAP_S_PER_TOKEN = 800e3 / 25e9


class StepClock:
  """Virtual time: every engine step costs `step_s` seconds whatever its batch (the
  memory-bound GPU regime, where a decode step's time barely grows with the batch),
  plus `swap_s_per_token` per token of K/V the step swapped out or in; waiting jumps
  ahead. Deterministic: no wall-clock reads."""

  name = "step"

  def __init__(self, step_s: float, swap_s_per_token: float = OPT13B_SWAP_S_PER_TOKEN):
    if not step_s > 0:
      raise ValueError(f"step_s must be > 0, got {step_s}")
    if not (math.isfinite(swap_s_per_token) and swap_s_per_token >= 0):
      raise ValueError(f"swap_s_per_token must be a finite number >= 0, got {swap_s_per_token}")
    self.step_s, self.swap_s_per_token, self._t = step_s, swap_s_per_token, 0.0

  def start(self) -> None:
    self._t = 0.0

  def now(self) -> float:
    return self._t

  def stepped(self, swapped_tokens: int = 0) -> None:
    self._t += self.step_s + swapped_tokens * self.swap_s_per_token

  def wait_until(self, t: float) -> None:
    self._t = max(self._t, t)
