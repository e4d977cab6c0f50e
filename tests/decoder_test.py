"""The one decoder with every family feature on, paged == dense oracle on every backend.

The golden fixtures (hf_golden_test.py) pin each family to transformers; this pins the
paged path to the dense oracle where the fixtures cannot reach: head_dim 16 (the Pallas
kernels' minimum), decode-only steps through the decode kernel, a bf16 Gemma model.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from distributed_fixtures import random_params
from paged_greedy import paged_greedy
from paged_jax import attention
from paged_jax.config import ModelConfig
from paged_jax.models import dense, init_params

F, S = "full_attention", "sliding_attention"
# Gemma-3-like, every feature on: QK-norm, (1 + w) sandwich norms, GeGLU, scaled
# embeddings, query_pre_attn_scalar, attention and final soft caps, a window of 5 on layer
# 0, local RoPE base 10 vs global 1000 with linear scaling, q/k/v/o biases.
GEMMA_LIKE = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=16, model_type="gemma3_text", hidden_act="gelu_pytorch_tanh",
    qk_norm=True, rms_norm_unit_offset=True, sandwich_norms=True,
    embedding_multiplier=32 ** 0.5, query_pre_attn_scalar=20.0, attn_logit_softcapping=3.0,
    final_logit_softcapping=8.0, sliding_window=5, layer_types=(S, F), sliding_rope_theta=10.0,
    rope_theta=1000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, qkv_bias=True,
    o_proj_bias=True)
PROMPTS = [[5, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14]]


_dense_jit = jax.jit(dense.forward, static_argnums=1)


def _dense_greedy_steps(config, params, prompt, generated):
  seq = jnp.asarray(list(prompt) + list(generated[:-1]), jnp.int32)
  return np.asarray(_dense_jit(params, config, seq))[len(prompt) - 1:]


@pytest.mark.parametrize("backend", [
    "cpu", "reference", pytest.param("pallas_interpret", marks=pytest.mark.slow)])
def test_every_feature_paged_equals_dense(backend):
  params = random_params(GEMMA_LIKE, 3)
  outs, last = paged_greedy(GEMMA_LIKE, params, PROMPTS, 8, 4, backend=backend,
                            decode_only=True)
  for prompt, got, row in zip(PROMPTS, outs, last):
    steps = _dense_greedy_steps(GEMMA_LIKE, params, prompt, got)
    assert [int(t) for t in steps.argmax(-1)] == got
    np.testing.assert_allclose(row, steps[-1], rtol=2e-4, atol=2e-4)
  assert len({t for o in outs for t in o}) > 3   # not a degenerate repeat


def test_decode_kernel_gets_the_layer_window_cap_and_scale(monkeypatch):
  """Each layer passes its own sliding window (None on full layers), the soft cap and the
  query_pre_attn_scalar scale to the attention entry."""
  calls = []
  original = attention.attention_from_metadata
  monkeypatch.setattr(attention, "attention_from_metadata",
                      lambda *a, **kw: calls.append(kw) or original(*a, **kw))
  paged_greedy(GEMMA_LIKE, random_params(GEMMA_LIKE, 3), PROMPTS[:1], 1, 4, backend="cpu")
  assert [(c.get("sliding_window"), c["soft_cap"], c["sm_scale"]) for c in calls] == [
      (5, 3.0, 20.0 ** -0.5), (None, 3.0, 20.0 ** -0.5)]


def test_bfloat16_gemma_close_to_float32_dense():
  config16 = dataclasses.replace(GEMMA_LIKE, dtype="bfloat16")
  params32 = random_params(GEMMA_LIKE, 5)
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params32)
  assert config16.cache_config(block_size=4).dtype == "bfloat16"   # pages follow the model
  outs, last = paged_greedy(config16, params16, PROMPTS, 1, 4, backend="cpu")
  for prompt, got, row in zip(PROMPTS, outs, last):
    want = _dense_greedy_steps(GEMMA_LIKE, params32, prompt, got)[-1]
    assert np.abs(row - want).max() / np.abs(want).max() < 0.05


def test_init_params_have_every_family_parameter():
  flat = traverse_util.flatten_dict(init_params(GEMMA_LIKE, jax.random.key(0)))
  shapes = {"/".join(k): v.shape for k, v in flat.items()}
  layer = "params/model/layers_0/"
  assert shapes[layer + "self_attn/q_norm/weight"] == (16,)
  assert shapes[layer + "self_attn/q_proj/bias"] == (32,)
  assert shapes[layer + "self_attn/o_proj/bias"] == (32,)
  assert shapes[layer + "pre_feedforward_layernorm/weight"] == (32,)
  assert shapes[layer + "post_feedforward_layernorm/weight"] == (32,)
  assert layer + "mlp/up_proj/bias" not in shapes
  # (1 + w) norms start at w = 0: identity scale, as transformers initialises Gemma.
  assert not np.asarray(flat[("params", "model", "norm", "weight")]).any()
