"""experiments/prefix_caching at a tiny size (one 64-token system prompt, 4 requests, no
few-shot rows): caching on hits the shared prefix and computes less prefill to the same
tokens, one copy of the prefix is cached, whole-block reuse loses more shared tokens as
blocks grow, and the lookup costs are read. (Times are not asserted.)"""

import json

import pytest

from experiments import prefix_caching


@pytest.mark.slow   # ~110 s on 2 cores (load 8): two engines serve 4 untimed + 6 timed rounds
def test_tiny_run_hits_the_shared_prefix(tmp_path):
  f = prefix_caching.Config(system_prompt_lens=(64,), num_requests=4, few_shot_requests=0,
                            kv_budget_tokens=1024, max_seqs=16, max_num_batched_tokens=64,
                            sweep_block_sizes=(1, 16, 64),
                            sweep_pairs=4, lookup_num_blocks=(128,))
  prefix_caching.main(f, tmp_path)
  res = json.loads((tmp_path / "prefix_caching.json").read_text())
  (row,) = res["serving"]
  assert row["workload"] == "system64" and row["requests"] == 4 and row["outputs_identical"]
  assert row["hit_rate"] > 0 and row["prefill_tokens_on"] < row["prefill_tokens_off"]
  assert row["prefix_copies_cached"] == 1 and row["paper_ratio"] is None
  sweep = res["block_size_sweep"]
  assert [r["block_size"] for r in sweep] == [1, 16, 64]
  assert sweep[0]["hit_rate"] == 1.0 and sweep[0]["lost_tokens"] == 0
  assert sweep[0]["lost_tokens"] <= sweep[1]["lost_tokens"] <= sweep[2]["lost_tokens"]
  (cost,) = res["lookup_cost"]
  assert cost["num_blocks"] == 128 and cost["lookup_s_per_block"] > 0
  assert (tmp_path / "prefix_caching.png").stat().st_size > 0
