"""paged_jax.distributed: host-side checks here, 8-device checks in a subprocess.

The 8-device checks (tests/distributed_cases.py: tp in {1, 2, 4, 8} and dp=2
engines vs one device, page shards, mesh errors; tests/distributed_family_cases.py: every
model family's tp forward and engine vs one device) need
XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts. Setting it
here would change the device count of every test sharing this pytest (xdist)
worker, so they run in a child pytest with its own environment.
"""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import distributed_fixtures as fx
from paged_jax.distributed import (DataParallelEngine, Router, TensorParallelDecoder,
                                   TensorParallelLlama, local_model_config, make_mesh,
                                   param_specs, validate_tp)
from paged_jax.models import init_params
from paged_jax.engine import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_cases(marker: str):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
         os.path.join("tests", "distributed_cases.py"),
         os.path.join("tests", "distributed_family_cases.py")]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, f"8-device cases failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
  assert re.search(r"\d+ passed", proc.stdout), proc.stdout[-2000:]


def test_eight_simulated_devices():
  """tp 1/2/4/8 engines and a dp=2 x tp=4 front match one device; pages really sharded; the
  every-feature model at tp=2 matches one device (logits, K/V, greedy tokens)."""
  _run_cases("not slow")


@pytest.mark.slow
def test_eight_simulated_devices_wide():
  _run_cases("slow")


def test_validate_tp_names_the_indivisible_dimension():
  c = fx.model_config(num_heads=12, num_kv_heads=6, intermediate_size=40)
  validate_tp(c, 2)
  with pytest.raises(ValueError, match=r"tp=4 does not divide the model's num_kv_heads=6.*"
                                       r"\[1, 2, 3, 6\]"):
    validate_tp(c, 4)
  with pytest.raises(ValueError, match=r"tp=3 does not divide the model's intermediate_size=40"):
    validate_tp(c, 3)
  # (num_heads is a multiple of num_kv_heads, so a tp dividing the KV heads divides it too.)
  with pytest.raises(ValueError, match=r"cache_config.num_kv_heads=4 does not match"):
    validate_tp(c, 2, fx.CACHE.replace(num_kv_heads=4, num_layers=2, head_dim=8))
  with pytest.raises(ValueError, match=r"tp must be >= 1"):
    validate_tp(c, 0)
  with pytest.raises(TypeError, match=r"tp must be an int"):
    validate_tp(c, 2.0)


def test_make_mesh_rejects_too_few_devices():
  one = jax.devices()[:1]
  with pytest.raises(ValueError, match=r"mesh dp=1 x tp=2 needs 2 devices, only 1 .*"
                                       r"xla_force_host_platform_device_count"):
    make_mesh(tp=2, devices=one)
  with pytest.raises(ValueError, match=r"dp must be >= 1"):
    make_mesh(tp=1, dp=0, devices=one)
  with pytest.raises(ValueError, match="repeat"):
    make_mesh(tp=2, devices=one * 2)
  mesh = make_mesh(tp=1, devices=one)
  assert mesh.axis_names == ("tp",) and mesh.devices.shape == (1,)


def test_local_config_and_param_specs_split_megatron_style():
  local = local_model_config(fx.CONFIG, 4)
  assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 2, 16)
  assert local.head_dim == fx.CONFIG.head_dim and local.hidden_size == fx.CONFIG.hidden_size
  params = fx.params()
  specs = param_specs(params)
  layer = specs["params"]["model"]["layers_1"]
  for name in ("q_proj", "k_proj", "v_proj"):
    assert layer["self_attn"][name]["kernel"] == P(None, "tp")
  assert layer["self_attn"]["o_proj"]["kernel"] == P("tp", None)
  assert layer["mlp"]["gate_proj"]["kernel"] == P(None, "tp")
  assert layer["mlp"]["up_proj"]["kernel"] == P(None, "tp")
  assert layer["mlp"]["down_proj"]["kernel"] == P("tp", None)
  assert layer["input_layernorm"]["weight"] == P()
  assert specs["params"]["model"]["embed_tokens"]["embedding"] == P()
  flat = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert sum(s != P() for s in flat) == 7 * fx.CONFIG.num_layers
  with pytest.raises(ValueError, match="LlamaForCausalLM"):
    param_specs({"w": np.ones((2, 2))})


def test_param_specs_split_every_family_parameter():
  """Column-parallel biases split like their outputs, row-parallel biases whole (added once
  after the all-reduce), QK-norm and sandwich norms replicated; an unknown tensor raises."""
  config = fx.every_feature_config()
  params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  specs = param_specs(params)["params"]
  layer = specs["model"]["layers_0"]
  attn, mlp = layer["self_attn"], layer["mlp"]
  for module in (attn["q_proj"], attn["k_proj"], attn["v_proj"], mlp["gate_proj"],
                 mlp["up_proj"]):
    assert module == {"kernel": P(None, "tp"), "bias": P("tp")}
  for module in (attn["o_proj"], mlp["down_proj"]):
    assert module == {"kernel": P("tp", None), "bias": P()}
  assert attn["q_norm"]["weight"] == attn["k_norm"]["weight"] == P()
  for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"):
    assert layer[norm]["weight"] == P()
  assert "lm_head" not in specs and specs["model"]["embed_tokens"]["embedding"] == P()
  flat = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert sum(s != P() for s in flat) == 12 * config.num_layers
  # The per-shard model's parameter shapes are exactly the full ones split by these specs.
  local = jax.eval_shape(lambda: init_params(local_model_config(config, 2), jax.random.key(0)))
  split = jax.tree_util.tree_map(
      lambda x, s: tuple(d // 2 if s and i < len(s) and s[i] == "tp" else d
                         for i, d in enumerate(x.shape)),
      params["params"], specs, is_leaf=lambda x: isinstance(x, P))
  assert split == jax.tree_util.tree_map(lambda x: x.shape, local["params"])
  params["params"]["model"]["layers_0"]["self_attn"]["rot"] = {"kernel": params["params"][
      "model"]["layers_0"]["self_attn"]["o_proj"]["kernel"]}
  with pytest.raises(ValueError, match=r"param params/model/layers_0/self_attn/rot/kernel "
                                       r"\(ndim 2\) has no tensor-parallel placement"):
    param_specs(params)
  assert TensorParallelLlama is TensorParallelDecoder


def test_family_configs_carry_the_features_tp_must_handle():
  """The slow family grid (tests/distributed_family_cases.py) exercises what it claims."""
  c = {name: fx.family_config(name) for name in fx.FAMILIES}
  assert all((x.num_heads, x.num_kv_heads, x.intermediate_size) == (8, 4, 64)
             for x in c.values())
  assert c["llama"].qkv_bias and c["llama"].o_proj_bias and c["llama"].mlp_bias
  assert c["qwen2"].qkv_bias and not c["qwen2"].o_proj_bias
  assert c["qwen3"].qk_norm and c["gemma3_text"].qk_norm
  assert c["qwen2"].tie_word_embeddings and not c["llama"].tie_word_embeddings
  assert c["gemma2"].attn_logit_softcapping and c["gemma2"].final_logit_softcapping
  assert c["gemma2"].embedding_multiplier != 1.0 and c["gemma3_text"].sandwich_norms
  assert c["gemma3_text"].sliding_rope_differs
  windows = {n: [x.layer_sliding_window(i) for i in range(x.num_layers)] for n, x in c.items()}
  assert windows["mistral"] == [8, 8] and windows["gemma2"] == [8, None]
  e = fx.every_feature_config()
  assert all(getattr(e, f) for f in ("qkv_bias", "o_proj_bias", "mlp_bias", "qk_norm",
                                     "sandwich_norms", "attn_logit_softcapping",
                                     "final_logit_softcapping", "tie_word_embeddings",
                                     "sliding_rope_differs"))


def test_router_least_loaded_balances_outstanding_blocks():
  rng = np.random.default_rng(0)
  router = Router(num_replicas=3, block_size=4, policy="least_loaded")
  lens = rng.integers(1, 60, 40)
  for i, n in enumerate(lens):
    want = min(range(3), key=lambda r: (router.load_blocks[r], router.load_requests[r], r))
    assert router.route(i, list(range(n)), max_tokens=8) == want
  expected = [0, 0, 0]
  for i, n in enumerate(lens):
    expected[router._cost[i][0]] += -(-(n + 8) // 4)  # pylint: disable=protected-access
  assert router.load_blocks == expected
  assert max(expected) - min(expected) <= -(-(max(lens) + 8) // 4)
  for i in range(40):
    router.finish(i)
  assert router.load_blocks == [0, 0, 0] and router.load_requests == [0, 0, 0]


def test_router_prefix_affinity_keeps_equal_prefixes_together():
  rng = np.random.default_rng(1)
  router = Router(num_replicas=2, block_size=4, policy="prefix_affinity", affinity_blocks=2)
  prefixes = [list(rng.integers(0, 50, 8)) for _ in range(6)]
  placed = {}
  for i in range(60):
    k = int(rng.integers(0, 6))
    tail = list(rng.integers(0, 50, int(rng.integers(0, 9))))
    r = router.route(i, prefixes[k] + tail, max_tokens=4)
    assert placed.setdefault(k, r) == r   # same 2-block prefix, same replica
  assert set(placed.values()) == {0, 1}   # distinct prefixes spread by load
  assert router.affinity_hits == 60 - len(placed)
  # Shorter than one block: no key, routed least-loaded; differing first block: new key.
  assert router.prefix_key([1, 2, 3]) is None
  assert router.prefix_key([1, 2, 3, 4, 5]) != router.prefix_key([1, 2, 3, 5, 5])
  assert router.prefix_key([1, 2, 3, 4, 5, 6, 7, 8, 9]) == router.prefix_key(
      [1, 2, 3, 4, 5, 6, 7, 8, 0])
  with pytest.raises(ValueError, match="policy must be one of"):
    Router(2, 4, policy="random")


def test_rejected_request_leaves_router_and_replicas_unchanged():
  front = DataParallelEngine(fx.CONFIG, fx.params(), fx.CACHE,
                             mesh=make_mesh(tp=1, devices=jax.devices()[:1]),
                             routing="least_loaded", **fx.ENGINE_KW)
  rid = front.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0))
  before = (list(front.router.load_blocks), list(front.router.routed))
  with pytest.raises(ValueError, match=r"prompt\[1\]=500 is not a token id"):
    front.add_request([1, 500], SamplingParams(max_tokens=3))
  with pytest.raises(ValueError, match="already in use"):
    front.add_request([1, 2], request_id=rid)
  assert (front.router.load_blocks, front.router.routed) == before
  assert front.replicas[0].scheduler.has_unfinished()
  with pytest.raises(ValueError, match="routing must be one of"):
    DataParallelEngine(fx.CONFIG, fx.params(), fx.CACHE, mesh=make_mesh(tp=1), routing="x")
