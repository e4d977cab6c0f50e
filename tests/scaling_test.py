"""experiments/scaling end to end at a tiny size on 2 simulated CPU devices (a subprocess:
the experiment sets the device count before JAX starts). Asserted are the memory figures,
which are the result: a fixed per-device budget buys tp times the blocks, a fixed pool
splits tp ways, and the tensor-parallel engine generates every requested token."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow   # 16-45 s on 2 cores: an engine and a decode forward compile per tp
def test_tp2_doubles_the_blocks_of_a_per_device_budget(tmp_path):
  subprocess.run(
      [sys.executable, "-m", "experiments.scaling", "--tp=1,2", "--num_devices=2",
       "--kv_mib_per_device=0.5", "--num_requests=4", "--max_output=4",
       "--max_seqs=8", "--decode_batch=2", "--timing_iters=1", f"--out={tmp_path}"],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True, capture_output=True,
      timeout=600)
  result = json.loads((tmp_path / "scaling.json").read_text())
  one, two = result["rows"]
  assert (one["tp"], one["devices"], two["tp"], two["devices"]) == (1, 1, 2, 2)
  assert two["num_blocks"] == 2 * one["num_blocks"]
  assert two["kv_bytes_per_device"] == one["kv_bytes_per_device"]   # the same budget
  assert 2 * two["fixed_pool_bytes_per_device"] == one["fixed_pool_bytes_per_device"]
  assert two["fit_full_length"] >= one["fit_full_length"]
  for r in (one, two):
    assert r["generated_tokens"] > 0 and r["peak_running"] >= 1 and r["step_seconds"] > 0
  assert one["generated_tokens"] == two["generated_tokens"]   # same stream, greedy
  prod = result["production_shape"]["rows"]
  assert prod[1]["num_blocks"] == 2 * prod[0]["num_blocks"]
  assert (tmp_path / "scaling.png").stat().st_size > 0
