"""experiments/preemption at a tiny size: one block size, a pool small enough that both
modes preempt. Asserted: swap mode swaps and recompute mode never does, both serve the
whole stream, and (a) swaps exactly the sequence's K/V bytes. (Times are not compared: at
this size on a loaded machine they are noise.)"""

import json

import pytest

from experiments import preemption
from paged_jax.bench import engines


@pytest.mark.slow   # ~60 s on 2 cores: three engines compile their step shapes
def test_both_modes_preempt_and_only_swap_swaps(tmp_path):
  f = preemption.Config(block_sizes=(16,), num_requests=8, kv_budget_tokens=256, seq_len=64,
                        repeats=1)
  preemption.main(f, tmp_path)
  (row,) = json.loads((tmp_path / "preemption.json").read_text())["rows"]
  assert row["block_size"] == 16
  assert row["recompute_preemptions"] > 0 and row["recompute_swaps"] == 0
  assert row["swap_preemptions"] > 0 and row["swap_swaps"] > 0
  assert row["recompute_tokens_per_s"] > 0 and row["swap_tokens_per_s"] > 0
  cache = engines.make_engine(block_size=16, kv_budget_tokens=256).cache_config
  assert row["swap_bytes"] == 64 * cache.kv_bytes_per_token     # 4 full blocks
  assert row["swap_ms"] == pytest.approx(row["swap_out_ms"] + row["swap_in_ms"])
  assert (tmp_path / "preemption.png").stat().st_size > 0
