"""The paper-scale harness: deployments (paged_jax.bench.paper_scale), the rate search
(paged_jax.bench.rate_search), and serving_benchmark --clock=model end to end (slow)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from paged_jax import perf
from paged_jax.bench import paper_scale
from paged_jax.bench import rate_search

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model,gpu,tp", [("opt-13b", "a100-40gb", 1),
                                          ("opt-66b", "a100-40gb", 4),
                                          ("opt-175b", "a100-80gb", 8)])
def test_settings_take_table1_gpus_and_budgets(model, gpu, tp):
  s = paper_scale.setting(model, gpu)
  table = perf.catalog.PAPER_TABLE1[(model, gpu, tp)]
  assert s.tp == tp and s.max_len == 2048
  assert s.kv_budget_tokens(16) % 16 == 0
  assert abs(s.kv_budget_tokens(16) / table["kv_slots"] - 1) < 0.1
  d = s.as_dict()
  assert d["paper_table1"] == table and d["efficiency"]["weight_bandwidth"]["source"]


def test_settings_without_a_table1_entry_take_the_fewest_gpus_that_hold_a_context():
  assert paper_scale.setting("llama-13b", "a100-40gb").tp == 1
  assert paper_scale.setting("opt-66b", "a100-80gb").tp == 2
  assert paper_scale.setting("opt-175b", "h200").tp == 4
  with pytest.raises(ValueError, match="leaves no KV memory on 1 x a100-40gb"):
    paper_scale.setting("opt-66b", "a100-40gb", tp=1)
  with pytest.raises(ValueError, match="leaves no KV memory on 2 x a100-40gb"):
    paper_scale.setting("opt-66b", "a100-40gb", tp=2)
  with pytest.raises(ValueError, match="gpu must be one of"):
    paper_scale.setting("opt-13b", "v100")


def test_engine_is_the_real_engine_with_the_standin_forward():
  s = paper_scale.setting("opt-13b", "a100-40gb")
  engine = s.make_engine(block_size=16, kv_budget_tokens=s.kv_budget_tokens(16), max_seqs=4)
  assert engine.cache_config.num_slots == s.kv_budget_tokens(16)
  assert engine.cache_config.num_layers == 1 and engine.max_model_len == 2048
  assert engine.max_num_batched_tokens == paper_scale.PAPER.max_num_batched_tokens
  clock = s.clock(16)
  assert clock.virtual and clock.block_size == 16
  with pytest.raises(ValueError, match="multiple of block_size=16"):
    s.make_engine(block_size=16, kv_budget_tokens=1000)


def _knee(capacity, slo_rate):
  """A latency curve that rises past `capacity` and crosses 1.0 at `slo_rate`."""
  def lat(r):
    return 0.2 + 0.8 * max(0.0, r - capacity) / (slo_rate - capacity)
  return lat


@pytest.mark.parametrize("start", [0.5, 3.0, 40.0])
def test_bracket_and_bisect_finds_the_crossing_from_any_start(start):
  lat = _knee(4.0, 6.0)
  calls = []
  curve = rate_search.bracket_and_bisect(lambda r: calls.append(r) or lat(r), start, 1.0,
                                         step=1.5, rel_tol=0.1, max_points=12)
  rates = [r for r, _ in curve]
  assert rates == sorted(set(calls))
  lo = max(r for r, v in curve if v <= 1.0)
  hi = min(r for r, v in curve if v > 1.0)
  assert lo <= 6.0 < hi and hi / lo <= 1.1


def test_bracket_and_bisect_stops_at_max_points():
  curve = rate_search.bracket_and_bisect(lambda r: 0.0, 1.0, 1.0, max_points=4)
  assert [r for r, _ in curve] == [1.0, 1.5, 2.25, 3.375]    # never misses: 4 points
  with pytest.raises(ValueError, match="start rate"):
    rate_search.bracket_and_bisect(lambda r: 0.0, 0.0, 1.0)


def test_search_systems_sets_one_slo_and_starts_from_hints():
  caps = {"paged": 8.0, "orca": 2.0}
  seen = []

  def run(system, rate, n):
    seen.append((system, rate, n))
    if math.isinf(rate):   # a burst: half the capacity finished per second
      return {"summary": {"throughput_req_s": caps[system] / 2,
                          "normalized_latency_s_per_token": 9.0}}
    lat = _knee(caps[system], 1.5 * caps[system])(rate) * 0.05
    return {"summary": {"throughput_req_s": min(rate, caps[system]),
                        "normalized_latency_s_per_token": lat}}

  found = rate_search.search_systems(["paged", "orca"], run, num_requests=50, slo_factor=3.0,
                                     start_hint=lambda s, r: r * caps[s] / caps["paged"],
                                     rel_tol=0.05, max_points=10)
  assert found["slo_s_per_token"] == pytest.approx(3 * 0.05 * 0.2)   # unloaded: 0.01 s/token
  assert seen[1] == ("paged", 4.0 * rate_search.UNLOADED_FRACTION, 24)
  assert found["start_rate"]["paged"] == rate_search.PROBE_FACTOR * 4.0
  # 0.05 x knee = 3 x 0.01 where 0.8 (r - cap) / (0.5 cap) = 0.4: r = 1.25 cap.
  for s, cap in caps.items():
    assert found["max_rate_at_slo_interpolated"][s] == pytest.approx(cap * 1.25, rel=0.05)
    assert found["rates"][s] == sorted(found["rates"][s])
  assert not any(r == math.inf for s, r, _ in seen if s == "orca")   # one probe, paged's


@pytest.mark.slow
def test_serving_benchmark_model_clock_is_deterministic_and_writes_the_contract(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  args = ["-m", "experiments.serving_benchmark", "--clock=model", "--model=opt-13b",
          "--gpu=a100-40gb", "--rates=auto", "--workload=alpaca", "--num_requests=40",
          "--systems=paged,orca_max", "--kv_budget_tokens=2048", "--max_len=256",
          f"--compilation_cache={tmp_path / 'xla'}"]
  results = []
  for k in range(2):
    out = tmp_path / f"run{k}"
    proc = subprocess.run([sys.executable, *args, f"--out={out}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results.append(json.loads((out / "serving_benchmark.json").read_text()))
  a, b = results
  same = ("rates", "normalized_latency_s_per_token", "ttft_p99_s", "tpot_p50_s",
          "throughput_req_s", "steps", "preemptions", "mean_running")   # not wall seconds
  for name in a["systems"]:
    assert {k: a["systems"][name][k] for k in same} == {k: b["systems"][name][k] for k in same}
  assert a["max_rate_at_slo"] == b["max_rate_at_slo"]
  assert a["device_model"]["model"]["name"] == "opt-13b" and a["kv_budget_tokens"] == 2048
  for name in ("paged", "orca_max"):
    c = a["systems"][name]
    assert c["rates"] == sorted(c["rates"]) and c["requests"] == [40] * len(c["rates"])
  assert a["max_rate_at_slo"]["paged"] > a["max_rate_at_slo"]["orca_max"] > 0


def test_swap_vs_recompute_model_swaps_small_blocks_slowly():
  from experiments import paper_figures
  s = paper_scale.setting("opt-13b", "a100-40gb")
  rows = paper_figures.swap_vs_recompute(s, block_sizes=(1, 4, 16, 64, 256), tokens=1024)
  swaps = [r["swap_s"] for r in rows]
  assert swaps == sorted(swaps, reverse=True) and swaps[0] > 5 * swaps[-1]
  assert len({r["recompute_s"] for r in rows}) == 1
  # 1,024 tokens of OPT-13B's 800 KB over PCIe at least, one prefill of them at most.
  assert swaps[-1] >= 1024 * 800 * 1024 / perf.GPUS["a100-40gb"].pcie_bandwidth
  assert rows[0]["recompute_s"] == pytest.approx(
      s.device_model.step_seconds(perf.StepShape.prefill([1024])))


def test_batched_requests_reads_each_systems_highest_rate():
  from experiments import paper_figures
  res = {"systems": {
      "paged": {"rates": [2.0, 4.0, 3.0], "mean_running": [10.0, 40.0, 30.0],
                "max_running": [12, 50, 40]},
      "orca_max": {"rates": [1.0, 0.5], "mean_running": [8.0, 4.0], "max_running": [9, 5]}}}
  out = paper_figures.batched_requests(res)
  assert out["paged"]["rate"] == 4.0 and out["orca_max"]["mean_running"] == 8.0
  assert out["orca_max"]["paged_over"] == 5.0 and out["paged"]["paged_over"] == 1.0


class _Report:
  def __init__(self, ok=True, dispatches=1):
    self.ok, self.dispatches, self.bucket = ok, dispatches, None
    self.prefill_chunks, self.decode_rows, self.decode_loop_rows = ((8, 8),), ((1, 20),), ()
    self.cow_copies = self.swapped_blocks = 0
    self.generated_tokens = 2


def test_recording_wall_clock_charges_each_step_the_loop_time_since_the_last_mark():
  from paged_jax.bench import calibration
  from paged_jax.bench.clocks import StepSample
  clock = calibration.RecordingWallClock(16)
  clock.stepped(StepSample(0, report=_Report()))
  clock.wait_until(clock.now() + 0.01)          # a wait is not a step's cost
  clock.stepped(StepSample(0, report=_Report()))
  clock.stepped(StepSample(0, report=_Report(ok=False)))   # ran nothing: not a sample
  clock.stepped(StepSample(0, report=None))
  assert len(clock.samples) == 2 and len(clock.wake_late_s) == 1
  assert all(0 <= t < 0.01 for _, t in clock.samples)
  assert clock.samples[0][0].new_tokens == (1, 8) and not clock.virtual


def test_fig13_needs_its_panels_and_reads_the_highest_points_at_load_zero():
  from experiments import paper_scale as ps
  from experiments import paper_scale_parts as parts
  panel = {"systems": {"paged": {"rates": [2.0, 4.0], "mean_running": [10.0, 40.0],
                                 "max_running": [12, 50]},
                       "orca_max": {"rates": [1.0], "mean_running": [8.0],
                                    "max_running": [9]}}}
  [task] = parts.tasks(ps.Config(figs=("13",), fig13_load=0.0), {"opt-66b-sharegpt": panel})
  old = task.fn(*task.args, **task.kwargs)
  assert old["opt-66b-sharegpt"]["orca_max"]["paged_over"] == 5.0
  with pytest.raises(ValueError, match="--fig13_panels opt-13b-sharegpt, opt-13b-alpaca "
                     "have no Fig. 12 run"):
    parts.tasks(ps.Config(figs=("13",)), {"opt-66b-sharegpt": panel})


def test_parts_wait_for_the_panels_this_run_makes_and_read_the_others():
  """Fig. 13 / 18 / 19 take paged's rate from the OPT-13B Fig. 12 panels: a panel this run
  makes is an input (the part waits for it), one already in --out an argument, none at
  all the fallback rate."""
  from experiments import paper_scale as ps
  from experiments import paper_scale_parts as parts
  f = ps.Config(figs=("12", "13", "18", "19"), fig12_models=("opt-13b",),
                fig12_workloads=("sharegpt",), fig13_panels=("opt-13b-sharegpt",),
                fig18_block_sizes=(16, 64), fig19_block_sizes=(32,))
  alpaca = {"max_rate_at_slo_interpolated": {"paged": 100.0}, "max_rate_at_slo": {}}
  tasks = {t.name: t for t in parts.tasks(f, {"opt-13b-alpaca": alpaca})}
  assert list(tasks) == ["fig12/opt-13b-sharegpt", "fig13/opt-13b-sharegpt",
                         "fig18/sharegpt/16", "fig18/sharegpt/64", "fig18/alpaca/16",
                         "fig18/alpaca/64", "fig19/32"]
  for name in ("fig13/opt-13b-sharegpt", "fig18/sharegpt/16", "fig19/32"):
    assert tasks[name].inputs == {"panel": "fig12/opt-13b-sharegpt"}
  assert tasks["fig18/alpaca/64"].inputs == {} and tasks["fig18/alpaca/64"].kwargs == {
      "panel": alpaca}
  assert tasks["fig18/alpaca/64"].args == (f, "alpaca", 64)
  assert parts.fixed_rate(alpaca, "alpaca", 0.9) == 90.0
  assert parts.fixed_rate(None, "sharegpt", 0.9) == parts.FALLBACK_RATE["sharegpt"]
  # Every part has a cost; OPT-175B ShareGPT-like, the longest, is scheduled first.
  every = parts.tasks(ps.Config(), {})
  assert len(every) == 6 + 2 + 6 + 2 + 18 + 6
  assert all(t.name in parts.PART_COST_S for t in every)
  from experiments import task_graph
  first = task_graph.simulate(every, 2)["order"][:2]
  assert {o[0] for o in first} == {"fig12/opt-175b-sharegpt", "fig12/opt-13b-sharegpt"}


def test_figures_are_assembled_from_complete_parts_only():
  from experiments import paper_scale as ps
  from experiments import paper_scale_parts as parts
  f = ps.Config(figs=("18", "19"), fig18_block_sizes=(16, 64), fig19_block_sizes=(32,))
  row = lambda w, b: {"workload": w, "block_size": b}
  res = {f"fig18/{w}/{b}": row(w, b) for w in ("sharegpt", "alpaca") for b in (64, 16)}
  got = parts.figures(f, res)
  assert "fig19" not in got      # its one part has not finished
  assert got["fig18"] == {w: [row(w, 16), row(w, 64)] for w in ("sharegpt", "alpaca")}
  got = parts.figures(f, dict(res, **{"fig19/32": [{"m": "recompute"}, {"m": "swap"}]}))
  assert got["fig19"]["end_to_end"] == [{"m": "recompute"}, {"m": "swap"}]
  assert [r["block_size"] for r in got["fig19"]["microbenchmark"]] == [16, 64]
  del res["fig18/alpaca/16"]
  assert "fig18" not in parts.figures(f, res)


@pytest.mark.slow
def test_batched_at_rate_runs_every_system_at_one_rate():
  """Fig. 13 at one rate: the same stream for both systems; Orca(Max)'s 2,048-token
  reservations cap its batch at what its memory holds (7), paged batches more."""
  from experiments import paper_figures
  s = paper_scale.setting("opt-13b", "a100-40gb")
  kv = s.kv_budget_tokens(16)
  panel = {"num_requests": 16, "kv_budget_tokens": kv, "systems": {"paged": {}, "orca_max": {}},
           "sizes": {"paged": {"max_seqs": 16, "pool_tokens": kv},
                     "orca_max": {"max_seqs": 7, "pool_tokens": kv + 7 * 16}}}
  out = paper_figures.batched_at_rate(s, panel, "sharegpt", rate=50.0)
  assert {v["rate"] for v in out.values()} == {50.0}
  assert out["paged"]["requests"] == out["orca_max"]["requests"] == 16
  assert out["orca_max"]["max_running"] <= 7 < out["paged"]["max_running"]
  assert out["orca_max"]["paged_over"] > 1.0 and out["paged"]["paged_over"] == 1.0
  for v in out.values():   # the per-step counts behind both means
    run, wait = v["running_per_step"], v["waiting_per_step"]
    assert len(run) == len(wait) == v["steps"]
    assert sum(run) / len(run) == pytest.approx(v["mean_running"])
    assert v["steps_waiting"] == sum(w > 0 for w in wait)
  # Orca(Max) is full (7) whenever a request waits (16 arrive within a second, each long);
  # paged's memory holds all 16: nothing waits once they are in.
  assert out["orca_max"]["steps_waiting"] > 0
  assert out["orca_max"]["mean_running_while_waiting"] == pytest.approx(7, abs=0.5)
  assert out["paged"]["steps_waiting"] < out["orca_max"]["steps_waiting"]


def test_saturated_batch_is_the_mean_over_steps_with_a_queue():
  from experiments import paper_figures
  rng = np.random.default_rng(8)
  run, wait = rng.integers(0, 9, 200), rng.integers(0, 3, 200) * rng.integers(0, 2, 200)
  got = paper_figures.saturated_batch(run, wait)
  busy = [r for r, w in zip(run.tolist(), wait.tolist()) if w > 0]
  assert got["steps_waiting"] == len(busy)
  assert got["mean_running_while_waiting"] == pytest.approx(sum(busy) / len(busy))
  assert got["mean_waiting"] == pytest.approx(sum(wait.tolist()) / 200)
  assert math.isnan(paper_figures.saturated_batch([3, 4], [0, 0])["mean_running_while_waiting"])


def test_fig14_mode_keeps_compiled_steps_across_its_systems_and_merges_earlier_modes(
    monkeypatch):
  """A Fig. 14 mode runs both systems without dropping the compiled steps in between
  (their engines share two geometries; the part's end drops them), records its cost, and
  the figure keeps an earlier run's modes it does not redo."""
  from experiments import paper_scale as ps
  from experiments import paper_scale_parts as parts
  calls = []

  def fake_sweep(cfg, systems, rates, duration_s, mode, *, release=True):
    calls.append((tuple(systems), dict(mode), release, cfg.preemption_mode))
    return {"systems": {s: {"rates": [1.0, 2.0]} for s in systems},
            "max_rate_at_slo": {"paged": 4.0, "orca_oracle": 2.0}, "slo_s_per_token": 0.1}

  monkeypatch.setattr(parts.sb, "sweep", fake_sweep)
  f = ps.Config(fig14_modes=("n2", "n4"))
  modes = {m: parts.fig14_mode(f, m) for m in ("n4", "n2")}
  assert calls == [(("paged", "orca_oracle"), {"n": 4}, False, "recompute"),
                   (("paged", "orca_oracle"), {"n": 2}, False, "recompute")]
  out = parts.fig14_merged(f, modes, {"beam2": {"old": True}, "n2": {"old": True}})
  assert list(out) == ["n2", "n4", "beam2"] and out["beam2"] == {"old": True}
  assert out["n4"]["paged_rate_ratio"]["paged_over_orca_oracle"] == 2.0
  assert out["n4"]["cost"]["points"] == 4 and out["n4"]["cost"]["cpu_s"] >= 0
  assert out["n4"]["mode"] == {"n": 4}