"""experiments.serving_benchmark end to end at tiny sizes (virtual step clock: no wall-clock
assertion) and its JSON contract. Its one-line errors for bad flags: tests/cli_errors_test."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from paged_jax.bench import arrivals

ROOT = pathlib.Path(__file__).resolve().parents[1]
CURVE_KEYS = ("rates", "normalized_latency_s_per_token", "ttft_p50_s", "ttft_p99_s",
              "tpot_p50_s", "tpot_p99_s", "throughput_req_s")


def _run(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, "-m", "experiments.serving_benchmark", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_tiny_run_writes_the_contract_json(tmp_path):
  rates, duration, seed = [3.0, 6.0], 1.5, 2
  proc = _run("--workload=alpaca", "--rates=6,3", f"--duration_s={duration}",
              "--systems=paged,orca_max", f"--seed={seed}", "--clock=step", "--step_s=0.02",
              "--kv_budget_tokens=512", "--max_seqs_cap=4", "--block_size=64",
              f"--out={tmp_path}", timeout=900)
  # 64-token blocks: one block-table width bucket, few step shapes per system.
  assert proc.returncode == 0, proc.stderr[-2000:]
  res = json.loads((tmp_path / "serving_benchmark.json").read_text())
  assert (tmp_path / "serving_benchmark.png").stat().st_size > 1000
  assert set(res["systems"]) == {"paged", "orca_max"} == set(res["max_rate_at_slo"])
  assert isinstance(res["slo_s_per_token"], float) and res["slo_s_per_token"] > 0
  for name, c in res["systems"].items():
    assert c["rates"] == rates
    for k in CURVE_KEYS:
      assert len(c[k]) == len(rates), (name, k)
    # Every accepted request finished: one latency per arrival of the seeded stream.
    assert c["requests"] == [arrivals.arrival_times(r, duration, seed).size for r in rates]
    assert res["max_rate_at_slo"][name] in [0.0] + rates
  # Orca(Max) with 512 slots and max_len 256 runs at most 2 requests at once.
  assert max(res["systems"]["orca_max"]["max_running"]) <= 2
  assert res["sizes"]["orca_max"]["max_seqs"] == 2
  for key in ("flags", "versions", "machine", "slo_rule", "sizing_rule", "clock"):
    assert key in res
  assert res["flags"]["rates"] == [6.0, 3.0] and res["flags"]["seed"] == seed
  # The step clock does not see compile time: no ahead-of-time warm-up (shapes compile
  # on first use; tests/serving_warmup_test.py covers the wall-clock warm-up).
  for c in res["systems"].values():
    assert c["warm_up_shapes"] == [0, 0] and c["step_traces_in_run"][0] >= 1


@pytest.mark.slow
def test_sharegpt_real_stream_for_the_benchmark():
  from paged_jax.bench import sharegpt_trace
  from paged_jax.bench import sweep
  if sharegpt_trace.available():
    pytest.skip(sharegpt_trace.available())
  reqs = sweep.rate_stream("sharegpt-real", 4.0, 5.0, 0, 256, 40)
  times = arrivals.arrival_times(4.0, 5.0, 0)
  assert [r.arrival_time for r in reqs] == list(times)
  assert all(r.total_len <= 256 and max(r.prompt_token_ids) < 256 for r in reqs)


def test_step_clock_standin_schedules_as_the_model(monkeypatch):
  # On the step clock every step costs --step_s and no request stops early, so the
  # sweep runs the stand-in forward at one compiled shape; its figures must be the tiny
  # model's, which runs when make_engine ignores `standin` / `shape_buckets`.
  from experiments import serving_benchmark as sb
  from paged_jax.bench import engines
  f = sb.Config(workload="alpaca", rates=(3.0, 6.0), duration_s=1.5, systems=("paged", "orca_max"),
                seed=2, clock="step", step_s=0.02, kv_budget_tokens=512, max_seqs_cap=4,
                block_size=64)
  got = sb.sweep(f, f.systems, f.rates, f.duration_s, {})
  real = engines.make_engine
  made = []

  def model_engine(**kw):
    made.append((kw.pop("standin", False), kw.pop("shape_buckets", True)))
    return real(**kw)
  monkeypatch.setattr(engines, "make_engine", model_engine)
  want = sb.sweep(f, f.systems, f.rates, f.duration_s, {})
  assert made and all(m == (True, False) for m in made)   # the stand-in was asked for
  for name in f.systems:
    for k in CURVE_KEYS + ("requests", "max_running"):
      assert got["systems"][name][k] == want["systems"][name][k], (name, k)
