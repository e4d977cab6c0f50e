"""DeviceTimeModel: analytic limits, monotonicity, tensor parallelism, literature figures."""

import numpy as np
import pytest

from paged_jax import perf
from paged_jax.config import ModelConfig
from paged_jax.perf import catalog

EFF = catalog.DEFAULT_EFFICIENCY


def _random_step(rng, max_rows=64, max_ctx=2048):
  rows = []
  for _ in range(int(rng.integers(1, max_rows + 1))):
    new = 1 if rng.random() < 0.7 else int(rng.integers(2, 512))
    rows.append((new, new + int(rng.integers(0, max_ctx))))
  return perf.StepShape.from_rows(
      rows, cow_blocks=int(rng.integers(0, 8)), swapped_blocks=int(rng.integers(0, 8)),
      decode_iterations=int(rng.integers(1, 4)), block_size=int(rng.choice([8, 16, 32])))


def test_decode_at_batch_one_is_weight_bandwidth_bound():
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  parts = dm.breakdown(perf.StepShape.decode([1]))
  # Table 1: 26 GB of weights, read once at the A100-40GB's 1,555 GB/s (datasheet).
  analytic = 26e9 / (1555e9 * EFF.weight_bandwidth)
  assert parts["linear"] == pytest.approx(analytic, rel=0.02)
  assert parts["linear"] > 0.9 * (parts["total"] - EFF.pass_overhead_s)
  # Exactly the weight bytes one pass reads plus the token's activations (OPT-13B, one
  # token, per layer: 15 h + 6 q + 6 kv + 4 ffn fp16 elements through HBM), over the
  # effective bandwidth.
  spec = catalog.MODELS["opt-13b"]
  act = 40 * (15 * 5120 + 6 * 5120 + 6 * 5120 + 4 * 20480) * 2
  assert spec.activation_bytes_per_token() == act
  exact = (spec.weight_bytes_per_pass + act) / (1555e9 * EFF.weight_bandwidth)
  assert parts["linear"] == pytest.approx(exact, rel=1e-12)


def test_long_prefill_is_compute_bound():
  dm = perf.DeviceTimeModel.named("llama-13b", "a100-80gb")
  parts = dm.breakdown(perf.StepShape.prefill([2048]))
  spec = catalog.MODELS["llama-13b"]
  flops = 2 * 2048 * spec.num_layers * spec.layer_matmul_params + 2 * spec.lm_head_params
  assert parts["linear"] == pytest.approx(flops / (312e12 * EFF.linear_flops), rel=1e-12)
  assert parts["linear"] > 2 * spec.weight_bytes_per_pass / (2039e9 * EFF.weight_bandwidth)


def test_decode_attention_grows_with_context_at_the_kv_bandwidth():
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  a = dm.breakdown(perf.StepShape.decode([1000] * 64))["attention"]
  b = dm.breakdown(perf.StepShape.decode([2000] * 64))["attention"]
  # 64 rows x (context + the new token) x 800 KiB each, over 1,555 GB/s x kv_bandwidth.
  per_token_s = 800 * 1024 / (1555e9 * EFF.kv_bandwidth)
  assert a == pytest.approx(64 * 1001 * per_token_s, rel=1e-9)
  assert b - a == pytest.approx(64 * 1000 * per_token_s, rel=1e-9)


@pytest.mark.parametrize("model, gpu, tp", [("opt-13b", "a100-40gb", 1),
                                            ("opt-66b", "a100-40gb", 4),
                                            ("llama-3-8b", "h200", 2)])
def test_more_work_never_costs_less(model, gpu, tp):
  dm = perf.DeviceTimeModel.named(model, gpu, tp=tp)
  rng = np.random.default_rng(0)
  for _ in range(40):
    s = _random_step(rng)
    t = dm.step_seconds(s)
    new, ctx = list(s.new_tokens), list(s.context_lens)
    i = int(rng.integers(0, len(new)))
    longer = s.__class__(**{**s.as_dict(), "context_lens": ctx[:i] + [ctx[i] + 100]
                            + ctx[i + 1:]})
    # A longer chunk (a decode row stays a decode row: later decode iterations rerun those).
    grow = 7 if new[i] > 1 else 0
    more_new = s.__class__(**{**s.as_dict(),
                              "new_tokens": new[:i] + [new[i] + grow] + new[i + 1:],
                              "context_lens": ctx[:i] + [ctx[i] + grow] + ctx[i + 1:]})
    extra_row = perf.StepShape.from_rows(list(zip(new, ctx)) + [(1, 300)],
                                         **{k: v for k, v in s.as_dict().items()
                                            if k not in ("new_tokens", "context_lens")})
    for bigger in (longer, more_new, extra_row,
                   s.__class__(**{**s.as_dict(), "cow_blocks": s.cow_blocks + 3}),
                   s.__class__(**{**s.as_dict(), "swapped_blocks": s.swapped_blocks + 3}),
                   s.__class__(**{**s.as_dict(), "decode_iterations": s.decode_iterations + 1}),
                   s.__class__(**{**s.as_dict(), "bucket_tokens": s.num_tokens + 64})):
      assert dm.step_seconds(bigger) >= t


def test_tensor_parallel_splits_weights_and_adds_allreduce():
  one = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  two = one.replace(tp=2)
  s = perf.StepShape.decode([256] * 8)
  p1, p2 = one.breakdown(s), two.breakdown(s)
  # Memory-bound: half the weights; the hidden-size activations are not split.
  spec, hbm = catalog.MODELS["opt-13b"], 1555e9 * EFF.weight_bandwidth
  hidden_act = 8 * 40 * (10 + 1 + 4) * 5120 * 2
  assert p1["linear"] - p2["linear"] == pytest.approx(
      (spec.weight_bytes_per_pass / 2 + (8 * spec.activation_bytes_per_token() - hidden_act)
       / 2) / hbm, rel=1e-12)
  assert p2["attention"] == pytest.approx(p1["attention"] / 2, rel=1e-12)
  assert p1["allreduce"] == 0 and p2["allreduce"] > 0
  # 2 all-reduces a layer, each of 8 tokens x 5120 x 2 bytes in a 2-GPU ring (factor 1).
  ring = 2 * 40 * 8 * 5120 * 2 / (300e9 * EFF.nvlink) + 2 * 40 * EFF.allreduce_latency_s
  assert p2["allreduce"] == pytest.approx(ring, rel=1e-12)
  with pytest.raises(ValueError, match="tp must divide"):
    one.replace(tp=3)


def test_literature_step_times():
  """FasterTransformer on A100-40GB (kipply 2022): the 1-GPU figures set the defaults'
  linear_flops and weight_bandwidth, so they must hold within 5%; the 2-GPU figures are out
  of sample: within 25% (measured -23% prefill, -9% decode: FasterTransformer scales less
  than a roofline at tp 2)."""
  for fig in catalog.LITERATURE_STEP_TIMES:
    dm = perf.DeviceTimeModel.named(fig["model"], fig["gpu"], tp=fig["tp"])
    s = (perf.StepShape.prefill([fig["tokens"]]) if fig["phase"] == "prefill"
         else perf.StepShape.decode([fig["tokens"]]))
    tol = 0.05 if fig["tp"] == 1 else 0.25
    assert dm.step_seconds(s) == pytest.approx(fig["seconds"], rel=tol), fig


def test_faster_gpus_are_faster():
  s = perf.StepShape.from_rows([(1, 800)] * 48 + [(512, 512)])
  times = [perf.DeviceTimeModel.named("llama-13b", g).step_seconds(s)
           for g in ("a100-40gb", "a100-80gb", "h100-sxm", "h200")]
  assert times == sorted(times, reverse=True) and times[0] > 2 * times[-1]


def test_small_blocks_swap_slower_per_token():
  # The paper's Fig. 19a: small blocks mean many small PCIe copies.
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  per_token = [dm.breakdown(perf.StepShape(swapped_blocks=4096 // bs, block_size=bs))["swap"]
               / 4096 for bs in (1, 4, 16, 64, 256)]
  assert per_token == sorted(per_token, reverse=True)
  assert per_token[0] > 5 * per_token[-1]
  assert per_token[-1] == pytest.approx(800 * 1024 / (32e9 * EFF.pcie), rel=0.05)


def test_any_model_config_works_and_step_work_is_homogeneous():
  cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=2,
                    num_heads=4, num_kv_heads=2, dtype="float32")
  dm = perf.DeviceTimeModel.named(cfg, "h200")
  s = perf.StepShape.from_rows([(1, 40), (1, 90), (30, 30)], cow_blocks=2, swapped_blocks=1)
  work = dm.work(s)
  theta = dm.theta
  assert work.seconds(theta) == pytest.approx(work.gradient(theta) @ theta, rel=1e-12)
  assert work.seconds(2 * theta) == pytest.approx(2 * work.seconds(theta), rel=1e-12)
  assert dm.step_seconds(perf.StepShape()) == 0.0   # no rows, no copies: nothing to run


def test_step_shape_validation():
  with pytest.raises(ValueError, match="one entry per row"):
    perf.StepShape(new_tokens=(1, 1), context_lens=(5,))
  with pytest.raises(ValueError, match="context_lens must be >= new_tokens"):
    perf.StepShape.from_rows([(8, 4)])
  with pytest.raises(ValueError, match="new_tokens must be >= 1"):
    perf.StepShape.from_rows([(0, 4)])
  with pytest.raises(TypeError, match="context_lens must hold ints"):
    perf.StepShape.decode([1.5])
  with pytest.raises(ValueError, match="sampled_rows"):
    perf.StepShape.decode([4, 4], sampled_rows=3)
  with pytest.raises(ValueError, match="block_size"):
    perf.StepShape(block_size=3)
  s = perf.StepShape.decode(np.array([3, 4]))
  assert s.new_tokens == (1, 1) and s.context_lens == (3, 4) and hash(s) == hash(
      perf.StepShape.decode([3, 4]))


def test_the_host_row_cost_is_one_term_per_row_and_off_by_default():
  model = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  step = perf.StepShape.from_rows([(1, 100), (1, 300), (64, 64)], decode_iterations=3)
  assert model.breakdown(step)["row_host"] == 0.0     # the catalog's GPU figures: none
  timed = model.replace(efficiency=model.efficiency.replace(row_host_s=50e-6))
  got, base = timed.breakdown(step), model.breakdown(step)
  assert got["row_host"] == pytest.approx(3 * 50e-6)  # once per row per step, not per pass
  assert got["total"] == pytest.approx(base["total"] + 3 * 50e-6)
  assert timed.breakdown(perf.StepShape())["total"] == 0.0   # a step with no rows
