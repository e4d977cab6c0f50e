"""CacheConfig / ModelConfig: validation names the argument, sizing arithmetic is exact."""

import numpy as np
import pytest

from paged_jax.config import CacheConfig, ModelConfig


@pytest.mark.parametrize("kwargs, name", [
    (dict(block_size=3), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=2048), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(max_seqs=0), "max_seqs"),
    (dict(max_blocks_per_seq=0), "max_blocks_per_seq"),
    (dict(head_dim=0), "head_dim"),
    (dict(dtype="int4"), "dtype"),
    (dict(num_blocks=2**27, block_size=16), "num_blocks * block_size"),
])
def test_cache_config_rejects_bad_values_naming_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=name.replace("*", r"\*")):
    CacheConfig(**kwargs)


def test_cache_config_rejects_non_int():
  with pytest.raises(TypeError, match="block_size"):
    CacheConfig(block_size=16.0)
  with pytest.raises(TypeError, match="num_blocks"):
    CacheConfig(num_blocks=True)


def test_prefix_caching_is_on_by_default_with_hybrid_kv_too():
  assert CacheConfig().enable_prefix_caching is True
  assert CacheConfig(enable_prefix_caching=False).enable_prefix_caching is False
  hybrid = dict(num_layers=3, sliding_layers=(1,), sliding_window=4, num_sliding_blocks=8)
  assert CacheConfig(**hybrid).enable_prefix_caching is True
  assert CacheConfig(enable_prefix_caching=False, **hybrid).enable_prefix_caching is False
  with pytest.raises(TypeError, match="enable_prefix_caching"):
    CacheConfig(enable_prefix_caching=1)
  assert CacheConfig() == CacheConfig(enable_prefix_caching=True)   # resolved, so equal


def test_cache_config_is_hashable_and_frozen():
  a = CacheConfig(block_size=8, num_blocks=10)
  b = CacheConfig(block_size=8, num_blocks=10)
  assert hash(a) == hash(b) and a == b
  with pytest.raises(Exception):
    a.block_size = 16  # type: ignore[misc]


@pytest.mark.parametrize("dtype, elem", [("float32", 4), ("bfloat16", 2), ("int8", 1)])
def test_kv_bytes_per_token_counts_k_v_layers_heads(dtype, elem):
  rng = np.random.default_rng(201)
  layers, heads, dim = (int(x) for x in rng.integers(1, 9, size=3))
  cfg = CacheConfig(num_layers=layers, num_kv_heads=heads, head_dim=dim * 8, dtype=dtype)
  expect = 2 * layers * heads * dim * 8 * elem
  if dtype == "int8":
    expect += 2 * layers * heads * 4  # one f32 scale per token per head for K and V
  assert cfg.kv_bytes_per_token == expect
  assert cfg.kv_cache_bytes == expect * cfg.num_blocks * cfg.block_size


def test_from_memory_budget_fills_the_budget_with_whole_blocks():
  rng = np.random.default_rng(202)
  model = ModelConfig(num_layers=int(rng.integers(1, 5)), hidden_size=128, num_heads=4,
                      num_kv_heads=2)
  budget = int(rng.integers(10**6, 10**8))
  cfg = CacheConfig.from_memory_budget(model, block_size=32, kv_budget_bytes=budget)
  per_block = cfg.kv_bytes_per_token * 32
  assert cfg.num_blocks == budget // per_block
  assert cfg.kv_cache_bytes <= budget < cfg.kv_cache_bytes + per_block
  assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (model.num_layers, 2, 32)
  assert cfg.max_seq_len >= model.max_position_embeddings


@pytest.mark.parametrize("model_dtype, elem", [("float32", 4), ("bfloat16", 2),
                                               ("float16", 2)])
def test_kv_pages_follow_the_model_dtype_unless_set(model_dtype, elem):
  """vLLM's kv_cache_dtype="auto": a bf16 model gets bf16 pages, and the memory-budget
  sizing counts bytes in that dtype (so twice the blocks of an f32 model's pool)."""
  model = ModelConfig(num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                      dtype=model_dtype)
  assert model.cache_config().dtype == model_dtype
  assert model.cache_config(dtype="auto").dtype == model_dtype
  assert model.cache_config(dtype="int8").dtype == "int8"
  assert model.cache_config(dtype="float8_e4m3fn").quantized
  assert model.cache_config().kv_bytes_per_token == 2 * 3 * 2 * 32 * elem
  budget = 10**6
  auto = CacheConfig.from_memory_budget(model, block_size=16, kv_budget_bytes=budget)
  assert auto.dtype == model_dtype
  assert auto.num_blocks == budget // (2 * 3 * 2 * 32 * elem * 16)
  f32 = CacheConfig.from_memory_budget(model, block_size=16, kv_budget_bytes=budget,
                                       dtype="float32")
  assert f32.dtype == "float32" and auto.num_blocks * elem // 4 == f32.num_blocks
  int8 = CacheConfig.from_memory_budget(model, block_size=16, kv_budget_bytes=budget,
                                        dtype="int8")
  assert int8.num_blocks == budget // ((2 * 3 * 2 * 32 + 2 * 3 * 2 * 4) * 16)
  with pytest.raises(ValueError, match="dtype must be one of"):
    model.cache_config(dtype="int4")
  with pytest.raises(ValueError, match="dtype must be one of"):
    ModelConfig(dtype="int8")


def test_from_memory_budget_errors():
  model = ModelConfig()
  with pytest.raises(ValueError, match="exactly one"):
    CacheConfig.from_memory_budget(model)
  with pytest.raises(ValueError, match="gpu_memory_utilization"):
    CacheConfig.from_memory_budget(model, gpu_memory_utilization=1.5)
  with pytest.raises(ValueError, match="holds no block"):
    CacheConfig.from_memory_budget(model, kv_budget_bytes=10)


def test_model_config_from_hf_config_round_trip():
  hf = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
  m = ModelConfig.from_hf_config(hf)
  assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (3, 8, 2, 32)
  assert m.tie_word_embeddings and m.rope_theta == 500000.0
  assert ModelConfig.from_hf_config(m.to_hf_config()) == m


def test_model_config_validation():
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(num_heads=6, num_kv_heads=4)
  with pytest.raises(ValueError, match="config.json lacks"):
    ModelConfig.from_hf_config({"vocab_size": 3})
  with pytest.raises(ValueError, match="rope_scaling"):
    ModelConfig.from_hf_config({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 2,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_rope_inv_freq_plain_matches_theta_formula():
  m = ModelConfig(hidden_size=128, num_heads=4, num_kv_heads=2, rope_theta=12345.0)
  d = m.head_dim
  np.testing.assert_allclose(m.rope_inv_freq(),
                             12345.0 ** (-np.arange(0, d, 2) / d), rtol=1e-6)


def test_rope_scaling_llama3_and_linear():
  base = dict(vocab_size=10, hidden_size=512, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=4, rope_theta=500000.0)
  plain = ModelConfig.from_hf_config(base).rope_inv_freq()
  lin = ModelConfig.from_hf_config(
      {**base, "rope_scaling": {"type": "linear", "factor": 4.0}}).rope_inv_freq()
  np.testing.assert_allclose(lin, plain / 4.0, rtol=1e-6)
  # Llama 3.1's published settings: wavelengths shorter than 8192/4 keep their
  # frequency, longer than 8192/1 are divided by the factor, in between interpolated.
  rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  m = ModelConfig.from_hf_config({**base, "rope_scaling": rs})
  l3 = m.rope_inv_freq()
  wavelen = 2 * np.pi / plain
  short, long_ = wavelen < 8192 / 4, wavelen > 8192
  assert short.any() and long_.any() and (~short & ~long_).any()
  np.testing.assert_allclose(l3[short], plain[short], rtol=1e-6)
  np.testing.assert_allclose(l3[long_], plain[long_] / 8.0, rtol=1e-6)
  mid = ~short & ~long_
  assert np.all(l3[mid] <= plain[mid] + 1e-12) and np.all(l3[mid] >= plain[mid] / 8.0 - 1e-12)
  # Round trip keeps the scaling, and the config stays hashable.
  assert ModelConfig.from_hf_config(m.to_hf_config()) == m
  hash(m)


def test_transformers_v5_rope_parameters():
  base = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=4)
  m = ModelConfig.from_hf_config(
      {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}})
  assert m.rope_theta == 123.0 and m.rope_scaling is None
  m = ModelConfig.from_hf_config(
      {**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 77.0, "factor": 2.0}})
  assert m.rope_theta == 77.0 and dict(m.rope_scaling)["factor"] == 2.0


def test_sizing_and_check_names_stay_importable_from_config():
  """config re-exports the names its floor modules define (callers import them there)."""
  from paged_jax import checks, config, pool_sizing  # pylint: disable=g-import-not-at-top
  for name in ("cdiv", "check_int", "check_block_size"):
    assert getattr(config, name) is getattr(checks, name)
  for name in ("sliding_blocks_per_seq", "sliding_pool_blocks"):
    assert getattr(config, name) is getattr(pool_sizing, name)
