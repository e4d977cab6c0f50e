"""Every family's paged forward equals transformers, on committed golden fixtures (no torch).

tests/data/hf_golden/<family>/ holds a tiny random checkpoint written by transformers'
`save_pretrained` (fp32) and golden.json: 3 prompts, transformers' greedy tokens for 32
steps, the last step's logits and a checksum of every step's logits (made by
tests/data/make_golden.py). Here the checkpoint is loaded by `load_hf_checkpoint` and decoded
through the paged decoder (block sizes 1 and 16), the dense oracle, and (slow tier) the
engine behind `experiments.generate`; each must give transformers' tokens and logits.
"""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from paged_greedy import paged_greedy
from paged_jax.models import dense, load_hf_checkpoint

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_golden")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
# What each fixture's config.json must turn into: the fields that make the family.
FEATURES = {
    "llama": dict(qkv_bias=True, o_proj_bias=True, mlp_bias=True, tie_word_embeddings=False,
                  windows=(None, None)),
    "mistral": dict(qkv_bias=False, windows=(8, 8)),
    "qwen2": dict(qkv_bias=True, o_proj_bias=False, tie_word_embeddings=True, windows=(None, 8)),
    "qwen3": dict(qk_norm=True, qkv_bias=False, tie_word_embeddings=True, windows=(None, None)),
    "gemma2": dict(hidden_act="gelu_pytorch_tanh", rms_norm_unit_offset=True,
                   sandwich_norms=True, embedding_multiplier=4.0, query_pre_attn_scalar=32.0,
                   attn_logit_softcapping=5.0, final_logit_softcapping=8.0, windows=(8, None)),
    "gemma3_text": dict(hidden_act="gelu_pytorch_tanh", qk_norm=True, rms_norm_unit_offset=True,
                        sandwich_norms=True, embedding_multiplier=4.0,
                        query_pre_attn_scalar=12.0, attn_logit_softcapping=None,
                        final_logit_softcapping=8.0, sliding_rope_theta=10.0, rope_theta=1000.0,
                        windows=(8, None)),
}
# Fields whose change must change the model's outputs on the fixture's prompts (so the
# fixture really exercises them): field -> the value it is switched to.
SWITCHES = {
    "llama": dict(rope_scaling=None),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(sliding_window=None, layer_types=None),
    "qwen3": dict(qk_norm=False, rope_scaling=None),
    "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                   query_pre_attn_scalar=None, sliding_window=None, layer_types=None,
                   hidden_act="silu", rms_norm_unit_offset=False, embedding_multiplier=1.0),
    "gemma3_text": dict(sliding_rope_theta=None, rope_scaling=None, qk_norm=False,
                        sliding_window=None, layer_types=None),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
  directory = os.path.join(GOLDEN, request.param)
  with open(os.path.join(directory, "golden.json")) as f:
    golden = json.load(f)
  config, params = load_hf_checkpoint(directory)
  return request.param, directory, config, params, golden


def test_fixture_config_is_the_family(family):
  name, _, config, _, golden = family
  assert config.model_type == golden["family"] == name
  want = dict(FEATURES[name])
  windows = want.pop("windows")
  assert {k: getattr(config, k) for k in want} == want
  assert tuple(config.layer_sliding_window(i) for i in range(config.num_layers)) == windows
  # A meaningful comparison: no greedy step was a near tie in transformers.
  assert golden["min_top2_margin"] > 1e-3


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_greedy_and_logits_equal_transformers(family, block_size):
  _, _, config, params, golden = family
  outputs, last = paged_greedy(config, params, golden["prompts"], golden["max_tokens"],
                               block_size)
  assert outputs == golden["outputs"]
  np.testing.assert_allclose(last, np.asarray(golden["last_logits"]), rtol=1e-4, atol=1e-4)


def _dense_steps(config, params, prompt, generated):
  """f32[len(generated), vocab] dense-oracle logits that predict each generated token."""
  seq = jnp.asarray(list(prompt) + list(generated[:-1]), jnp.int32)
  return np.asarray(dense.forward(params, config, seq))[len(prompt) - 1:]


def test_dense_oracle_equals_transformers_and_every_feature_matters(family):
  name, _, config, params, golden = family
  for prompt, want, last, abs_sum in zip(golden["prompts"], golden["outputs"],
                                         golden["last_logits"], golden["logits_abs_sum"]):
    steps = _dense_steps(config, params, prompt, want)
    assert [int(t) for t in steps.argmax(-1)] == want
    np.testing.assert_allclose(steps[-1], last, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.abs(steps).astype(np.float64).sum(), abs_sum, rtol=1e-5)
  # Each feature the family adds changes what the fixture's prompts give.
  prompt, want = golden["prompts"][2], golden["outputs"][2]
  base = _dense_steps(config, params, prompt, want)
  for field, value in SWITCHES[name].items():
    changes = {field: value}
    if field == "sliding_window":
      changes["layer_types"] = None
    other = dataclasses.replace(config, **changes)
    diff = np.abs(_dense_steps(other, params, prompt, want) - base).max()
    assert diff > 1e-2, (field, diff)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16])
def test_engine_generate_equals_transformers(family, block_size):
  """The CLI contract: `experiments.generate --checkpoint=DIR` prints transformers' tokens."""
  from experiments import generate  # pylint: disable=g-import-not-at-top
  _, directory, _, _, golden = family
  ids = ";".join(",".join(str(t) for t in p) for p in golden["prompts"])
  result = generate.run(checkpoint=directory, prompt_ids=ids, max_tokens=golden["max_tokens"],
                        block_size=block_size)
  assert result == {"outputs": golden["outputs"]}


@pytest.mark.slow
def test_generate_cli_prints_transformers_tokens():
  """`python -m experiments.generate --checkpoint=DIR ...` as a user runs it (Gemma-3)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  directory = os.path.join(GOLDEN, "gemma3_text")
  with open(os.path.join(directory, "golden.json")) as f:
    golden = json.load(f)
  ids = ";".join(",".join(str(t) for t in p) for p in golden["prompts"])
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.generate", f"--checkpoint={directory}",
       f"--prompt_ids={ids}", f"--max_tokens={golden['max_tokens']}", "--temperature=0",
       "--block_size=16"], cwd=root, capture_output=True, text=True, timeout=600, check=False,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout) == {"outputs": golden["outputs"]}
