"""The CPU-runnable parts of the TPU check (experiments/tpu_check.sh) and the TPU reports.

No TPU is at hand: the script is prepared for one. Here it must parse, its kernel
benchmark must run end to end in the TPU interpreter (--dry_run) and write the JSON the
script collects, and the compile report must write its JSON where libtpu is installed.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from pallas_kernels.tpu import compile_target

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args, tmp_path, timeout=900):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-m", *args, f"--out={tmp_path}",
                         "--compilation_cache=none"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_tpu_check_script_parses():
  proc = subprocess.run(["bash", "-n", str(ROOT / "experiments" / "tpu_check.sh")],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr


def test_kernel_bench_refuses_to_time_the_cpu(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-m", "experiments.tpu_kernel_bench",
                         f"--out={tmp_path}"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: no TPU here")


@pytest.mark.slow
def test_kernel_bench_dry_run_writes_its_rows(tmp_path):
  _run(["experiments.tpu_kernel_bench", "--dry_run"], tmp_path)
  result = json.loads((tmp_path / "tpu_kernel_bench.json").read_text())
  methods = {(r["scenario"].split(":")[0], r["method"]) for r in result["rows"]}
  assert {("decode", "ours_decode"), ("decode", "ours_ragged"), ("decode", "jax_decode"),
          ("mixed", "ours_ragged")} <= methods
  assert all(r.get("us", 0) > 0 for r in result["rows"]), result["rows"]
  assert result["note"].startswith("dry run")


@pytest.mark.slow
@pytest.mark.skipif(compile_target.unavailable_reason() is not None,
                    reason=str(compile_target.unavailable_reason()))
def test_compile_report_writes_vmem_beside_jax(tmp_path):
  _run(["experiments.tpu_compile_report", "--only=v5e:decode"], tmp_path)
  result = json.loads((tmp_path / "tpu_compile_report.json").read_text())
  (row,) = result["rows"]
  assert row["ours"]["vmem_bytes"] > 0 and row["jax_rpa_matched"]["vmem_bytes"] > 0
  assert not result["failures"]
