"""Seeded Poisson arrivals: the one generator every request stream takes its times from.

    times = arrivals.arrival_times(4.0, duration_s=10.0, seed=0)     # f64[n] s, n random
    times = arrivals.arrival_times(4.0, num_requests=100, seed=0)    # the first 100 of them

Gaps are unit-rate exponentials from one stream seeded by `seed`, divided by the rate:
a faster rate is the same stream compressed in time, and the first `num_requests`
arrivals are those of any window long enough to hold them (common random numbers across
a rate sweep and across both ways of asking).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from paged_jax.config import check_int


def _unit_gaps(seed: int) -> np.random.Generator:
  return np.random.default_rng([seed, 11])


def arrival_times(rate: float, duration_s: Optional[float] = None, seed: int = 0, *,
                  num_requests: Optional[int] = None) -> np.ndarray:
  """f64[n] arrival times (s) of a Poisson process at `rate` requests/s.

  Args:
    rate: requests/s, > 0; `inf` (all at t = 0) only with `num_requests`.
    duration_s: every arrival in [0, duration_s) (n is random, mean rate * duration_s).
    seed: the stream's seed.
    num_requests: instead of `duration_s`: the first `num_requests` arrivals.
  Returns:
    increasing times in seconds.
  """
  if (duration_s is None) == (num_requests is None):
    raise ValueError("give exactly one of duration_s and num_requests")
  if num_requests is not None:
    check_int("num_requests", num_requests, 0)
    if not rate > 0:   # NaN fails this too
      raise ValueError(f"request_rate must be > 0 requests/s (inf: all at t = 0), got {rate}")
    if math.isinf(rate):
      return np.zeros(num_requests)
    return np.cumsum(_unit_gaps(seed).exponential(1.0, num_requests)) / rate
  if not (math.isfinite(rate) and rate > 0):
    raise ValueError(f"request_rate must be a finite number > 0 requests/s, got {rate}")
  if not (math.isfinite(duration_s) and duration_s > 0):
    raise ValueError(f"duration_s must be a finite number > 0, got {duration_s}")
  rng = _unit_gaps(seed)
  need = rate * duration_s
  gaps = rng.exponential(1.0, int(need + 10 * math.sqrt(need) + 16))
  while gaps.sum() < need:   # practically never: the draw covers mean + 10 sd
    gaps = np.concatenate([gaps, rng.exponential(1.0, gaps.size)])
  times = np.cumsum(gaps) / rate
  return times[times < duration_s]
