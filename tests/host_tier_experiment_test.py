"""experiments/host_tier at a tiny size: the host tier serves the multi-turn chats with
the same greedy outputs as device-only caching and computes fewer prompt tokens; bad
flags are one-line errors. (Times are not asserted.)"""

import json

import pytest

from experiments import host_tier


@pytest.mark.parametrize("kw, msg", [
    (dict(host_factors="1,x"), "--host_factors must be comma-separated numbers"),
    (dict(host_factors="0"), "--host_factors must be positive"),
    (dict(device_blocks=4), "--device_blocks=4 cannot hold the longest chat"),
    (dict(max_first=10, min_first=20), "--max_first"),
])
def test_bad_flags_are_one_line_errors(kw, msg):
  with pytest.raises(ValueError, match=msg) as e:
    host_tier.Config(**kw)
  assert "\n" not in str(e.value)


@pytest.mark.slow   # three engines, each serving the chats twice (untimed, timed)
def test_tiny_run_hits_the_host_tier(tmp_path):
  f = host_tier.Config(conversations=6, turns=3, min_first=24, max_first=40, min_user=4,
                       max_user=8, max_tokens=4, device_blocks=12, block_size=8,
                       max_seqs=4, max_num_batched_tokens=32, start_rate=0.5, think_steps=4.0,
                       host_factors="1,4")
  host_tier.main(f, tmp_path)
  res = json.loads((tmp_path / "host_tier.json").read_text())
  s = res["systems"]
  assert res["outputs_equal"] and set(s) == {"device_only", "host_1x", "host_4x"}
  assert s["device_only"]["host_hit_tokens"] == 0 and s["host_4x"]["host_hit_tokens"] > 0
  assert s["host_4x"]["prompt_tokens_computed"] < s["device_only"]["prompt_tokens_computed"]
  assert all(r["prompt_tokens"] == s["device_only"]["prompt_tokens"] for r in s.values())
  assert res["flags"]["host_factors"] == "1,4" and "versions" in res
