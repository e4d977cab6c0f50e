"""experiments.rate_points: point parsing, the merged curve's crossings, flag errors; and
end to end on a panel made here (a tiny `--rates=auto` serving_benchmark run, paged, step
clock, 12 requests): the rerun of the panel's first point reads its committed latency
exactly (the engine and the virtual clock are deterministic), and the new points join the
curve in rate order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments import rate_points
from paged_jax.bench import latency

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_points_reads_system_at_rate_and_names_the_flag_on_a_bad_one():
  assert rate_points.parse_points(["paged@2.05", "orca_max@0.5"]) == [("paged", 2.05),
                                                                      ("orca_max", 0.5)]
  for bad in ("paged", "paged@", "paged@x", "paged@-1", "paged@inf", "vllm@2"):
    with pytest.raises(ValueError, match="--points"):
      rate_points.parse_points([bad])


def _panel():
  return {"slo_s_per_token": 0.1, "systems": {
      "paged": {"rates": [1.0, 2.0, 4.0], "normalized_latency_s_per_token": [0.05, 0.08, 0.4]},
      "orca_oracle": {"rates": [1.0, 2.0], "normalized_latency_s_per_token": [0.06, 0.3]}}}


def test_new_points_sharpen_the_crossing_the_panel_interpolated():
  panel = _panel()
  new = {"paged": {3.0: 0.09}, "orca_oracle": {1.5: 0.2}}
  got = rate_points.merged_crossings(panel, new)
  assert got["curves"]["paged"]["rates"] == [1.0, 2.0, 3.0, 4.0]
  # Independent reading: linear between the two merged points around the SLO.
  paged = 3.0 + (0.1 - 0.09) / (0.4 - 0.09) * (4.0 - 3.0)
  oracle = 1.0 + (0.1 - 0.06) / (0.2 - 0.06) * (1.5 - 1.0)
  assert got["max_rate_at_slo_interpolated"]["paged"] == pytest.approx(paged)
  assert got["max_rate_at_slo_interpolated"]["orca_oracle"] == pytest.approx(oracle)
  assert got["paged_rate_ratio"]["paged_over_orca_oracle"] == pytest.approx(paged / oracle)
  assert got["max_rate_at_slo"] == {"paged": 3.0, "orca_oracle": 1.0}
  # Without new points it reads what the panel's own curve reads.
  same = rate_points.merged_crossings(panel, {})
  c = panel["systems"]["paged"]
  want = latency.max_rate_at_slo(c["rates"], c["normalized_latency_s_per_token"], 0.1)
  assert same["max_rate_at_slo_interpolated"]["paged"] == want["interpolated"]


def test_a_panel_that_did_not_search_its_rates_is_refused():
  panel = {"flags": {"rates": [2.0, 4.0], "workload": "sharegpt"}}
  with pytest.raises(ValueError, match="--panel"):
    rate_points._panel_config(panel)
  with pytest.raises(ValueError, match="--panel: flags"):
    rate_points._panel_config({"flags": {"rates": ["auto"], "no_such_flag": 1}})


def test_flags_are_checked_before_any_work():
  with pytest.raises(ValueError, match="--panel"):
    rate_points.Config(points=("paged@1",))
  with pytest.raises(ValueError, match="--points"):
    rate_points.Config(panel="x.json", points=("paged@zero",))


def _run(*args):
  proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc.stdout


@pytest.mark.slow   # 13-27 s on 2 cores: the panel's search, then three points again
def test_new_points_on_a_tiny_panel(tmp_path):
  _run("experiments.serving_benchmark", "--workload=alpaca", "--rates=auto",
       "--num_requests=12", "--max_points=2", "--systems=paged", "--clock=step",
       "--step_s=0.02", "--kv_budget_tokens=512", "--max_seqs_cap=4", "--block_size=64",
       f"--out={tmp_path / 'panel'}")
  panel = json.loads((tmp_path / "panel" / "serving_benchmark.json").read_text())
  lo, hi = panel["systems"]["paged"]["rates"][:2]
  points = [round(lo + (hi - lo) * x, 3) for x in (0.3, 0.7)]
  stdout = _run("experiments.rate_points", f"--panel={tmp_path / 'panel'}/serving_benchmark.json",
                "--points=" + ",".join(f"paged@{r}" for r in points), f"--out={tmp_path}")
  res = json.loads((tmp_path / "rate_points.json").read_text())
  check = res["check_point"]
  assert check["system"] == "paged" and check["rerun"] == check["committed"]
  assert [(p["system"], p["rate"]) for p in res["points"]] == [("paged", r) for r in points]
  curve = res["curves"]["paged"]
  assert curve["rates"] == sorted(panel["systems"]["paged"]["rates"] + points)
  assert len(curve["normalized_latency_s_per_token"]) == len(curve["rates"])
  assert res["slo_s_per_token"] == panel["slo_s_per_token"]
  assert "paged:" in stdout
