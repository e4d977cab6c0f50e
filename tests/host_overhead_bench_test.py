"""experiments/host_overhead_bench at a tiny size: every path (the host-side Python
allocator, the engine at k = 1 / 4 / 16 decode steps per sync, with and without prefix
caching) generates the same greedy tokens, and k decode steps per sync cut the jitted calls.
(Times are not asserted: a loaded 2-core machine makes them noise at this size.)"""

import json
import math

import pytest

from experiments import host_overhead_bench


@pytest.mark.slow   # ~60 s on 2 cores: six paths compile
def test_paths_agree_and_multistep_cuts_device_calls(tmp_path):
  f = host_overhead_bench.Config(num_seqs=2, prompt_len=4, max_tokens=8, block_size=4,
                                 hidden_size=16, repeats=1)
  host_overhead_bench.main(f, tmp_path)
  written = json.loads((tmp_path / "host_overhead.json").read_text())
  assert written["meta"]["num_seqs"] == 2
  res = written["results"]
  assert set(res) == {"python_allocator", "in_jit_k1", "in_jit_k4", "in_jit_k16",
                      "in_jit_k1_prefix_cache", "in_jit_k4_prefix_cache"}
  assert all(r["same_tokens_as_python_allocator"] for r in res.values())
  assert all(r["tokens"] == 2 * 8 for r in res.values())
  # One prefill then one call per decode step at k = 1; fewer calls with k steps per sync.
  calls = {name: r["device_calls"] for name, r in res.items()}
  assert calls["python_allocator"] == 8
  assert calls["in_jit_k16"] < calls["in_jit_k4"] < calls["in_jit_k1"]
  assert calls["in_jit_k4_prefix_cache"] == calls["in_jit_k4"]
  assert res["python_allocator"]["host_overhead_ratio_vs_python"] == 1.0
  assert all(math.isfinite(r["wall_us_per_token"]) for r in res.values())
