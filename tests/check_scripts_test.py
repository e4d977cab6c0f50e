"""experiments/gpu_check.sh and tpu_check.sh (with experiments/check_lib.sh, which both
source) parse, and record each step's outcome, with a stub in place of python.

The stub exits 1 (or 3, SKIP_RC of the TPU check) when its arguments name a chosen step's
module, and 0 otherwise; the summary table and the exit status must follow.
"""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = ("gpu_check.sh", "tpu_check.sh")
STUB = """#!/bin/bash
case "$*" in *generate*) echo '{"outputs": [[1]]}' ;; esac
case "$*" in *"$STUB_FAIL"*)
  for a in "$@"; do [[ $a == --attention_backend=* ]] && echo "must be one of (x), got '${a#*=}'" >&2; done
  exit "$STUB_RC";;
esac
"""


@pytest.mark.parametrize("script", SCRIPTS + ("check_lib.sh",))
def test_script_parses(script):
  proc = subprocess.run(["bash", "-n", str(ROOT / "experiments" / script)],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr


def _run(tmp_path, script, fail, rc):
  stub = tmp_path / "python"
  stub.write_text(STUB)
  stub.chmod(0o755)
  out = tmp_path / "out"
  env = dict(os.environ, OUT=str(out), PYTHON=str(stub), STUB_FAIL=fail, STUB_RC=str(rc))
  proc = subprocess.run(["bash", str(ROOT / "experiments" / script), "--dry-run"], env=env,
                        capture_output=True, text=True, timeout=120, check=False)
  table = {line.split()[0]: line.split()[1] for line in
           (out / "summary.txt").read_text().splitlines()}
  return proc, table


@pytest.mark.parametrize("script,fail,rc,step,status,exit_status", [
    ("gpu_check.sh", "no step", 0, "engine", "ok", 0),
    ("gpu_check.sh", "experiments.kernel_bench", 1, "kernel_bench", "FAIL", 1),
    ("gpu_check.sh", "experiments.ragged_bench", 3, "ragged_bench", "FAIL", 1),
    ("tpu_check.sh", "experiments.tpu_kernel_bench", 1, "kernel_bench", "FAIL", 1),
    ("tpu_check.sh", "pallas_interpret:tpu", 3, "engine", "SKIP", 0),
])
def test_steps_record_their_outcome(tmp_path, script, fail, rc, step, status, exit_status):
  proc, table = _run(tmp_path, script, fail, rc)
  assert table[step] == status, table
  assert set(table.values()) <= {"ok", status}, table   # the other steps still ran, ok
  assert proc.returncode == exit_status, proc.stdout[-2000:]
  assert proc.stdout.splitlines()[-len(table):] == (tmp_path / "out" / "summary.txt"
                                                    ).read_text().splitlines()
