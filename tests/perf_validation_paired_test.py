"""experiments.perf_validation_paired: each measured run predicted at its own load factor.

The model runs are replaced by a queue whose latency depends on the rate and the speed
it is charged at (a known function): the paired prediction must charge every measured
run its own factor (measured / fitted seconds of that run's steps), take each rate's
median, set the SLO from the predicted unloaded latencies, and put the crossing where the
measured search's rule (the line between the two bracket ends) puts it."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import perf_validation
from experiments import perf_validation_paired as paired
from experiments import perf_validation_search as search
from paged_jax import perf
from paged_jax.bench import calibration
from paged_jax.bench import engines

UNLOADED_RATE, LO, HI = 4.0, 30.0, 31.0


def fake_latency(rate: float, factor: float) -> float:
  """s/token of a queue served `factor` x slower than the fit, at `rate` req/s."""
  return 0.002 * factor * (1.0 + rate / 10.0)


@pytest.fixture
def model_runs(monkeypatch):
  """Every predicted run: (system, rate, factor) recorded, its latency fake_latency."""
  calls = []

  def predicted_point(f, system, requests, size, model, factor, ratios=None):
    rate = requests[0]
    calls.append((system, rate, factor))
    return {"summary": {"normalized_latency_s_per_token": fake_latency(rate, factor),
                        "throughput_req_s": rate}, "steps": 10}
  monkeypatch.setattr(search, "sizes", lambda f, s, requests: {})
  monkeypatch.setattr(search, "predicted_point", predicted_point)
  return calls


def _measured(model, factors_lo, factors_hi, factors_unloaded, found=None):
  """A measured search's record: runs whose recorded steps took `factor` x the fit."""
  shape = perf.StepShape.decode([20, 30], bucket_tokens=8, bucket_rows=8)
  t = model.step_seconds(shape)
  steps = lambda k: [(shape, k * t), (shape, k * t)]
  runs = ([[LO, steps(k)] for k in factors_lo] + [[HI, steps(k)] for k in factors_hi])
  found = found or {"max_rate": LO, "bound": HI, "censored": None, "crossing": 30.5,
                    "monotone": True}
  point = lambda r: [r, {"normalized_latency_s_per_token": 0.01}]
  return {"unloaded": {"run_samples": [[UNLOADED_RATE, steps(k)] for k in factors_unloaded],
                       "runs": [point(UNLOADED_RATE) for _ in factors_unloaded],
                       "latency": 0.002},
          "searches": {"found": found, "run_samples": [[20.0, steps(9.0)]] + runs,
                       "runs": [point(20.0)] + [point(r) for r, _ in runs]}}


def test_each_run_is_charged_its_own_speed_and_the_crossing_follows_the_rule(model_runs):
  model = calibration.cpu_model(engines.tiny_model()[0])
  f = perf_validation.Config(systems=("paged",), unloaded_rate=UNLOADED_RATE, slo_factor=3.0)
  rec = _measured(model, [1.0, 1.5, 1.1], [0.9, 2.0, 1.2], [1.0, 1.3, 0.8])
  done = {"unloaded": {"paged": rec["unloaded"]}, "searches": {"paged": rec["searches"]}}
  out = paired.paired_prediction(f, lambda r, seed, d: (r, seed), model, done)
  # One prediction per measured run at the unloaded rate and the bracket's ends (the run
  # at 20 req/s is not around the crossing), each at that run's own factor, in run order.
  want = ([("paged", UNLOADED_RATE, k) for k in (1.0, 1.3, 0.8)]
          + [("paged", LO, k) for k in (1.0, 1.5, 1.1)]
          + [("paged", HI, k) for k in (0.9, 2.0, 1.2)])
  assert [(s, r) for s, r, _ in model_runs] == [(s, r) for s, r, _ in want]
  np.testing.assert_allclose([k for _, _, k in model_runs], [k for _, _, k in want])
  slo = 3.0 * fake_latency(UNLOADED_RATE, 1.0)          # the median factor there: 1.0
  lat_lo, lat_hi = fake_latency(LO, 1.1), fake_latency(HI, 1.2)
  found = out["searches"]["paged"]["found"]
  assert out["slo_s_per_token"] == pytest.approx(slo)
  assert found["crossing"] == pytest.approx(LO + (slo - lat_lo) / (lat_hi - lat_lo) * (HI - LO))
  assert found["bracketed"] == bool(lat_lo <= slo < lat_hi)
  assert out["load_factor"]["paged"] == pytest.approx({"search": 1.15, "unloaded": 1.0})
  judged = search.judge(dict(done, slo_s_per_token=slo), out)["systems"]["paged"]
  assert judged["rel_error"] == pytest.approx(found["crossing"] / 30.5 - 1)
  # Each paired run's latency against the measured run it predicts (0.01 s/token each).
  errors = judged["paired_latency_errors"]
  assert [r for r, _ in errors] == [LO] * 3 + [HI] * 3
  np.testing.assert_allclose([e for _, e in errors], [
      fake_latency(r, k) / 0.01 - 1 for _, r, k in want[3:]])


def test_a_censored_measured_search_has_no_paired_prediction(model_runs):
  model = calibration.cpu_model(engines.tiny_model()[0])
  f = perf_validation.Config(systems=("paged",), unloaded_rate=UNLOADED_RATE)
  censored = {"max_rate": 60.0, "bound": None, "censored": "above", "crossing": None,
              "monotone": True}
  rec = _measured(model, [1.0], [], [1.0], found=censored)
  done = {"unloaded": {"paged": rec["unloaded"]}, "searches": {"paged": rec["searches"]}}
  out = paired.paired_prediction(f, lambda r, seed, d: (r, seed), model, done)
  assert out["searches"]["paged"]["found"]["crossing"] is None
  assert all(r == UNLOADED_RATE for _, r, _ in model_runs)
  judged = search.judge(dict(done, slo_s_per_token=0.01), out)["systems"]["paged"]
  assert judged["rel_error"] is None


def test_runs_that_kept_no_steps_are_a_one_line_error(model_runs):
  model = calibration.cpu_model(engines.tiny_model()[0])
  f = perf_validation.Config(systems=("paged",), unloaded_rate=UNLOADED_RATE)
  done = {"unloaded": {"paged": {}}, "searches": {"paged": {}}}
  with pytest.raises(ValueError, match="--predict=paired needs the measured runs' steps"):
    paired.paired_prediction(f, lambda r, seed, d: (r, seed), model, done)
