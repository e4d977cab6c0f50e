"""serving_benchmark --endpoint=auto: paged's Poisson streams in-process and through
`python -m paged_jax.serve`, side by side. Properties: every request of every stream
comes back over HTTP with its output length, the HTTP curve has the contract's keys at
the same rates, and the cost it reports is the difference of the two mean latencies."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("httpx")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_endpoint_auto_runs_the_same_streams_over_http(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  subprocess.run([sys.executable, "-m", "experiments.serving_benchmark", "--workload=alpaca",
                  "--rates=3", "--duration_s=2", "--systems=paged", "--seed=1",
                  "--kv_budget_tokens=512", "--max_seqs_cap=4", "--block_size=16",
                  "--endpoint=auto", f"--out={tmp_path}"], cwd=ROOT, env=env, check=True,
                 timeout=1200, capture_output=True)
  res = json.loads((tmp_path / "serving_benchmark.json").read_text())
  local, http = res["systems"]["paged"], res["http"]["systems"]["paged_http"]
  assert http["rates"] == local["rates"] == [3.0]
  assert http["requests"] == local["requests"]
  for key in ("normalized_latency_s_per_token", "ttft_p50_s", "tpot_p99_s",
              "throughput_req_s"):
    assert len(http[key]) == 1 and http[key][0] > 0
  assert res["http"]["http_cost_s_per_request"] == pytest.approx(
      [h - l for h, l in zip(http["mean_latency_s"], local["mean_latency_s"])])
  assert "--max_seqs=" + str(local["max_seqs"]) in res["http"]["server_flags"]


def test_bad_endpoint_is_a_one_line_error():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-m", "experiments.serving_benchmark",
                      "--endpoint=localhost:8000", "--rates=2"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode != 0 and "--endpoint must be an http(s) URL or auto" in p.stderr
  assert "Traceback" not in p.stderr
