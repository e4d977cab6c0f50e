"""experiments/compute_floor (the FLOP floor that bounds any engine-vs-engine ratio)
and hf_peer_bench.random_checkpoint (the seeded random model of a given size)."""

import jax
import numpy as np
import pytest

from experiments import compute_floor, hf_peer_bench
from paged_jax import attention
from paged_jax.config import ModelConfig
from paged_jax.models import load_hf_checkpoint
from paged_jax.models.llama import init_params, num_params

C = ModelConfig(vocab_size=258, hidden_size=128, intermediate_size=384, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=32)


def test_workload_flops_by_hand():
  # One prompt of 5 tokens, 3 new tokens: 7 tokens go through the model.
  f = compute_floor.workload_flops(C, [5], 3)
  per_layer = 128 * (128 + 2 * 64) + 128 * 128 + 128 * 2 * 384 + 384 * 128
  dense = 2 * (3 * per_layer + 128 * 258)
  assert f["tokens"] == 7
  assert f["dense"] == dense * 7
  # attention: 4 x heads x head_dim x layers x (1 + 2 + ... + 7)
  assert f["attention"] == 4 * 4 * 32 * 3 * 28
  assert f["total"] == f["dense"] + f["attention"]


def test_dense_flops_are_twice_the_matmul_weights_per_token():
  # Against the parameter count of a real model: every weight but the embedding
  # table and the norms is one multiply-add per token.
  params = init_params(C, jax.random.PRNGKey(0))
  norms = (2 * C.num_layers + 1) * C.hidden_size
  matmul_weights = num_params(params) - C.vocab_size * C.hidden_size - norms
  assert compute_floor.workload_flops(C, [1], 1)["dense"] == 2 * matmul_weights


def test_floor_is_a_lower_bound_on_the_measured_rate():
  fl = compute_floor.compute_floor(C, [8, 12], 4, token_batches=(16,), repeats=2)
  assert fl["best_gemm_gflops"] > 0
  assert fl["best_gemm_gflops"] >= max(fl["gemm_gflops"]["jax"].values())
  assert fl["floor_s"] == pytest.approx(fl["workload_gflop"] / fl["best_gemm_gflops"])


def test_random_checkpoint_loads_with_the_asked_size(tmp_path):
  path = hf_peer_bench.random_checkpoint(str(tmp_path / "m"), 256, 2, seed=3)
  config, params = load_hf_checkpoint(path)
  assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
          config.head_dim, config.intermediate_size) == (256, 2, 4, 2, 64, 768)
  again = hf_peer_bench.random_checkpoint(str(tmp_path / "n"), 256, 2, seed=3)
  _, params2 = load_hf_checkpoint(again)
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
    np.testing.assert_array_equal(a, b)        # seeded: the same model twice


@pytest.mark.parametrize("hidden,layers,match", [(200, 2, "multiple of 128"),
                                                 (0, 2, "random_hidden_size"),
                                                 (256, 0, "random_num_layers")])
def test_random_checkpoint_rejects_bad_sizes(tmp_path, hidden, layers, match):
  with pytest.raises(ValueError, match=match):
    hf_peer_bench.random_checkpoint(str(tmp_path / "m"), hidden, layers)


def test_attention_cost_times_this_platforms_attention():
  at = compute_floor.attention_cost(C, rows=4, kv_len=20, block_size=8, num_tokens=16,
                                    repeats=1)
  assert at["backend"] == attention.resolve_backend("auto")   # "cpu" (or "xla") here
  for key in ("decode_ms_per_layer", "mixed_ms_per_layer", "decode_gemm_ms_per_layer",
              "mixed_gemm_ms_per_layer"):
    assert at[key] > 0, key


def test_kernel_floor_by_hand():
  # 2 prompts of 10 and 30 tokens, 5 new tokens each: 40 prompt tokens in mixed steps
  # of 20 tokens (3 + 1 ms per layer), 2 x 4 fed-back tokens in decode steps of 4 rows
  # (2 + 2 ms per layer), 3 layers.
  at = {"rows": 4, "num_tokens": 20, "decode_ms_per_layer": 2.0, "decode_gemm_ms_per_layer": 2.0,
        "mixed_ms_per_layer": 3.0, "mixed_gemm_ms_per_layer": 1.0}
  kf = compute_floor.kernel_floor(at, 3, [10, 30], 5)
  assert kf["prefill_s"] == pytest.approx(3 * 40 * (4.0 / 20) / 1e3)
  assert kf["decode_s"] == pytest.approx(3 * 8 * (4.0 / 4) / 1e3)
  assert kf["kernel_floor_s"] == pytest.approx(kf["prefill_s"] + kf["decode_s"])
