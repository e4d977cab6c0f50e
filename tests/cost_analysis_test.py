"""experiments.cost_analysis at a tiny size: the model's FLOPs / bytes beside XLA's cost
analysis of the forward compiled deviceless for an H200 (and a v5e where libtpu is here).

What must hold whatever the machine: XLA's FLOPs outside the kernels are the model's
projections plus a few percent of elementwise work; the kernels declare exactly the model's
attention FLOPs times their padding (the Mosaic GPU decode kernel computes 64 rows for a
GQA group of 2; the TPU kernel computes the group itself) and about twice a causal prefill
(the static bound); the in-place K/V write is charged the whole pool, read and written.
"""

import pytest

from experiments import cost_analysis
from pallas_kernels.deviceless import target as gt
from pallas_kernels.tpu import compile_target as tt

pytestmark = pytest.mark.skipif(gt.unavailable_reason() is not None,
                                reason=str(gt.unavailable_reason()))


def _run(targets):
  config = cost_analysis.Config(models=("tiny",), targets=targets, layers=2, context=256,
                                decode_rows=4, prefill_rows=1, block_size=16)
  return cost_analysis.run(config)


@pytest.mark.slow   # five compiles per target: ~20 s of CPU on a quiet machine
def test_tiny_model_against_the_h200_and_v5e_compiles():
  targets = ("h200",) + (("v5e",) if tt.unavailable_reason() is None else ())
  found = _run(targets)
  assert not found["failures"], found["failures"]
  rows = {(r["target"], r["phase"]): r for r in found["rows"]}
  assert set(rows) == {(t, p) for t in targets for p in ("decode", "prefill")}
  for (target, phase), row in rows.items():
    e = row["explained"]
    assert 1.0 <= e["linear_flops_ratio"] <= 1.1, (target, phase, e)
    assert row["compiled"]["declared"]["undeclared"] == 0
    if phase == "prefill":   # T x T bound over a causal T (T + 1) / 2, padded query tiles
      assert 1.9 <= e["attention_flops_ratio"] <= 2.5, (target, e)
  padding = {"h200": 64 / 2, "v5e": 1.0}
  for target in targets:
    assert rows[target, "decode"]["explained"]["attention_flops_ratio"] == pytest.approx(
        padding[target], rel=1e-6)
  assert rows["h200", "decode"]["explained"]["pool_slope"] == pytest.approx(2.0, abs=0.01)
  assert rows["h200", "decode"]["compiled"]["kernels_seen"] is False
  table = cost_analysis.summary_rows(found)
  assert len(table) == len(found["rows"]) and len(table[0]) == len(cost_analysis.HEADERS)


def test_a_case_that_is_not_llama_style_is_refused():
  from paged_jax.bench import cost_analysis as ca  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="not a Llama-style"):
    ca.CostCase("opt-13b").model_config()
  with pytest.raises(ValueError, match="target must be one of"):
    ca.CostCase(target="v4")


def test_model_activation_bytes_match_the_h200_compile():
  """(Two compiles of a 2-layer Llama-3-8B prefill, ~6 s.) What XLA's cost analysis of the
  compiled forward moves per extra prefill token (the
  slope between 1,024 and 2,048 tokens, less the pool's read-and-write charge, which grows
  with the pool here) is the model's activation count to 5%: the term the model lacked."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from paged_jax.bench import cost_analysis as ca  # pylint: disable=g-import-not-at-top
  short = ca.CostCase("llama-3-8b", "prefill", target="h200", rows=1, context=1024)
  long = dataclasses.replace(short, context=2048)
  net = [ca.compiled_counts(c)["bytes"] - 2 * c.cache_config().kv_cache_bytes
         for c in (short, long)]
  per_token = (net[1] - net[0]) / (long.tokens - short.tokens)
  model = short.spec().activation_bytes_per_token()
  assert per_token == pytest.approx(model, rel=0.05), (per_token, model)
