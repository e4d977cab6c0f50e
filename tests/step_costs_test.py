"""paged_jax.bench.step_costs: what the step's parts cost. Times are not asserted (the
machine is shared); what is: one reading per configuration, outputs checked, and the
least-squares fit against a known cost model."""

import numpy as np
import pytest

from paged_jax.bench import step_costs


def test_attention_ms_one_reading_per_block_size():
  ms = step_costs.attention_ms((4, 16, 32), batch=2, context=64, num_q_heads=4,
                               num_kv_heads=2, head_dim=16, repeats=2, seed=5)
  assert list(ms) == [4, 16, 32] and all(np.isfinite(v) and v > 0 for v in ms.values())
  with pytest.raises(ValueError, match="multiple of block_size=48"):
    step_costs.attention_ms((48,), context=64)


def test_step_cost_fit_recovers_a_known_cost_model():
  # Device seconds built from a known per-call and per-token cost: the fit must give
  # them back, and its predicted wall / step ratio must be the one those costs imply.
  a, b = 0.6e-3, 20e-6
  def run_(steps, tokens, computed, generated):
    return {"device_steps": steps, "steps": steps, "bucket_tokens": tokens,
            "computed_tokens": computed, "device_s": a * steps + b * tokens, "host_s": 0.1,
            "tokens_per_step": generated / steps}
  results = {}
  for name, (o, p) in {"sharegpt": ((587, 9024, 5998), (298, 10360, 7220)),
                       "alpaca": ((379, 5312, 3487), (231, 5032, 3487))}.items():
    row = {"orca_max": run_(*o, 3882), "paged": run_(*p, 3882)}
    row["speedup_tokens_per_step"] = (row["paged"]["tokens_per_step"]
                                      / row["orca_max"]["tokens_per_step"])
    results[name] = row
  fit = step_costs.step_cost_fit(results)
  s = fit["sharegpt"]
  assert s["ms_per_step"] == pytest.approx(0.6) and s["us_per_bucket_token"] == pytest.approx(20)
  o, p = results["sharegpt"]["orca_max"], results["sharegpt"]["paged"]
  wall = (o["device_s"] + 0.1) / (p["device_s"] + 0.1)
  assert s["predicted_wall_over_step"] == pytest.approx(wall / (587 / 298))
  assert s["recomputed_tokens"] == 7220 - 5998
  assert s["predicted_wall_over_step_without_recompute"] > s["predicted_wall_over_step"]
  assert s["fixed_share"]["orca_max"] == pytest.approx(a * 587 / o["device_s"])
  assert step_costs.step_cost_fit({"sharegpt": results["sharegpt"]}) is None   # 2 runs < 3


@pytest.mark.slow
def test_time_per_preemption_times_both_ways():
  # Both readings are real times of work that ran: a recompute that was never timed reads
  # 0 (Engine.generate drives the engine without step(), so its step timer stays 0).
  res = step_costs.time_per_preemption(64, seq_len=40, repeats=1, kv_budget_tokens=256)
  for key in ("swap_out_ms", "swap_in_ms", "swap_ms", "recompute_ms"):
    assert np.isfinite(res[key]) and res[key] > 0, key
  assert res["swap_ms"] >= max(res["swap_out_ms"], res["swap_in_ms"])
  assert res["swap_bytes"] > 0
  with pytest.raises(ValueError, match="seq_len must be <"):
    step_costs.time_per_preemption(64, seq_len=256, kv_budget_tokens=256)
