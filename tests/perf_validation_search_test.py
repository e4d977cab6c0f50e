"""experiments.perf_validation_search on fake clocks whose saturation is known.

The truth and model runs are replaced by a queue's latency curve per system (flat under a
known saturation rate, steep above, seeded noise): the measured search must find each
crossing within its tolerance with medians near the SLO, the prediction must start from
it, and a system that never saturates within the bracket limit must come back censored
with rel_error None (never 0%)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import perf_validation
from experiments import perf_validation_search as search

UNLOADED = 0.002   # s/token under saturation: the SLO is 3x this


def queue_latency(rate: float, saturation: float) -> float:
  """Slowly rising under `saturation`, steeply (continuously) above it."""
  if rate <= saturation:
    return UNLOADED * (1 + 0.5 * rate / saturation)
  return UNLOADED * (1.5 + 40.0 * (rate / saturation - 1.0))


def true_crossing(saturation: float, slo: float) -> float:
  """Where queue_latency meets `slo` (above saturation)."""
  return saturation * (1 + (slo / UNLOADED - 1.5) / 40.0)


@pytest.fixture
def fake_runs(monkeypatch):
  """Replaces every engine run: a stream is (rate, seed); a point's latency is the queue
  curve of its system's saturation (times seeded noise on the truth clock). Returns
  {"saturation": {system: rate}, "noise": sigma, "calls": [(kind, system, rate)]}."""
  state = {"saturation": {}, "noise": 0.0, "rng": np.random.default_rng(0), "calls": [],
           "model_scale": 1.0}

  def point(kind, system, requests):
    rate = requests[0]
    state["calls"].append((kind, system, rate))
    lat = queue_latency(rate, state["saturation"][system])
    if kind == "measured" and state["noise"]:
      lat *= float(np.exp(state["rng"].normal(0.0, state["noise"])))
    if kind == "predicted":
      lat = queue_latency(rate, state["saturation"][system] * state["model_scale"])
    return {"summary": {"normalized_latency_s_per_token": lat, "throughput_req_s": rate},
            "steps": 10, "load_avg": 0.5}

  monkeypatch.setattr(search, "sizes", lambda f, s, requests: {})
  monkeypatch.setattr(search, "measured_point",
                      lambda f, s, requests, size: point("measured", s, requests))
  monkeypatch.setattr(search, "calibration_point",
                      lambda f, s, requests, size: (point("calibration", s, requests),
                                                    {"samples": [("shape", 0.001)],
                                                     "late": []})[1])
  monkeypatch.setattr(search, "predicted_point",
                      lambda f, s, requests, size, model, factor: point(
                          "predicted", s, requests))
  monkeypatch.setattr(search.calibration, "load_factor", lambda model, samples: 1.0)
  return state


def _stream(rate, seed, duration_s):
  return (rate, seed)


def _config(**kw):
  kw = dict(dict(systems=("paged", "orca_max"), repeats=3, rel_tol=0.04, max_rates=8,
                 start_rate=24.0, unloaded_rate=4.0), **kw)
  return perf_validation.Config(**kw)


def test_measured_search_finds_each_known_saturation(fake_runs):
  fake_runs["saturation"] = {"paged": 41.0, "orca_max": 17.5}
  fake_runs["noise"] = 0.05
  f = _config()
  saves = []
  done = search.measured_search(f, _stream, {}, save=lambda d: saves.append(sorted(d)))
  assert done["slo_s_per_token"] == pytest.approx(
      3 * max(queue_latency(4.0, s) for s in (41.0, 17.5)), rel=0.2)
  for system, sat in fake_runs["saturation"].items():
    found = done["searches"][system]["found"]
    known = true_crossing(sat, done["slo_s_per_token"])
    assert found["censored"] is None and found["monotone"]
    assert found["max_rate"] <= known * 1.02 and found["bound"] >= known * 0.98
    assert found["bound"] / found["max_rate"] <= 1 + f.rel_tol + 1e-9
    assert abs(found["crossing"] / known - 1) <= 0.02
    rec = done["searches"][system]
    # one calibration run per rate, before its first measured run; loads before each run
    rates = [r for r, _ in rec["samples"]]
    assert len(rates) == len(set(rates)) == len(found["judged"])
    assert len(rec["loads"]) == len(rec["runs"]) + len(rec["samples"])
    # a far-under rate run once, others three times; then three more at each end of
    # the bracket, in turn (interleave)
    counts = {r: sum(1 for q, _ in rec["runs"] if q == r) for r in rates}
    lo, hi = found["max_rate"], found["bound"]
    assert [q for q, _ in rec["runs"][-6:]] == [lo, hi] * 3 and found["settled"]
    assert counts[lo] - 3 in (1, 3) and counts[hi] == 6
    assert {c for r, c in counts.items() if r not in (lo, hi)} <= {1, 3}
  assert len(saves) == 4   # after each system's unloaded point and each search


def test_prediction_starts_at_the_measured_crossing_and_is_judged(fake_runs):
  fake_runs["saturation"] = {"paged": 30.0, "orca_max": 12.0}
  fake_runs["model_scale"] = 1.03   # the model sustains 3% more
  f = _config()
  done = search.measured_search(f, _stream, {})
  predicted = search.predicted_search(f, _stream, model=None, done=done)
  first_predicted = {s: next(r for k, q, r in fake_runs["calls"]
                             if k == "predicted" and q == s and r != f.unloaded_rate)
                     for s in f.systems}
  for s in f.systems:
    assert first_predicted[s] == pytest.approx(done["searches"][s]["found"]["crossing"])
  res = search.judge(done, predicted)["systems"]
  for s in f.systems:
    sat = fake_runs["saturation"][s]
    want = (true_crossing(1.03 * sat, predicted["slo_s_per_token"])
            / true_crossing(sat, done["slo_s_per_token"]) - 1)
    assert res[s]["rel_error"] == pytest.approx(want, abs=0.01)
    assert res[s]["measured_censored"] is None and res[s]["predicted_censored"] is None
    assert res[s]["predicted"]["load_factor"] == [1.0]


def test_never_saturating_within_the_bracket_limit_is_censored_not_zero(fake_runs):
  f = _config(max_rates=4)
  fake_runs["saturation"] = {"paged": 1e6, "orca_max": 20.0}   # paged: beyond 24 x 1.5^3
  done = search.measured_search(f, _stream, {})
  assert done["searches"]["paged"]["found"]["censored"] == "above"
  res = search.judge(done, search.predicted_search(f, _stream, None, done))["systems"]
  assert res["paged"]["rel_error"] is None and res["paged"]["measured_censored"] == "above"
  assert res["paged"]["measured_max_rate"] == pytest.approx(24.0 * 1.5 ** 3)
  assert res["orca_max"]["rel_error"] == pytest.approx(0.0, abs=0.01)
  assert max(r for k, s, r in fake_runs["calls"] if s == "paged" and k == "measured") \
      <= f.max_rate


def test_a_stopped_search_resumes_from_what_it_saved(fake_runs):
  fake_runs["saturation"] = {"paged": 30.0, "orca_max": 12.0}
  f = _config()
  done = search.measured_search(f, _stream, {})
  partial = {"unloaded": done["unloaded"], "searches": {"paged": done["searches"]["paged"]}}
  fake_runs["calls"].clear()
  search.measured_search(f, _stream, partial)
  assert {s for _, s, _ in fake_runs["calls"]} == {"orca_max"}
  assert partial["slo_s_per_token"] == done["slo_s_per_token"]


def test_auto_rates_flag_rules():
  assert perf_validation.Config().auto
  assert perf_validation.Config(rates=(8.0, 16.0)).max_rate == 16.0
  f = perf_validation.Config(start_rate=10.0, max_rates=3)
  assert f.max_rate == pytest.approx(10.0 * search.SEARCH_STEP ** 2)
  with pytest.raises(ValueError, match="--rates must be auto or a list"):
    perf_validation.Config(rates=("auto", 8.0))
  with pytest.raises(ValueError, match="max_rates"):
    perf_validation.Config(max_rates=1)


def test_the_measured_file_round_trips_a_search(tmp_path, fake_runs):
  fake_runs["saturation"] = {"paged": 30.0, "orca_max": 12.0}
  f = _config()
  done = search.measured_search(f, _stream, {})
  for key in ("unloaded", "searches"):   # real StepShapes for the file
    for rec in done[key].values():
      rec["samples"] = [[r, _shapes()] for r, _ in rec["samples"]]
  path = tmp_path / perf_validation.MEASURED_FILE
  perf_validation._write_measured(path, f, done)
  back = perf_validation._read_measured(str(path), _config(measured_from=str(path)))
  assert back["searches"]["paged"]["samples"] == done["searches"]["paged"]["samples"]
  assert back["slo_s_per_token"] == done["slo_s_per_token"]
  with pytest.raises(ValueError, match="other flags: start_rate"):
    perf_validation._read_measured(str(path), _config(start_rate=20.0))


def _shapes():
  from paged_jax import perf
  return [(perf.StepShape.decode([20, 30], bucket_tokens=8, bucket_rows=8), 0.004)]


def test_load_factors_read_the_measured_runs_own_steps_around_the_crossing():
  from paged_jax.bench import calibration
  from paged_jax.bench import engines
  model = calibration.cpu_model(engines.tiny_model()[0])
  shape = _shapes()[0][0]
  t = model.step_seconds(shape)
  steps = lambda k: [(shape, k * t)]
  found = {"max_rate": 30.0, "bound": 31.0, "censored": None}
  search_rec = {"found": found, "samples": [[20.0, steps(9)], [30.0, steps(3)], [31.0, steps(3)]],
                "run_samples": [[20.0, steps(9)], [30.0, steps(1.5)], [31.0, steps(2.5)]]}
  unloaded = {"samples": [[8.0, steps(4)]], "run_samples": [[8.0, steps(1.2)]]}
  done = {"unloaded": {"paged": unloaded}, "searches": {"paged": search_rec}}
  got = search.load_factors(_config(systems=("paged",)), model, done)["paged"]
  assert got == pytest.approx({"unloaded": 1.2, "search": 2.0})
  cal = search.load_factors(_config(systems=("paged",), load_from="calibration"), model, done)
  assert cal["paged"] == pytest.approx({"unloaded": 4.0, "search": 3.0})
  del search_rec["run_samples"]   # --truth=wall keeps no steps of the measured runs
  assert search.load_factors(_config(systems=("paged",)), model, done)["paged"]["search"] \
      == pytest.approx(3.0)


def test_one_run_the_machine_was_taken_from_does_not_set_the_speed():
  # perf_validation one_thread_3: one of six paged runs at the crossing paid 7x the CPU a
  # step; pooled, its steps made the model 1.74x slower and the prediction 54% low.
  from paged_jax.bench import calibration
  from paged_jax.bench import engines
  model = calibration.cpu_model(engines.tiny_model()[0])
  shape = _shapes()[0][0]
  t = model.step_seconds(shape)
  steps = lambda k, n=10: [(shape, k * t)] * n
  found = {"max_rate": 30.0, "bound": 31.0, "censored": None}
  runs = [[30.0, steps(1.0)], [30.0, steps(1.1)], [30.0, steps(0.9)], [31.0, steps(1.0)],
          [31.0, steps(7.0)], [31.0, steps(1.05)]]
  done = {"unloaded": {"paged": {"samples": [], "run_samples": [[8.0, steps(1.0)]]}},
          "searches": {"paged": {"found": found, "samples": [], "run_samples": runs}}}
  got = search.load_factors(_config(systems=("paged",)), model, done)["paged"]["search"]
  assert got == pytest.approx(1.025)            # the median of the six runs' factors
  pooled = calibration.load_factor(model, [x for r in search.crossing_runs(
      done["searches"]["paged"], "run_samples") for x in r])
  assert pooled == pytest.approx(2.0083, rel=1e-3)   # what the pooled rule read


def test_the_measured_file_keeps_run_steps_only_around_the_crossing():
  found = {"max_rate": 30.0, "bound": 31.0, "censored": None}
  rec = {"found": found, "run_samples": [[20.0, [1]], [30.0, [2]], [31.0, [3]], [30.0, [4]]]}
  done = search.keep_crossing_steps({"searches": {"paged": rec}})
  assert done["searches"]["paged"]["run_samples"] == [[30.0, [2]], [31.0, [3]], [30.0, [4]]]
  censored = {"found": dict(found, censored="above"), "run_samples": [[20.0, [1]]]}
  assert search.keep_crossing_steps({"searches": {"a": censored}})["searches"]["a"][
      "run_samples"] == [[20.0, [1]]]


def test_judge_reads_the_measured_crossing_at_the_median_runs_speed():
  # The machine slowed during the search's last runs: at the bracket's low end two of
  # three runs took 1.3x the fit's seconds, at the high end two ran at 0.8x. Each run's
  # latency is what the same queue pays at that speed (time dilation), so the search's
  # medians read the low end over the SLO and the high end under it, where the machine at
  # one speed crosses at 30.5 req/s. Read at the median run's speed, the crossing is 30.5.
  from paged_jax.bench import calibration
  from paged_jax.bench import engines
  model = calibration.cpu_model(engines.tiny_model()[0])
  shape = _shapes()[0][0]
  t, slo, known, slope = model.step_seconds(shape), 0.01, 30.5, 0.3
  lat = lambda rate, k: k * slo * np.exp(slope * (rate * k - known))   # at speed k
  plan = [(30.0, 1.3), (31.0, 0.8), (30.0, 1.3), (31.0, 0.8), (30.0, 1.0), (31.0, 1.0)]
  runs = [[r, {"normalized_latency_s_per_token": lat(r, k)}] for r, k in plan]
  found = {"max_rate": 30.0, "bound": 31.0, "censored": None, "crossing": 30.2,
           "monotone": False}
  rec = {"found": found, "runs": runs,
         "run_samples": [[r, [(shape, k * t)] * 5] for r, k in plan]}
  done = {"searches": {"paged": rec}, "slo_s_per_token": slo,
          "unloaded": {"paged": {"latency": slo / 3}}}
  pred = {"searches": {"paged": {"found": {"censored": None, "crossing": 31.0, "max_rate":
                                           30.5}, "runs": [[31.0, runs[0][1]]]}},
          "load_factor": {"paged": {"search": 1.0}}, "slo_s_per_token": slo,
          "unloaded": {"paged": {"latency": slo / 3}}}
  got = search.judge(done, pred, model)["systems"]["paged"]
  assert got["measured_speed_normalized"]["ref"] == pytest.approx(1.0)
  assert got["measured_max_rate"] == pytest.approx(known)
  assert got["rel_error"] == pytest.approx(31.0 / known - 1)
  assert got["measured_raw_crossing"] == 30.2
  assert got["rel_error_raw"] == pytest.approx(31.0 / 30.2 - 1)
  no_model = search.judge(done, pred)["systems"]["paged"]   # --truth=wall's rule
  assert no_model["measured_max_rate"] == 30.2 and no_model["measured_speed_normalized"] is None


def test_quick_replaces_the_flags_it_names_and_records_them():
  f = perf_validation.Config(quick=True, systems=("orca_pow2",), repeats=5)
  for name, value in perf_validation.QUICK.items():
    assert getattr(f, name) == value and f.flags()[name] == value
  assert f.flags()["quick"] is True and f.auto   # the rest is untouched
  assert perf_validation.Config().systems == perf_validation.serving_sweep.SYSTEMS


@pytest.mark.slow
def test_quick_run_judges_or_censors_every_system(tmp_path):
  """The real --quick run on this CPU: every system's max rate is either judged (both
  crossings found, an error reported) or reported censored with its bound, never 0%."""
  result = perf_validation.run(perf_validation.Config(quick=True, out=str(tmp_path)), tmp_path)
  assert set(result["systems"]) == set(perf_validation.QUICK["systems"])
  for name, v in result["systems"].items():
    if v["rel_error"] is None:
      assert name in result["censored"]
      assert v["measured_censored"] or v["predicted_censored"]
    else:
      assert v["rel_error"] == pytest.approx(v["predicted_max_rate"] / v["measured_max_rate"] - 1)
  assert result["flags"]["quick"] and result["load_avg"]["samples"]
