"""Sliding-window models in the device-time model and experiments/hybrid_scale (issue 38,
point 4(c)): the catalog's Gemma-2 / Mistral shapes against the published sizes, a hybrid
step's pricing against a hand count (the window caps a sliding layer's keys), the pools a
KV budget gives with and without hybrid KV, and the experiment at a toy size."""

import math

import numpy as np
import pytest

from experiments import hybrid_scale
from paged_jax import perf
from paged_jax.bench import paper_scale
from paged_jax.perf import budget as budget_lib
from paged_jax.perf.roofline import attention_extent


@pytest.mark.parametrize("name, published", [
    ("gemma-2-9b", 9.24e9),     # Gemma 2 report (arXiv:2408.00118) / model card
    ("gemma-2-27b", 27.2e9),
    ("mistral-7b", 7.24e9),     # Mistral-7B-v0.1 model card
])
def test_catalog_parameter_counts_match_the_published_sizes(name, published):
  spec = perf.model_spec(name)
  assert abs(spec.param_count / published - 1) < 0.02
  assert spec.sliding_window == 4096


def test_gemma_2_9b_counts_the_reports_embedding_and_non_embedding_parameters():
  spec = perf.model_spec("gemma-2-9b")
  # Gemma 2 report Table 2: 917,504,000 embedding and 8,324,201,984 non-embedding.
  assert spec.vocab_size * spec.hidden_size == 917_504_000
  assert spec.param_count - spec.vocab_size * spec.hidden_size == 8_324_201_984
  assert spec.sliding_layers == tuple(range(0, 42, 2))    # HF Gemma2: even layers slide
  assert spec.num_full_layers == spec.num_sliding_layers == 21
  assert spec.kv_bytes_per_token() == 42 * 2 * 8 * 256 * 2   # K and V, bf16


def _hand_extent(new, ctx, window):
  """Loop over the chunk's tokens: (query-key pairs, distinct keys read)."""
  pairs, keys = 0, set()
  for p in range(ctx - new, ctx):     # positions of the new tokens
    lo = 0 if window is None else max(0, p - window + 1)
    pairs += p + 1 - lo
    keys.update(range(lo, p + 1))
  return pairs, len(keys)


@pytest.mark.parametrize("new, ctx", [(1, 8000), (1, 100), (100, 7000), (3000, 7000),
                                      (4096, 4096), (1, 4097), (2560, 8192)])
@pytest.mark.parametrize("window", [None, 4096, 7])
def test_attention_extent_is_a_loop_over_the_chunks_tokens(new, ctx, window):
  pairs, reads = attention_extent(np.array([new]), np.array([ctx]), window)
  assert (pairs[0], reads[0]) == _hand_extent(new, ctx, window)


def test_a_hybrid_decode_step_reads_only_the_window_of_the_sliding_layers():
  dm = perf.DeviceTimeModel.named("gemma-2-9b", "a100-80gb")
  per_layer_token = 2 * 8 * 256 * 2          # bytes: K and V of one layer, bf16
  c = dm.counts(perf.StepShape.decode([8000, 100]))
  # Full layers read every token and write one; sliding ones at most the window's 4,096.
  want = 21 * per_layer_token * ((8000 + 1) + (100 + 1) + (4096 + 1) + (100 + 1))
  assert c["kv_bytes"] == want
  assert c["attention_flops"] == 4.0 * 16 * 256 * 21 * ((8000 + 100) + (4096 + 100))
  # Without the window (every layer full), the same step reads more and costs more.
  full = dm.replace(model=perf.ModelSpec(**{
      **{k: getattr(dm.model, k) for k in ("name", "num_layers", "hidden_size", "num_heads",
                                           "num_kv_heads", "head_dim", "ffn_size",
                                           "vocab_size", "dtype", "max_context")}}))
  assert full.counts(perf.StepShape.decode([8000, 100]))["kv_bytes"] == 42 * per_layer_token * (
      8001 + 101)
  step = perf.StepShape.decode([8000] * 64)
  assert dm.breakdown(step)["attention"] < full.breakdown(step)["attention"]


def test_models_without_sliding_layers_price_as_before():
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  step = perf.StepShape.from_rows([(1, 700), (300, 900)])
  c = dm.counts(step)
  assert c["kv_bytes"] == pytest.approx((701 + 1200) * dm.kv_bytes_per_token)
  pairs = 700 + (300 * 600 + 300 * 301 / 2)
  assert c["attention_flops"] == pytest.approx(4.0 * 40 * 128 * 40 * pairs)


def test_pools_from_the_kv_budget_with_and_without_hybrid_kv():
  b = perf.kv_budget("gemma-2-9b", "a100-80gb")
  layer_block = 16 * 2 * 8 * 256 * 2       # bytes: one layer's K/V block of 16 tokens
  one = budget_lib.pool_config("gemma-2-9b", b, block_size=16, max_seqs=32, max_len=8192,
                               max_num_batched_tokens=2560, hybrid_kv=False)
  assert not one.hybrid and one.num_blocks == b.kv_bytes // (42 * layer_block)
  assert abs(one.num_blocks - b.num_blocks(16)) <= 1
  hy = budget_lib.pool_config("gemma-2-9b", b, block_size=16, max_seqs=32, max_len=8192,
                              max_num_batched_tokens=2560, hybrid_kv=True)
  # The engine's sliding pool: every slot's window (ceil(4095 / 16) + 2 blocks) plus a
  # step's 2,560 tokens; the full layers' pool gets what is left.
  assert hy.num_sliding_blocks == 32 * (math.ceil(4095 / 16) + 2) + 2560 // 16 == 8416
  assert hy.num_blocks == (b.kv_bytes - 21 * 8416 * layer_block) // (21 * layer_block)
  assert hy.kv_cache_bytes <= b.kv_bytes < hy.kv_cache_bytes + 21 * layer_block
  assert hy.sliding_layers == tuple(range(0, 42, 2)) and hy.sliding_window == 4096
  with pytest.raises(ValueError, match="hybrid_kv needs both"):   # every Mistral layer slides
    budget_lib.pool_config("mistral-7b", perf.kv_budget("mistral-7b", "a100-80gb"),
                           block_size=16, max_seqs=8, max_len=8192,
                           max_num_batched_tokens=2560, hybrid_kv=True)


def test_bad_sliding_fields_are_one_line_errors():
  with pytest.raises(ValueError, match="set together"):
    perf.ModelSpec(name="x", num_layers=2, hidden_size=8, num_heads=1, num_kv_heads=1,
                   head_dim=8, ffn_size=8, vocab_size=8, sliding_window=4)
  with pytest.raises(ValueError, match="sliding_layers"):
    perf.ModelSpec(name="x", num_layers=2, hidden_size=8, num_heads=1, num_kv_heads=1,
                   head_dim=8, ffn_size=8, vocab_size=8, sliding_window=4,
                   sliding_layers=(2,))
  with pytest.raises(ValueError, match="prefix_max"):
    hybrid_scale.Config(prefix_min=10, prefix_max=5)


def test_stream_is_seeded_and_every_request_starts_with_a_system_prompt():
  f = hybrid_scale.Config(num_requests=20, num_prefixes=3, prefix_min=100, prefix_max=200)
  prefixes, reqs = hybrid_scale.stream(f, 8192)
  again, reqs2 = hybrid_scale.stream(f, 8192)
  assert all(np.array_equal(a.prompt_token_ids, b.prompt_token_ids) for a, b in zip(reqs, reqs2))
  assert all(100 <= len(p) <= 200 for p in prefixes)
  for r in reqs:
    n = hybrid_scale._prefix_len(r, prefixes)   # pylint: disable=protected-access
    assert n in {len(p) for p in prefixes} and r.total_len <= 8192


@pytest.mark.slow
def test_tiny_run_serves_each_configuration_and_hybrid_holds_less(tmp_path):
  f = hybrid_scale.Config(num_requests=10, max_points=2, num_prefixes=2, prefix_min=4200,
                          prefix_max=4400, configs_run=("caching", "hybrid_caching"),
                          out=str(tmp_path))
  res = hybrid_scale.run(f)
  rows = {r["config"]: r for r in res["rows"]}
  assert set(rows) == {"caching", "hybrid_caching"}
  one, hc = rows["caching"], rows["hybrid_caching"]
  assert one["sizes"]["num_sliding_blocks"] == 0 < hc["sizes"]["num_sliding_blocks"]
  assert res["share_over_window"] == 1.0      # every request outgrows the 4,096 window
  # Same requests, same cache hits; the sliding layers hold at most the window's blocks.
  assert hc["hit_rate"] == one["hit_rate"] > 0.5
  assert 0 < hc["analytic_saved"] < 0.5
  assert hc["layer_blocks_per_request"] < one["layer_blocks_per_request"]
  assert hc["memory_saved"] == pytest.approx(
      1 - hc["layer_blocks_per_request"] / one["layer_blocks_per_request"])
  assert hybrid_scale.summary_rows(res) and hybrid_scale.vllm_rows(res)
