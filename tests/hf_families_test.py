"""config.json of every family -> ModelConfig (both transformers layouts), and (slow, with
torch + transformers installed) fresh random checkpoints decoded equal to transformers."""

import importlib.util
import json
import os

import numpy as np
import pytest

from paged_jax import hf_config
from paged_jax.config import ModelConfig

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_golden")
_BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=6,
             num_attention_heads=2, num_key_value_heads=1, head_dim=8)
F, S = "full_attention", "sliding_attention"


def _golden_config(family):
  with open(os.path.join(GOLDEN, family, "config.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("family", hf_config.MODEL_TYPES)
def test_round_trip_through_our_config_json(family):
  config = ModelConfig.from_hf_config(_golden_config(family))
  assert ModelConfig.from_hf_config(config.to_hf_config()) == config
  hash(config)


def test_layer_types_derived_as_transformers_does():
  kinds = lambda cfg: ModelConfig.from_hf_config(dict(_BASE, **cfg)).layer_types
  windows = lambda cfg: [ModelConfig.from_hf_config(dict(_BASE, **cfg)).layer_sliding_window(i)
                         for i in range(6)]
  assert kinds(dict(model_type="mistral", sliding_window=4)) == (S,) * 6
  assert kinds(dict(model_type="mistral", sliding_window=None)) is None
  assert windows(dict(model_type="mistral")) == [4096] * 6       # transformers' default
  assert kinds(dict(model_type="gemma2")) == (S, F) * 3
  assert kinds(dict(model_type="gemma3_text", sliding_window_pattern=3)) == (S, S, F) * 2
  assert kinds(dict(model_type="gemma3_text")) == (S,) * 5 + (F,)
  # Qwen: windows only with use_sliding_window, on layers >= max_window_layers.
  assert kinds(dict(model_type="qwen2", sliding_window=4)) is None
  assert windows(dict(model_type="qwen2", use_sliding_window=True, sliding_window=4,
                      max_window_layers=4)) == [None] * 4 + [4, 4]
  assert kinds(dict(model_type="qwen3", use_sliding_window=True, sliding_window=4,
                    layer_types=[F, S] * 3)) == (F, S) * 3
  assert kinds(dict(model_type="llama")) is None
  assert windows(dict(model_type="llama", sliding_window=4)) == [None] * 6   # as transformers


def test_transformers_v4_and_v5_layouts_agree():
  v4 = dict(_BASE, model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6,
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256)
  v5 = dict(_BASE, model_type="gemma3_text", layer_types=[S] * 5 + [F], rope_parameters={
      F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
      S: {"rope_type": "default", "rope_theta": 1e4}})
  a, b = ModelConfig.from_hf_config(v4), ModelConfig.from_hf_config(v5)
  assert a == b
  assert a.sliding_rope_theta == 1e4 and dict(a.rope_scaling)["factor"] == 8.0
  np.testing.assert_allclose(a.rope_inv_freq(sliding=True), 1e4 ** (-np.arange(0, 8, 2) / 8),
                             rtol=1e-6)
  np.testing.assert_allclose(a.rope_inv_freq(), 1e6 ** (-np.arange(0, 8, 2) / 8) / 8,
                             rtol=1e-6)
  with pytest.raises(ValueError, match=f"rope_parameters.{S} rope_type must be 'default'"):
    ModelConfig.from_hf_config(dict(v5, rope_parameters={
        F: {"rope_type": "default"}, S: {"rope_type": "linear", "factor": 2.0}}))


def test_gemma_defaults_and_qwen2_biases():
  g = ModelConfig.from_hf_config(dict(_BASE, model_type="gemma2"))
  assert (g.attn_logit_softcapping, g.final_logit_softcapping, g.query_pre_attn_scalar,
          g.sliding_window, g.tie_word_embeddings) == (50.0, 30.0, 256.0, 4096, True)
  assert g.attention_scale == 256.0 ** -0.5 and g.embedding_multiplier == 4.0
  q = ModelConfig.from_hf_config(dict(_BASE, model_type="qwen2", attention_bias=False))
  assert (q.qkv_bias, q.o_proj_bias, q.qk_norm) == (True, False, False)
  assert ModelConfig.from_hf_config(dict(_BASE, model_type="qwen3")).qk_norm


def test_model_config_validates_family_fields():
  with pytest.raises(ValueError, match="hidden_act must be one of"):
    ModelConfig(hidden_act="relu")
  with pytest.raises(ValueError, match="layer_types must list num_layers=2"):
    ModelConfig(layer_types=(F,), sliding_window=4)
  with pytest.raises(ValueError, match="sliding_window is None"):
    ModelConfig(layer_types=(F, S))
  with pytest.raises(ValueError, match="sliding_window must be >= 1"):
    ModelConfig(sliding_window=0)
  with pytest.raises(ValueError, match="final_logit_softcapping must be a number > 0"):
    ModelConfig(final_logit_softcapping=-1.0)
  with pytest.raises(ValueError, match="model_type must be one of"):
    ModelConfig(model_type="gpt2")
  with pytest.raises(ValueError, match="cannot express qk_norm=True"):
    ModelConfig(qk_norm=True).to_hf_config()
  assert ModelConfig(layer_types=[F, S], sliding_window=4).layer_types == (F, S)


# ------------------------------------------------------------------- against transformers

def _transformers():
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError:
    pytest.skip("needs torch and transformers (see requirements-bench.txt)")
  return transformers


def _make_golden():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "make_golden.py")
  spec = importlib.util.spec_from_file_location("make_golden", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("family", hf_config.MODEL_TYPES)
def test_defaults_match_transformers(family):
  """hf_config.DEFAULTS (used for keys a config.json leaves out) are transformers' own."""
  transformers = _transformers()
  cls = getattr(transformers, _make_golden().FAMILIES[family][0])
  rope = cls().to_dict().get("rope_parameters") or {}
  for key, value in hf_config.DEFAULTS[family].items():
    if key == "rope_theta":
      got = (rope.get(F) or rope)["rope_theta"]
    elif key == "rope_local_base_freq":
      got = rope[S]["rope_theta"]
    elif key == "sliding_window_pattern":
      got = cls()._sliding_window_pattern  # pylint: disable=protected-access
    else:   # the class field's default (Qwen's __post_init__ drops an unused window)
      got = cls.__dataclass_fields__[key].default
    assert got == value, (family, key, got, value)


@pytest.mark.slow
@pytest.mark.parametrize("family", hf_config.MODEL_TYPES)
def test_fresh_checkpoint_equals_transformers(family, tmp_path):
  """A new random checkpoint (another seed than the fixtures) written by the installed
  transformers: engine greedy tokens (block sizes 1, 16) and paged last-step logits equal
  transformers' on 3 prompts x 32 tokens."""
  _transformers()
  from experiments import generate  # pylint: disable=g-import-not-at-top
  from paged_greedy import paged_greedy  # pylint: disable=g-import-not-at-top
  from paged_jax.models import load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  mg = _make_golden()
  model = mg.build(family, str(tmp_path), seed=11)
  want = mg.golden(model, family)
  assert want["min_top2_margin"] > 1e-4
  ids = ";".join(",".join(str(t) for t in p) for p in want["prompts"])
  config, params = load_hf_checkpoint(str(tmp_path))
  assert config.model_type == family
  for block_size in (1, 16):
    got = generate.run(checkpoint=str(tmp_path), prompt_ids=ids, max_tokens=mg.MAX_TOKENS,
                       block_size=block_size)
    assert got["outputs"] == want["outputs"], block_size
  _, last = paged_greedy(config, params, want["prompts"], mg.MAX_TOKENS, 16)
  np.testing.assert_allclose(last, np.asarray(want["last_logits"]), rtol=1e-4, atol=1e-4)
