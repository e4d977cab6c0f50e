"""Every model family split tp ways equals one device: run by tests/distributed_test.py in a
subprocess (with tests/distributed_cases.py) on 8 simulated CPU devices.

Not collected directly (no `_test.py` suffix): it needs
XLA_FLAGS=--xla_force_host_platform_device_count=N (N >= 4) before JAX initializes. By hand:

  XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python -m pytest -q \
      tests/distributed_family_cases.py            # add -m "not slow" for the default tier

Each model (`fx.family_config`: the fields of a family's golden config.json, 8 query heads
over 4 KV heads; `fx.every_feature_config`: all of them at once) gets random O(1)
parameters, so q/k/v and o/down biases, QK-norm weights, sandwich norms, soft caps, scaled
embeddings and sliding windows all move the logits. Default tier: the every-feature model at
tp=2; slow tier: every family and the every-feature model at tp=2 and tp=4 (one KV head per
shard).
"""

import functools

import jax
import numpy as np
import pytest

import distributed_fixtures as fx
from paged_jax import kv_cache
from paged_jax.distributed import TensorParallelDecoder, make_mesh, make_tp_engine
from paged_jax.engine import Engine, SamplingParams, release_compiled
from paged_jax.models.decoder import DecoderForCausalLM

MIN_DEVICES = 4
EVERY_FEATURE = "every_feature"
GRID = [(EVERY_FEATURE, 2)] + [
    pytest.param(name, tp, marks=pytest.mark.slow)
    for name in fx.FAMILIES + (EVERY_FEATURE,) for tp in (2, 4) if (name, tp) != (EVERY_FEATURE, 2)]
PROMPTS = fx.PROMPTS[:3]   # 9, 3 and 14 tokens: past the fixtures' sliding window of 8
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
# Every step at the largest shape: two compiled steps per engine instead of a bucket each
# (tests/distributed_cases.py covers the bucketed tp engine).
ENGINE_KW = dict(fx.ENGINE_KW, shape_buckets=False)


def setup_module():
  if jax.device_count() < MIN_DEVICES:
    pytest.fail(f"run with XLA_FLAGS=--xla_force_host_platform_device_count={MIN_DEVICES} "
                f"(found {jax.device_count()} devices)")


@pytest.fixture(autouse=True)
def _release_compiled_code():
  """Each test compiles a new model's steps: drop them after it, so the process stays far
  from Linux's per-process memory-map limit (see tests/conftest.py)."""
  yield
  release_compiled()


@functools.lru_cache(maxsize=None)
def model(name):
  config = fx.every_feature_config() if name == EVERY_FEATURE else fx.family_config(name)
  return config, fx.random_params(config, fx.PARAMS_SEED)


def _cache(config):
  return config.cache_config(hybrid_kv=False,   # tensor-parallel engines keep one pool
                             block_size=fx.CACHE.block_size, num_blocks=fx.CACHE.num_blocks,
                             max_seqs=fx.CACHE.max_seqs,
                             max_blocks_per_seq=fx.CACHE.max_blocks_per_seq)


@functools.lru_cache(maxsize=None)
def single_device_outputs(family):
  config, params = model(family)
  engine = Engine(config, params, _cache(config), **ENGINE_KW)
  outs = engine.generate(PROMPTS, GREEDY)
  return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("family,tp", GRID)
def test_family_tp_forward_logits_and_kv_match_single_device(family, tp):
  """Ragged prefill chunks then decodes (fx.FORWARD_SCHEDULE), two sequences of 12-13
  tokens: the tp forward's logits and K/V pages equal one device's."""
  config, params = model(family)
  cache = _cache(config)
  single = jax.jit(DecoderForCausalLM(config, attention_backend="reference").apply)
  tp_model = TensorParallelDecoder(config, make_mesh(tp=tp), attention_backend="reference")
  sharded = jax.jit(tp_model.apply)
  params_tp = tp_model.shard_params(params)
  pages_1, pages_tp = kv_cache.init(cache), tp_model.init_pages(cache)
  for tokens, positions, fields in fx.forward_inputs(seed=tp):
    meta = fx.as_meta(fields)
    want, pages_1 = single(params, tokens, positions, pages_1, meta)
    got, pages_tp = sharded(params_tp, tokens, positions, pages_tp, meta)
    want, got = np.asarray(want), np.asarray(got)
    assert np.std(want) > 0.5   # well-separated logits: a sharp comparison
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  for name in ("k", "v"):
    got_f, want_f = getattr(pages_tp, name), getattr(pages_1, name)
    assert got_f.sharding.spec[1] == "tp" and len(got_f.addressable_shards) == tp
    np.testing.assert_allclose(np.asarray(got_f), np.asarray(want_f), rtol=1e-4, atol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("family,tp", GRID)
def test_family_tp_engine_greedy_matches_single_device(family, tp):
  config, params = model(family)
  want = single_device_outputs(family)
  assert len({t for o in want for t in o}) > 3   # not a degenerate repeat
  engine = make_tp_engine(config, params, _cache(config), mesh=make_mesh(tp=tp),
                          **ENGINE_KW)
  outs = engine.generate(PROMPTS, GREEDY)
  assert [o.outputs[0] for o in outs] == want
