"""experiments.common timing helpers: interleaved medians against known durations."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common


def _sleeper(seconds):
  def f(x):
    time.sleep(seconds)
    return x
  return f


def test_time_interleaved_medians_track_known_durations():
  # time.sleep sets a floor per call; each method's median follows its own floor (not
  # the other's: ratio ~ 3, loose bounds for a loaded machine).
  x = jnp.asarray(np.random.default_rng().normal(size=4), jnp.float32)
  res = common.time_interleaved({"short": (_sleeper(0.004), (x,)),
                                 "long": (_sleeper(0.012), (x,))}, repeats=5, calls=2)
  for name, floor in (("short", 0.004), ("long", 0.012)):
    assert res[name]["samples"] == 5
    assert floor <= res[name]["min_s"] <= res[name]["median_s"] < floor + 0.1
  assert res["long"]["median_s"] / res["short"]["median_s"] > 1.5


def test_time_interleaved_reports_a_failing_method_and_times_the_rest():
  calls = []

  def broken(x):
    calls.append(1)
    raise ValueError("bad shape")

  x = jnp.ones(3)
  res = common.time_interleaved({"broken": (broken, (x,)), "ok": (_sleeper(0.001), (x,))},
                                repeats=3, calls=1)
  assert res["broken"] == {"error": "ValueError: bad shape"}
  assert len(calls) == 1   # dropped after its failed warm-up, never timed
  assert res["ok"]["samples"] == 3 and res["ok"]["median_s"] >= 0.001


def test_time_interleaved_calls_per_sample_and_results():
  # Each sample runs `calls` back-to-back calls: warm-up 2 + repeats * calls in total.
  count = []
  f = jax.jit(lambda x: x * 2)

  def counted(x):
    count.append(1)
    return f(x)

  common.time_interleaved({"f": (counted, (jnp.ones(8),))}, repeats=4, calls=3)
  assert len(count) == 2 + 4 * 3
  t = common.time_call(f, (jnp.ones(8),), repeats=3, calls=1)
  assert set(t) == {"median_s", "min_s", "samples"} and t["samples"] == 3


def test_copy_bandwidth_is_bytes_over_time():
  gbps = common.copy_bandwidth(repeats=3, calls=1, nbytes=1 << 22) / 1e9
  assert np.isfinite(gbps) and 0.01 < gbps < 1e4


if __name__ == "__main__":
  pytest.main([__file__, "-q"])
