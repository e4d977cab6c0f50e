"""fit_efficiency: steps generated from known constants give those constants back."""

import numpy as np
import pytest

from paged_jax import perf
from paged_jax.config import ModelConfig
from paged_jax.perf import catalog

TRUTH = catalog.DEFAULT_EFFICIENCY.replace(
    linear_flops=0.55, weight_bandwidth=0.7, attention_flops=0.5, kv_bandwidth=0.45,
    elementwise_bandwidth=0.6, pcie=0.7, nvlink=0.6, pass_overhead_s=2.5e-3,
    allreduce_latency_s=15e-6, swap_copy_latency_s=8e-6, row_host_s=40e-6, source="truth")


def _steps(rng, n=80):
  """Decode batches, whole prompts, mixed batches with copy-on-write, swaps: every part of
  the model in both its compute-bound and memory-bound regime, at several block sizes."""
  out = []
  for i in range(n):
    bs = int(rng.choice([8, 16, 32, 64]))
    kind = i % 4
    if kind == 0:
      ctx = rng.integers(16, 2048, size=int(rng.integers(1, 257)))
      out.append(perf.StepShape.decode(ctx, block_size=bs,
                                       decode_iterations=int(rng.choice([1, 1, 4]))))
    elif kind == 1:
      out.append(perf.StepShape.prefill(rng.integers(16, 2048, size=int(rng.integers(1, 5))),
                                        block_size=bs))
    elif kind == 2:
      rows = [(1, int(c)) for c in rng.integers(16, 2048, size=int(rng.integers(1, 64)))]
      rows.append((int(rng.integers(64, 1024)), int(rng.integers(1024, 2048))))
      out.append(perf.StepShape.from_rows(rows, cow_blocks=int(rng.integers(0, 20)),
                                          block_size=bs))
    else:
      ctx = rng.integers(16, 2048, size=int(rng.integers(1, 128)))
      out.append(perf.StepShape.decode(ctx, swapped_blocks=int(rng.integers(1, 200)),
                                       block_size=bs))
  return out


def test_noise_free_steps_recover_every_identifiable_constant():
  rng = np.random.default_rng(0)
  steps = _steps(rng)
  truth = perf.DeviceTimeModel.named("opt-13b", "a100-40gb", efficiency=TRUTH)
  start = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")   # the catalog's defaults
  result = perf.fit_efficiency(start, steps, perf.predict(truth, steps), prior_weight=0.0)
  # tp 1: no all-reduce, so nothing can identify nvlink or allreduce_latency_s.
  assert result.held == ("nvlink", "allreduce_latency_s")
  for name in result.fitted:
    assert getattr(result.model.efficiency, name) == pytest.approx(getattr(TRUTH, name),
                                                                   rel=1e-4), name
  for name in result.held:
    assert getattr(result.model.efficiency, name) == getattr(catalog.DEFAULT_EFFICIENCY, name)
  assert result.max_abs_rel_error < 1e-6
  held_out = _steps(np.random.default_rng(1), n=40)
  errs = perf.relative_errors(result.model, held_out, perf.predict(truth, held_out))
  assert errs["max_abs_rel_error"] < 1e-6


def test_inseparable_latencies_are_held_and_their_sum_is_fitted():
  # At one tp every pass has 2 x layers all-reduces: their latency and the per-pass overhead
  # move together. The fit keeps the overhead, holds the latency at its prior, and the
  # overhead absorbs the difference.
  rng = np.random.default_rng(2)
  steps = _steps(rng)
  truth = perf.DeviceTimeModel.named("opt-13b", "a100-40gb", tp=2, efficiency=TRUTH)
  start = perf.DeviceTimeModel.named("opt-13b", "a100-40gb", tp=2)
  result = perf.fit_efficiency(start, steps, perf.predict(truth, steps), prior_weight=0.0)
  assert result.held == ("allreduce_latency_s",)
  eff, count = result.model.efficiency, 2 * 40
  assert eff.pass_overhead_s + count * eff.allreduce_latency_s == pytest.approx(
      TRUTH.pass_overhead_s + count * TRUTH.allreduce_latency_s, rel=1e-4)
  assert eff.nvlink == pytest.approx(TRUTH.nvlink, rel=1e-3)
  assert result.max_abs_rel_error < 1e-5


def test_noisy_steps_predict_held_out_steps_within_the_noise():
  rng = np.random.default_rng(3)
  steps = _steps(rng)
  truth = perf.DeviceTimeModel.named("llama-13b", "a100-80gb", efficiency=TRUTH)
  measured = perf.predict(truth, steps) * np.exp(rng.normal(0.0, 0.03, size=len(steps)))
  result = perf.fit_efficiency(perf.DeviceTimeModel.named("llama-13b", "a100-80gb"), steps,
                               measured)
  assert 0.015 < result.mean_abs_rel_error < 0.035       # the 3% noise, not less, not more
  held_out = _steps(np.random.default_rng(4), n=40)
  errs = perf.relative_errors(result.model, held_out, perf.predict(truth, held_out))
  assert errs["mean_abs_rel_error"] < 0.02
  for name in ("linear_flops", "kv_bandwidth", "pcie"):   # the parts most steps exercise
    assert getattr(result.model.efficiency, name) == pytest.approx(getattr(TRUTH, name),
                                                                   rel=0.1), name
    assert result.rel_std_errors[name] < 0.1
  d = result.as_dict()
  assert d["num_steps"] == 80 and set(d["fitted"]) | set(d["held"]) == set(perf.PARAMS)


def test_fit_of_a_subset_moves_only_that_subset_and_records_its_source():
  rng = np.random.default_rng(5)
  steps = [perf.StepShape.decode(rng.integers(16, 2048, size=b)) for b in (1, 8, 64, 256)]
  truth = perf.DeviceTimeModel.named("opt-13b", "a100-40gb", efficiency=TRUTH)
  start = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  result = perf.fit_efficiency(start, steps, perf.predict(truth, steps),
                               params=["kv_bandwidth"], source="unit test")
  assert result.fitted == ("kv_bandwidth",)
  eff = result.model.efficiency
  assert eff.replace(kv_bandwidth=0.65, source="catalog defaults") == catalog.DEFAULT_EFFICIENCY
  described = result.model.as_dict()["efficiency"]
  assert described["kv_bandwidth"]["source"] == "unit test"
  assert described["linear_flops"]["source"] == catalog.EFFICIENCY_SOURCES["linear_flops"]


def test_bad_inputs_are_one_line_errors():
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  steps = [perf.StepShape.decode([10])]
  with pytest.raises(ValueError, match="one time per step"):
    perf.fit_efficiency(dm, steps, [0.1, 0.2])
  with pytest.raises(ValueError, match="finite seconds > 0"):
    perf.fit_efficiency(dm, steps, [0.0])
  with pytest.raises(ValueError, match="params must be among"):
    perf.fit_efficiency(dm, steps, [0.1], params=["hbm"])
  with pytest.raises(ValueError, match="prior_weight"):
    perf.fit_efficiency(dm, steps, [0.1], prior_weight=-1.0)


def test_a_per_row_host_cost_is_fitted_not_spread_over_the_device_terms():
  # A small model on a CPU-like device: decode batches of 1-48 rows on padded buckets
  # (8, 16, 24, 32, 48 tokens, as the engine runs them), each paying the host 100 us a
  # row. With row_host_s the fit gets it back and prices every step; without it (the
  # model before the term) no device term grows by the row: the projections step with
  # the bucket, the sampler of a 256-byte vocabulary is ~0 and held near its prior, and
  # the K/V reads follow the rows only through their contexts, so the steps are off.
  cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=2,
                    num_heads=4, num_kv_heads=2, dtype="float32")
  cpu = perf.GpuSpec(name="cpu", hbm_bytes=1 << 34, hbm_bandwidth=20e9, tensor_flops=100e9,
                     nvlink_bandwidth=10e9, pcie_bandwidth=10e9)
  rng = np.random.default_rng(6)
  steps = []
  for rows in (1, 1, 2, 3, 4, 6, 8, 9, 12, 16, 17, 20, 24, 28, 32, 40, 48):
    bucket = min(b for b in (8, 16, 24, 32, 48) if b >= rows)
    steps.append(perf.StepShape.decode(rng.integers(16, 256, size=rows), bucket_tokens=bucket))
  steps.append(perf.StepShape.prefill([200], bucket_tokens=256))
  truth = perf.DeviceTimeModel(model=perf.ModelSpec.from_model_config(cfg), gpu=cpu,
                               efficiency=TRUTH.replace(pass_overhead_s=3e-3,
                                                        row_host_s=100e-6))
  start = truth.replace(efficiency=catalog.DEFAULT_EFFICIENCY)
  measured = perf.predict(truth, steps)
  with_term = perf.fit_efficiency(start, steps, measured)
  assert "row_host_s" in with_term.fitted
  assert with_term.model.efficiency.row_host_s == pytest.approx(100e-6, rel=0.05)
  assert with_term.max_abs_rel_error < 0.005
  without = perf.fit_efficiency(start, steps, measured,
                                params=[n for n in perf.PARAMS if n != "row_host_s"])
  assert without.model.efficiency.row_host_s == 0.0
  assert without.max_abs_rel_error > 0.03


def test_weights_pull_the_fit_toward_the_heavier_steps_and_bad_ones_are_refused():
  # Two copies of the same decode steps measured 20% apart: the fit lands between them,
  # nearer the copy that weighs more.
  rng = np.random.default_rng(8)
  steps = [perf.StepShape.decode(rng.integers(16, 2048, size=b)) for b in (1, 4, 16, 64, 256)]
  truth = perf.DeviceTimeModel.named("opt-13b", "a100-40gb", efficiency=TRUTH)
  t = perf.predict(truth, steps)
  start = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  both = steps + steps
  measured = np.concatenate([t, 1.2 * t])
  def mean_ratio(weights):
    fit = perf.fit_efficiency(start, both, measured, weights=weights,
                              params=["weight_bandwidth", "kv_bandwidth"])
    return float(np.mean(perf.predict(fit.model, steps) / t))
  even, low, high = mean_ratio(None), mean_ratio([9.0] * 5 + [1.0] * 5), mean_ratio(
      [1.0] * 5 + [9.0] * 5)
  assert 1.05 < even < 1.15 and low < 1.04 and high > 1.16
  assert mean_ratio([2.0] * 10) == pytest.approx(even, rel=1e-9)   # only ratios count
  for bad in ([1.0] * 9, [1.0] * 9 + [-1.0], [0.0] * 10, [1.0] * 9 + [float("nan")]):
    with pytest.raises(ValueError, match="weights must hold"):
      perf.fit_efficiency(start, both, measured, weights=bad)
