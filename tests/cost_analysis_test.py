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
