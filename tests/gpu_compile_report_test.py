"""experiments/gpu_compile_report end to end on one Triton configuration, compiled for the
compile-only H200 (skipped without XLA's CUDA compiler wheels): the row holds a launch
with no spills, and its modelled time is the K/V bytes over H200's bandwidth. Under jax
< 0.11.2 the Mosaic GPU part is skipped and the reason recorded."""

import json
import os
import subprocess
import sys

import pytest

from pallas_kernels.deviceless import mosaic_configs
from pallas_kernels.deviceless import target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = "decode:llama8b:bfloat16:bs16:B64xctx4096"


@pytest.mark.skipif(target.unavailable_reason() is not None,
                    reason=str(target.unavailable_reason()))
def test_one_triton_config_compiles_without_spills(tmp_path):
  subprocess.run([sys.executable, "-m", "experiments.gpu_compile_report",
                  "--backends=triton,mosaic_gpu", f"--only={CASE}", f"--out={tmp_path}"],
                 cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True,
                 capture_output=True, timeout=600)
  result = json.loads((tmp_path / "gpu_compile_report.json").read_text())
  (row,) = result["rows"]
  assert row["case"] == CASE and not result["failures"] and not row["spilled"]
  (launch,) = row["launches"]
  # The compile runs with XLA's fail-on-spill option, so a spill fails it outright. The
  # ptxas report of registers and spills is in jax 0.10.2's dump; under 0.11.2 it is not
  # (spill_bytes None there), and occupancy, which needs the registers, neither.
  assert launch["spill_bytes"] in (0, None)
  if launch["spill_bytes"] is not None:
    assert 0 < launch["occupancy"] <= 1
  assert launch["shared_memory"] <= result["target"]["shared_memory_per_block_optin"]
  assert row["modelled_time_us"] == pytest.approx(
      1e6 * row["kv_bytes_read"] / result["target"]["hbm_bytes_per_s"])
  if mosaic_configs.unavailable_reason() is not None:
    assert "mosaic_gpu" in result["skipped"]
    assert not (tmp_path / "mosaic_gpu_compile_report.json").exists()
