"""experiments/prefix_miss at a tiny size: caching on and off serve the same miss-only
stream to the same tokens (the experiment raises otherwise) on the same schedule, every
round generating every requested token with no prefix hit. (Costs are not asserted: at this
size on a loaded machine they are noise.)"""

import json
import math

import pytest

from experiments import prefix_miss


@pytest.mark.slow   # ~25 s on 2 cores (load 6): two engines' step shapes compile
def test_miss_only_stream_same_schedule_on_and_off(tmp_path):
  f = prefix_miss.Config(num_requests=3, min_prompt=8, max_prompt=40, max_tokens=4,
                         kv_budget_tokens=1024, max_seqs=4, max_num_batched_tokens=64,
                         rounds=2)
  prefix_miss.main(f, tmp_path)
  res = json.loads((tmp_path / "prefix_miss.json").read_text())
  assert res["hit_tokens"] == 0 and res["steps_on"] == res["steps_off"] > 0
  assert [r["round"] for r in res["rounds"]] == [0, 1]
  for r in res["rounds"]:
    assert r["generated_tokens"] == 3 * 4 and r["steps_on"] == r["steps_off"]
  for name in ("on", "off"):
    assert all(len(v) == res["steps_off"] for v in res["step_profile"][name].values())
  assert all(math.isfinite(res[k]) and res[k] > 0 for k in ("cpu_ratio", "wall_ratio"))
  assert 8 * 3 <= res["prompt_tokens_per_round"] <= 40 * 3
  assert res["meets_target"] == (res["cpu_ratio"] <= prefix_miss.TARGET)
