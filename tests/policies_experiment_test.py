"""experiments/policies at tiny sizes: one row per (scheduling, eviction) pair with the
reported fields, every request served, priority classes split; the run's JSON carries
its flags and provenance and renders into the docs' table."""

import json

import pytest

from experiments import policies


@pytest.mark.slow   # ~35 s: four engines
def test_tiny_run_writes_rows_for_every_pair(tmp_path):
  f = policies.Config(num_requests=24, rates=(50.0,), head_len=32, num_tasks=3, task_len_min=16,
                      task_len_max=48, max_len=192, max_seqs=4, kv_budget_tokens=512,
                      output_mean=6.0, scheduling=("fcfs", "priority"),
                      eviction=("lru", "protect_shallow"), out=str(tmp_path))
  policies.main(f, tmp_path)
  doc = json.loads((tmp_path / "policies.json").read_text())
  pairs = [(r["scheduling"], r["eviction"]) for r in doc["rows"]]
  assert pairs == [("fcfs", "lru"), ("fcfs", "protect_shallow"), ("priority", "lru"),
                   ("priority", "protect_shallow")]
  for r in doc["rows"]:
    assert 0.0 < r["hit_rate"] < 1.0 and r["throughput_req_s"] > 0
    assert r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert sum(c["requests"] for c in r["by_priority"].values()) == 24
  # Under load (all 24 within half a second, 4 slots), class 0 waits less with priority.
  prio = doc["rows"][2]["by_priority"]
  assert prio["0"]["ttft_p50_s"] < prio["1"]["ttft_p50_s"]
  assert doc["flags"]["num_requests"] == 24 and "versions" in doc and "machine" in doc
  assert len(policies.summary_rows(doc)) == 4
