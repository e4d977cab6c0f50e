"""experiments.paper_scale --jobs: the suite's parts in worker processes give the same
results as one after another in one process (virtual time: only measured host seconds
and compile counts may differ), and a failing part fails the run naming it."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Keys whose values are measured on the host (seconds, compile counts, where and when it
# ran), not results of the virtual-time runs; "out": the output directory (a flag).
HOST_KEYS = {"seconds", "cost", "engine_step_s", "device_s", "host_s", "step_traces_in_run",
             "warm_up_compiled", "warm_up_shapes", "versions", "machine", "code", "out"}

SMALL = ["--figs=12,13,14,19", "--fig12_models=opt-13b", "--fig12_workloads=sharegpt",
         "--systems=paged,orca_oracle", "--num_requests=40", "--max_points=2",
         "--fig13_panels=opt-13b-sharegpt", "--fig14_modes=n2", "--fig18_block_sizes=16,64",
         "--fig19_block_sizes=16,64", "--compilation_cache=none"]


def _run(out, *flags):
  return subprocess.run([sys.executable, "-m", "experiments.paper_scale", f"--out={out}",
                         *flags], cwd=ROOT, capture_output=True, text=True, timeout=1800)


def diff(a, b, path="") -> list:
  """Leaves where JSON trees `a` and `b` differ, HOST_KEYS skipped ([] when equal)."""
  if isinstance(a, dict) and isinstance(b, dict):
    if set(a) != set(b):
      return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
    return [d for k in a if k not in HOST_KEYS for d in diff(a[k], b[k], f"{path}/{k}")]
  if isinstance(a, list) and isinstance(b, list):
    if len(a) != len(b):
      return [f"{path}: {len(a)} vs {len(b)} items"]
    return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
  same = a == b or (isinstance(a, float) and isinstance(b, float)
                    and math.isnan(a) and math.isnan(b))
  return [] if same else [f"{path}: {a!r} vs {b!r}"]


def test_diff_skips_host_keys_and_finds_every_other_leaf():
  a = {"x": [1.0, {"seconds": 3, "y": "s"}], "cost": {"wall_s": 1}}
  assert diff(a, {"x": [1.0, {"seconds": 9, "y": "s"}], "cost": {}}) == []
  assert diff(a, {"x": [1.5, {"seconds": 3, "y": "t"}], "cost": {}}) == [
      "/x[0]: 1.0 vs 1.5", "/x[1]/y: 's' vs 't'"]


@pytest.mark.slow
def test_two_workers_give_the_serial_results_leaf_for_leaf(tmp_path):
  serial, parallel = tmp_path / "jobs1", tmp_path / "jobs2"
  for out, jobs in ((serial, 1), (parallel, 2)):
    r = _run(out, *SMALL, f"--jobs={jobs}")
    assert r.returncode == 0, r.stderr[-3000:]
  files = sorted(p.relative_to(serial) for p in serial.rglob("*.json"))
  assert {str(p) for p in files} >= {"fig12/opt-13b-sharegpt/serving_benchmark.json",
                                     "fig13.json", "fig14.json", "fig19.json", "summary.json"}
  assert files == sorted(p.relative_to(parallel) for p in parallel.rglob("*.json"))
  for rel in files:
    a, b = (json.loads((d / rel).read_text()) for d in (serial, parallel))
    if rel.name == "summary.json":
      assert a["rows"] == b["rows"]
      ra, rb = a["runs"][-1], b["runs"][-1]
      assert (ra["jobs"], rb["jobs"]) == (1, 2) and set(ra["parts"]) == set(rb["parts"])
      assert {p["worker"] for p in rb["parts"].values()} == {0, 1}
      continue
    assert diff(a, b) == [], rel


@pytest.mark.slow
def test_a_failing_part_fails_the_run_in_one_line_keeping_the_finished_parts(tmp_path):
  # Fig. 16's panels run first (the longest parts), then Fig. 18's points; the Alpaca-like
  # one reads a committed Fig. 12 panel that has no max rate.
  bad = tmp_path / "fig12" / "opt-13b-alpaca" / "serving_benchmark.json"
  bad.parent.mkdir(parents=True)
  bad.write_text(json.dumps({"note": "no rates"}))
  r = _run(tmp_path, "--figs=16,18", "--fig18_block_sizes=16", "--num_requests=30",
           "--max_points=2", "--jobs=2", "--compilation_cache=none")
  assert r.returncode == 1, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: part fig18/alpaca/16 failed: KeyError: "
                         "'max_rate_at_slo_interpolated'"), last
  assert list(tmp_path.glob("fig16/*/serving_benchmark.json"))    # finished before it
  assert not (tmp_path / "fig18.json").exists() and not (tmp_path / "summary.json").exists()
