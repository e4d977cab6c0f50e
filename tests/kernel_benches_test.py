"""experiments/kernel_bench (its CPU path) and experiments/ragged_bench (--dry_run, the kernel
interpreted) at tiny sizes: the paged and contiguous paths attend to the same values, the
kernels agree with the reference, and the K/V bytes counted are the shapes'. (Times are
not asserted; gpu_check.sh runs both at size on a GPU.)"""

import json

import pytest

from experiments import kernel_bench
from experiments import ragged_bench


@pytest.mark.slow   # ~16 s on 2 cores: the interpreted kernel's accuracy check compiles
def test_kernel_bench_cpu_paged_equals_contiguous(tmp_path):
  f = kernel_bench.Config(batch=(1, 2), context=(64,), block_size=(16,), repeats=2)
  kernel_bench.main(f, tmp_path)
  res = json.loads((tmp_path / "kernel_bench.json").read_text())
  meta = res["meta"]
  assert meta["backend"] == "cpu" and meta["kernel_rel_err_bf16"] < 1e-2
  assert [(r["batch"], r["context"], r["block_size"]) for r in res["results"]] == [
      (1, 64, 16), (2, 64, 16)]
  for r in res["results"]:
    # K and V of every token, all KV heads, float32.
    assert r["kv_bytes"] == 2 * r["batch"] * 64 * meta["num_kv_heads"] * meta["head_dim"] * 4
    paged = r["timings"]["reference_paged"]
    assert paged["rel_err_vs_contiguous"] < 1e-6 and paged["median_s"] > 0
    assert r["timings"]["reference_contiguous"]["samples"] == 2


@pytest.mark.slow   # ~22 s on 2 cores: the kernel and its variants interpreted
def test_ragged_bench_dry_run_checks_agree(tmp_path):
  f = ragged_bench.Config(dry_run=True, scenarios=("decode64", "mixed"), block_size=(16,))
  ragged_bench.main(f, tmp_path)
  res = json.loads((tmp_path / "ragged_bench.json").read_text())
  assert res["meta"]["interpret"]
  assert [(r["scenario"], r["block_size"]) for r in res["results"]] == [
      ("decode64", 16), ("mixed", 16)]
  for r in res["results"]:
    checks = r["checks"]
    assert checks["paged_vs_contiguous_rel_err"] < 1e-6
    assert checks["kernel_vs_reference_rel_err"] < 1e-4
    assert r["timings"]["ragged_paged"]["median_s"] > 0
  decode = res["results"][0]
  assert decode["num_tokens"] == decode["num_seqs"]      # one new token per sequence
  assert decode["checks"]["decode_kernel_vs_ragged_rel_err"] < 1e-4
