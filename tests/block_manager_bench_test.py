"""experiments.block_manager_bench end to end at a tiny size (jit, fused and host paths agree)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_run_writes_results_and_paths_agree(tmp_path):
  # The bench asserts itself that the jitted and host (BlockModel) allocators end with the
  # same lengths, free counts and copy-on-write counts; forks make copies happen.
  subprocess.run(
      [sys.executable, "-m", "experiments.block_manager_bench", "--batch=8",
       "--num_blocks_list=32,128", "--iters=12", "--warmup=4", "--chunk=4",
       "--recycle_width=8", "--fork_prob=0.3", "--cpu_cores=0", f"--out={tmp_path}"],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True, capture_output=True,
      timeout=600)
  result = json.loads((tmp_path / "block_manager_bench.json").read_text())
  assert [r["num_blocks"] for r in result["results"]] == [32, 128]
  assert all(r["copy_on_write_copies"] > 0 for r in result["results"])
  assert result["meta"]["flags"]["fork_prob"] == 0.3 and "jax" in result["meta"]["versions"]
