"""paged_jax.bench.timing against fake clocks (no wall-clock assertions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.bench import timing


class FakeClock:
  """Stands in for time.perf_counter: time moves only when a timed function says so."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now

  def taking(self, seconds):
    def f(x):
      self.now += seconds
      return x
    return f


@pytest.fixture
def clock():
  return FakeClock()


def test_time_interleaved_medians_are_per_call_durations(clock):
  x = jnp.asarray(np.random.default_rng(0).normal(size=4), jnp.float32)
  res = timing.time_interleaved({"short": (clock.taking(0.004), (x,)),
                                 "long": (clock.taking(0.012), (x,))}, repeats=5, calls=2,
                                clock=clock)
  for name, seconds in (("short", 0.004), ("long", 0.012)):
    assert res[name]["samples"] == 5
    assert res[name]["min_s"] == pytest.approx(seconds)
    assert res[name]["median_s"] == pytest.approx(seconds)


def test_time_interleaved_reports_a_failing_method_and_times_the_rest(clock):
  calls = []

  def broken(x):
    calls.append(1)
    raise ValueError("bad shape")

  x = jnp.ones(3)
  res = timing.time_interleaved({"broken": (broken, (x,)), "ok": (clock.taking(0.001), (x,))},
                                repeats=3, calls=1, clock=clock)
  assert res["broken"] == {"error": "ValueError: bad shape"}
  assert len(calls) == 1   # dropped after its failed warm-up, never timed
  assert res["ok"]["samples"] == 3 and res["ok"]["median_s"] == pytest.approx(0.001)


def test_time_interleaved_calls_per_sample_and_results():
  # Each sample runs `calls` back-to-back calls: warm-up 2 + repeats * calls in total.
  count = []
  f = jax.jit(lambda x: x * 2)

  def counted(x):
    count.append(1)
    return f(x)

  timing.time_interleaved({"f": (counted, (jnp.ones(8),))}, repeats=4, calls=3)
  assert len(count) == 2 + 4 * 3
  t = timing.time_call(f, (jnp.ones(8),), repeats=3, calls=1)
  assert set(t) == {"median_s", "min_s", "samples"} and t["samples"] == 3


def test_copy_bandwidth_is_bytes_over_time():
  ticks = iter(np.arange(0.0, 100.0, 0.25))   # every clock read is 0.25 s after the last
  nbytes = 1 << 22
  # One call per sample: 0.25 s for 2 * nbytes moved (read + write).
  assert timing.copy_bandwidth(repeats=3, calls=1, nbytes=nbytes,
                               clock=lambda: float(next(ticks))) == 2 * nbytes / 0.25
