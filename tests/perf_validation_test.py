"""experiments.perf_validation's pieces: calibration samples survive the measured file, the
group statistic, a refit refuses another run's measurement, and the stand-in engine without
shape buckets is charged the shapes the bucketed engine runs (bench.calibration)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import perf_validation
from paged_jax import perf
from paged_jax.bench import calibration
from paged_jax.bench import validation


def _samples():
  a = perf.StepShape.from_rows([(16, 16), (1, 40)], bucket_tokens=64, bucket_rows=8)
  b = perf.StepShape.decode([20, 30, 31], sampled_rows=2, bucket_tokens=8, bucket_rows=8)
  return [(a, 0.010), (a, 0.012), (a, 0.050), (b, 0.004)]


def test_samples_round_trip_through_dicts():
  samples = _samples()
  back = calibration.samples_from_dicts(calibration.samples_as_dicts(samples))
  assert back == samples


def test_grouped_takes_the_median_or_the_mean_of_like_steps():
  samples = _samples()
  med = dict((s.new_tokens, t) for s, t in calibration.grouped(samples, stat="median"))
  mean = dict((s.new_tokens, t) for s, t in calibration.grouped(samples, stat="mean"))
  assert med[(16, 1)] == 0.012 and mean[(16, 1)] == pytest.approx(0.024)
  assert med[(1, 1, 1)] == mean[(1, 1, 1)] == 0.004
  with pytest.raises(ValueError, match="stat must be"):
    calibration.grouped(samples, stat="max")
  assert calibration.group_sizes(samples) == [3, 1]     # grouped's order: a, then b


def test_fit_cpu_weighs_each_group_by_its_steps():
  # Steps of a CPU-like cost (3 ms a step + 100 us a row) measured 10% dear at one row,
  # in 200 steps, and right at 4-32 rows, one step each. Weighed by steps the fit follows
  # the 200 (0.3% here); weighed by groups, the one-step groups pull it further off (1.3%).
  from paged_jax.config import ModelConfig
  cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, dtype="float32")
  truth = calibration.cpu_model(cfg)
  truth = truth.replace(efficiency=truth.efficiency.replace(pass_overhead_s=3e-3,
                                                            row_host_s=100e-6))
  rng = np.random.default_rng(7)
  samples = []
  for rows, copies, dear in ((1, 200, 1.1), (4, 1, 1.0), (8, 1, 1.0), (16, 1, 1.0),
                             (24, 1, 1.0), (32, 1, 1.0), (12, 1, 1.0), (20, 1, 1.0)):
    shape = perf.StepShape.decode(rng.integers(16, 200, size=rows), bucket_tokens=32)
    samples += [(shape, dear * truth.step_seconds(shape))] * copies
  one = samples[0][0]
  by_steps = calibration.fit_cpu(cfg, samples, stat="mean")
  by_groups = calibration.fit_cpu(cfg, samples, stat="mean", weigh="groups")
  measured_one = 1.1 * truth.step_seconds(one)
  err = lambda fit: abs(fit.model.step_seconds(one) / measured_one - 1)
  assert err(by_steps) < 0.005 and err(by_groups) > 2 * err(by_steps)
  with pytest.raises(ValueError, match="weigh must be one of"):
    calibration.fit_cpu(cfg, samples, weigh="time")


def test_measured_file_round_trips_and_refuses_other_flags(tmp_path):
  f = perf_validation.Config(systems=("paged", "orca_max"), rates=(8.0,))
  curves = {"paged": {"rates": [8.0], "normalized_latency_s_per_token": [0.01]}}
  done = {"measured": curves, "samples": {"paged": [_samples()]}, "loads": {"paged": [1.5]},
          "late": {"paged": [0.001]}}
  path = tmp_path / perf_validation.MEASURED_FILE
  perf_validation._write_measured(path, f, done)
  # Another group statistic, SLO or system list: the same measurement serves.
  same = perf_validation.Config(systems=("paged",), rates=(8.0,), measured_from=str(path),
                                group_stat="median", slo_factor=2.0)
  assert perf_validation._read_measured(str(path), same) == done
  other = perf_validation.Config(systems=("paged",), rates=(16.0,), measured_from=str(path))
  with pytest.raises(ValueError, match="other flags: rates"):
    perf_validation._read_measured(str(path), other)


def test_load_factor_scales_the_fit_to_what_the_steps_paid():
  model = calibration.cpu_model(_tiny_config())
  shapes = [s for s, _ in _samples()]
  slow = [(s, 3.0 * model.step_seconds(s)) for s in shapes]      # a machine 3x slower
  k = calibration.load_factor(model, slow)
  assert k == pytest.approx(3.0)
  three = calibration.scaled(model, k)
  for s in shapes:
    assert three.step_seconds(s) == pytest.approx(3.0 * model.step_seconds(s))
  assert calibration.load_factor(model, []) == 1.0
  with pytest.raises(ValueError, match="factor must be"):
    calibration.scaled(model, 0.0)


def test_point_factors_use_the_calibration_before_and_after_each_point():
  model = calibration.cpu_model(_tiny_config())
  shape = _samples()[0][0]
  t = model.step_seconds(shape)
  per_rate = [[(shape, 1.0 * t)], [(shape, 3.0 * t)], [(shape, 2.0 * t)]]
  f = perf_validation.Config(systems=("paged",), rates=(1.0, 2.0, 3.0))
  got = perf_validation.point_factors(f, model, {"paged": per_rate})["paged"]
  assert got == pytest.approx([2.0, 2.5, 2.0])
  run = perf_validation.Config(systems=("paged",), rates=(1.0, 2.0, 3.0), load_scope="run")
  assert perf_validation.point_factors(run, model, {"paged": per_rate})["paged"] == [1.0] * 3


def _tiny_config():
  from paged_jax.config import ModelConfig
  return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.mark.slow
def test_unbucketed_standin_is_charged_the_bucketed_engines_shapes():
  """Same greedy requests on the bucketed and the one-shape stand-in engine: the same
  steps, and `bucketed_step` gives each the padded shape the bucketed engine reports."""
  from paged_jax.bench import engines
  from paged_jax.engine import SamplingParams, buckets as buckets_lib
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, int(n)).tolist() for n in (5, 40, 17, 90, 3, 60)]
  outs = (6, 30, 12, 4, 25, 9)
  shapes = {}
  for bucketed in (True, False):
    engine = engines.make_engine(block_size=16, kv_budget_tokens=256, max_seqs=8,
                                 standin=True, shape_buckets=bucketed)
    to_step = calibration.bucketed_step(
        buckets_lib.step_buckets(engine.cache_config, engine.max_num_batched_tokens,
                                 engine.decode_steps_per_sync), 16)
    for p, n in zip(prompts, outs):
      engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0))
    got = []
    while engine.has_unfinished():
      engine.step()
      rep = engine.last_step
      got.append(perf.StepShape.from_report(rep, block_size=16, padding=True) if bucketed
                 else to_step(rep))
    shapes[bucketed] = got
  assert len(shapes[True]) > 10
  assert shapes[True] == shapes[False]
  assert any(s.bucket_tokens < 256 for s in shapes[True])   # buckets below the largest


def test_step_time_errors_compare_mean_steps_per_point():
  measured = {"engine_step_s": [2.0, 3.0, None], "steps": [100, 100, 10]}
  predicted = {"model_s": [1.0, 6.0, 1.0], "steps": [50, 200, 10]}
  got = validation.step_time_errors(measured, predicted)
  assert got[0] == pytest.approx(0.0) and got[1] == pytest.approx(0.0) and got[2] is None


def test_step_time_errors_never_read_the_standins_own_wall_time():
  # A predicted point's "device_s" is the stand-in engine's wall time in its jitted call
  # (run_point's engine timing), not the model clock's seconds: no error from it.
  measured = {"step_s": [0.002, 0.004], "steps": [100, 100]}
  got = validation.step_time_errors(measured, {"device_s": [0.2, 0.4], "steps": [100, 100]})
  assert got == [None, None]


def test_median_curve_takes_each_points_median_and_keeps_the_repeats():
  runs = [{"rates": [8.0, 16.0], "normalized_latency_s_per_token": [v, 10 * v],
           "steps": [s, s], "step_cpu_s": [0.004, 0.005], "max_seqs": 7, "note": ["a", "b"]}
          for v, s in ((0.01, 100), (0.03, 300), (0.02, 200))]
  got = validation.median_curve(runs)
  assert got["normalized_latency_s_per_token"] == pytest.approx([0.02, 0.2])
  assert got["steps"] == [200.0, 200.0] and got["rates"] == [8.0, 16.0]
  assert got["max_seqs"] == 7 and got["note"] == ["a", "b"]
  assert [r["normalized_latency_s_per_token"][0] for r in got["repeats"]] == [0.01, 0.03, 0.02]
  spread = validation.repeat_spread(got)
  assert spread == pytest.approx([2.0, 2.0])            # 0.03 / 0.01 - 1 at both points
  assert validation.repeat_spread(validation.median_curve(runs[:1])) == [None] * 2


def test_single_run_crossings_read_each_repeats_own_curve():
  # Three runs at 30 and 32 req/s, one at 20 (a far-under rate judged by one run); SLO 1.
  curve = {"rates": [20.0, 30.0, 32.0],
           "latency_runs": [[0.2], [0.5, 0.9, 3.0], [2.0, 1.1, 5.0]]}
  got = validation.single_run_crossings(curve, 1.0)
  # Curve 0: 0.5 at 30, 2.0 at 32 -> 30 + 0.5 / 1.5 x 2; curve 1: 0.9 -> 1.1;
  # curve 2: 3.0 at 30 is the first miss -> between 20 (0.2) and 30.
  assert got == pytest.approx([30 + 2 / 3, 31.0, 20 + 0.8 / 2.8 * 10])
  assert validation.crossing_spread(got) == pytest.approx(
      (31.0 - (20 + 8 / 2.8)) / (30 + 2 / 3))   # (max - min) / median
  assert validation.crossing_spread([31.0, None]) is None
  assert validation.single_run_crossings({"rates": [], "latency_runs": []}, 1.0) == []


def test_step_time_errors_use_the_truths_mean_step_when_there():
  measured = {"step_s": [0.002, 0.004], "steps": [100, 100],
              "engine_step_s": [9.0, 9.0]}                # ignored: step_s is the truth's
  predicted = {"model_s": [0.3, 0.4], "device_s": [9.0, 9.0], "steps": [100, 100]}
  got = validation.step_time_errors(measured, predicted)
  assert got == pytest.approx([0.5, 0.0])


def test_truth_clocks_keep_wall_and_cpu_seconds_per_step():
  from paged_jax.bench import clocks
  from paged_jax.bench.clocks import StepSample
  for truth, name in (("cpu", "cpu"), ("wall", "wall")):
    clock = calibration.truth_clock(truth)
    assert clock.name == name and not clock.virtual
    clock.start()
    clock.stepped(StepSample())
    clock.wait_until(clock.now() + 0.001)
    clock.stepped(StepSample())
    assert len(clock.wall_s) == len(clock.cpu_s) == 2
  assert isinstance(calibration.recording_clock("cpu", 16), clocks.CpuClock)
  assert isinstance(calibration.recording_clock("wall", 16), clocks.WallClock)
  with pytest.raises(ValueError, match="truth must be one of"):
    calibration.truth_clock("gpu")


def test_compare_marks_a_curve_still_under_the_slo_at_the_highest_rate():
  rates = [8.0, 16.0, 32.0]
  mk = lambda lat: {"rates": rates, "normalized_latency_s_per_token": lat, "steps": [9] * 3}
  measured = {"a": mk([0.01, 0.02, 0.05]), "b": mk([0.01, 0.012, 0.02])}   # SLO 0.03
  predicted = {"a": mk([0.01, 0.02, 0.025]), "b": mk([0.01, 0.02, 0.04])}
  got = validation.compare(measured, predicted, 3.0)["systems"]
  assert got["a"]["predicted_censored"] and not got["a"]["measured_censored"]
  assert got["a"]["predicted_max_rate"] == 32.0 and got["a"]["rel_error"] > 0
  assert got["b"]["measured_censored"] and got["b"]["rel_error"] is None
  assert not got["b"]["predicted_censored"] and got["b"]["predicted_max_rate"] < 32.0


def test_a_measured_file_from_before_the_truth_flag_reads_as_wall_one_run(tmp_path):
  import gzip
  import json
  f = perf_validation.Config(systems=("paged",), rates=(8.0,))
  done = {"measured": {"paged": {"rates": [8.0]}}, "samples": {"paged": [_samples()]},
          "loads": {"paged": [1.0]}, "late": {"paged": []}}
  path = tmp_path / perf_validation.MEASURED_FILE
  perf_validation._write_measured(path, f, done)
  with gzip.open(path, "rt") as fh:
    blob = json.load(fh)
  del blob["flags"]["truth"], blob["flags"]["repeats"]
  with gzip.open(path, "wt") as fh:
    json.dump(blob, fh)
  old = perf_validation.Config(systems=("paged",), rates=(8.0,), truth="wall", repeats=1)
  assert perf_validation._read_measured(str(path), old)["loads"] == {"paged": [1.0]}
  with pytest.raises(ValueError, match="other flags: truth, repeats"):
    perf_validation._read_measured(str(path), f)


def test_one_xla_thread_reruns_the_process_with_the_flag_once(monkeypatch):
  """--xla_threads=one re-runs the process with ONE_THREAD appended to XLA_FLAGS (read
  when the backend starts); with it there, or with =all (the default), it runs."""
  calls = []

  def execv(path, args):
    calls.append((path, args, perf_validation.os.environ["XLA_FLAGS"]))
    raise SystemExit(0)
  monkeypatch.setattr(perf_validation.os, "execv", execv)
  monkeypatch.setattr(perf_validation, "run", lambda f, out: (_ for _ in ()).throw(
      RuntimeError("ran")))
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  monkeypatch.setattr(perf_validation.sys, "argv", ["pv", "--quick"])
  one = perf_validation.Config(xla_threads="one")
  with pytest.raises(SystemExit):
    perf_validation.main(one, None)
  (path, args, flags), = calls
  assert path == args[0] == perf_validation.sys.executable
  assert args[1:] == ["-m", "experiments.perf_validation", "--quick"]
  assert flags == "--xla_dump_to=/tmp/x " + perf_validation.ONE_THREAD
  for env, f in ((flags, one), ("", perf_validation.Config())):
    monkeypatch.setenv("XLA_FLAGS", env)
    with pytest.raises(RuntimeError, match="ran"):
      perf_validation.main(f, None)
  assert len(calls) == 1


def _dilated_runs(plan, known=30.5, slope=0.3, slo=0.01, ref=1.0):
  """(rates, latencies, factors) of runs at (rate, factor): one queue whose latency at
  speed `ref` meets `slo` at `known` req/s, run at speed factor (time dilation)."""
  lat = lambda r, k: k / ref * slo * np.exp(slope * (r * k / ref - known))
  return [r for r, _ in plan], [lat(r, k) for r, k in plan], [k for _, k in plan]


def test_speed_normalized_crossing_recovers_the_crossing_at_the_median_speed():
  plan = [(30.0, 1.3), (31.0, 0.8), (30.0, 1.3), (31.0, 0.8), (30.0, 1.1), (31.0, 1.1)]
  rates, lats, factors = _dilated_runs(plan, ref=1.1)
  got = validation.speed_normalized_crossing(rates, lats, factors, 0.01)
  assert got["ref"] == pytest.approx(1.1) and got["censored"] is None
  assert got["crossing"] == pytest.approx(30.5) and got["slope"] == pytest.approx(0.3)
  assert got["runs"] == 6 and got["dropped"] == 0 and got["extrapolated"] is False
  # The runs' own latencies (no speed read) put the slow low end over the SLO and the
  # fast high end under it: the medians do not even rise with the rate.
  med = lambda r: np.median([x for q, x in zip(rates, lats) if q == r])
  assert med(30.0) > 0.01 > med(31.0)



def test_speed_normalized_crossing_reads_at_the_speed_it_is_given():
  # The same queue crosses at 30.5 req/s at speed 1.0; its runs' median speed is 1.1. A
  # prediction made at 1.0 (--load_from=calibration) is compared with the runs read at 1.0.
  plan = [(30.0, 1.3), (31.0, 0.8), (30.0, 1.1), (31.0, 1.1), (30.0, 1.2)]
  rates, lats, factors = _dilated_runs(plan)
  at_median = validation.speed_normalized_crossing(rates, lats, factors, 0.01)
  assert at_median["crossing"] == pytest.approx((30.5 - np.log(1.1) / 0.3) / 1.1)
  at_one = validation.speed_normalized_crossing(rates, lats, factors, 0.01, ref=1.0)
  assert at_one["ref"] == 1.0 and at_one["crossing"] == pytest.approx(30.5)
  assert at_one["dropped"] == at_median["dropped"] == 0   # the band is the median's
  with pytest.raises(ValueError, match="ref must be finite numbers > 0"):
    validation.speed_normalized_crossing(rates, lats, factors, 0.01, ref=0.0)


def test_speed_normalized_crossing_leaves_out_a_run_the_machine_moved_within():
  plan = [(30.0, 1.0), (31.0, 0.9), (30.0, 1.05), (31.0, 1.0), (31.0, 1.1)]
  rates, lats, factors = _dilated_runs(plan)
  # A run at 31 req/s that paid 3.2x a step at its end: its latency is not one speed's.
  rates, lats, factors = rates + [31.0], lats + [0.5], factors + [3.2]
  got = validation.speed_normalized_crossing(rates, lats, factors, 0.01)
  assert got["dropped"] == 1 and got["runs"] == 5
  ref = got["ref"]   # 1.025: at that speed steps and latencies are 2.5% longer
  assert got["crossing"] == pytest.approx((30.5 - np.log(ref) / 0.3) / ref)
  kept_all = validation.speed_normalized_crossing(rates, lats, factors, 0.01, band=10.0)
  assert kept_all["dropped"] == 0 and abs(kept_all["crossing"] / 30.5 - 1) > 0.05


def test_speed_normalized_crossing_censors_what_it_cannot_read():
  rates, lats, factors = _dilated_runs([(30.0, 1.0), (31.0, 1.0)])
  assert validation.speed_normalized_crossing(rates, lats, factors, 0.01)["censored"] == \
      "too few runs"
  flat = validation.speed_normalized_crossing([30, 31, 30, 31], [0.02, 0.01, 0.02, 0.01],
                                              [1.0] * 4, 0.015)
  assert flat["censored"] == "flat" and flat["crossing"] is None
  with pytest.raises(ValueError, match="factors must be finite numbers > 0"):
    validation.speed_normalized_crossing([30.0], [0.01], [0.0], 0.01)
  with pytest.raises(ValueError, match="one entry per run"):
    validation.speed_normalized_crossing([30.0, 31.0], [0.01], [1.0], 0.01)
