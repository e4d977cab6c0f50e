"""8-device checks of paged_jax.distributed, run by tests/distributed_test.py in a subprocess.

Not collected directly (no `_test.py` suffix): it needs
XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX initializes, which
must not leak into the rest of the suite. Run by hand:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q \
      tests/distributed_cases.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distributed_fixtures as fx
from paged_jax import kv_cache
from paged_jax.distributed import (DataParallelEngine, TensorParallelDecoder, make_mesh,
                                   make_tp_engine)
from paged_jax.engine import Engine, SamplingParams
from paged_jax.models import llama

NUM_DEVICES = 8


def setup_module():
  if jax.device_count() != NUM_DEVICES:
    pytest.fail(f"run with XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES} "
                f"(found {jax.device_count()} devices)")


CONFIG, CACHE, ENGINE_KW, PROMPTS = fx.CONFIG, fx.CACHE, fx.ENGINE_KW, fx.PROMPTS
PARAMS = fx.params()
GREEDY = fx.greedy()


@functools.lru_cache(maxsize=None)
def single_device_outputs():
  engine = Engine(CONFIG, PARAMS, CACHE, **ENGINE_KW)
  outs = engine.generate(PROMPTS, GREEDY)
  return [o.outputs[0] for o in outs], np.asarray(engine.state.pages.k)


@pytest.mark.parametrize("tp,dtype,tol", [(8, "float32", 1e-5), (4, "int8", 2e-3),
                                          pytest.param(2, "float32", 1e-5,
                                                       marks=pytest.mark.slow)])
def test_tp_forward_logits_match_single_device(tp, dtype, tol):
  cache = CACHE.replace(dtype=dtype)
  single = jax.jit(llama.LlamaForCausalLM(CONFIG, attention_backend="reference").apply)
  tp_model = TensorParallelDecoder(CONFIG, make_mesh(tp=tp), attention_backend="reference")
  sharded = jax.jit(tp_model.apply)
  params = tp_model.shard_params(PARAMS)
  pages_1, pages_tp = kv_cache.init(cache), tp_model.init_pages(cache)
  for tokens, positions, fields in fx.forward_inputs(seed=tp):
    meta = fx.as_meta(fields)
    want, pages_1 = single(PARAMS, tokens, positions, pages_1, meta)
    got, pages_tp = sharded(params, tokens, positions, pages_tp, meta)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))
    assert np.std(np.asarray(want)) > 0.5   # well-separated logits: a sharp comparison
  # Same K/V (and int8 scales), each shard holding its own KV heads.
  fields = ("k", "v") + (("k_scale", "v_scale") if cache.quantized else ())
  for name in fields:
    got_f, want_f = getattr(pages_tp, name), getattr(pages_1, name)
    assert got_f.sharding.spec[1] == "tp" and len(got_f.addressable_shards) == tp
    got_f, want_f = np.asarray(got_f, np.float32), np.asarray(want_f, np.float32)
    if dtype == "int8" and name in ("k", "v"):
      # A value on a rounding boundary may land one int8 step away; almost none do.
      diff = np.abs(got_f - want_f)
      assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, name
    else:
      np.testing.assert_allclose(got_f, want_f, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("tp", [2, 8, *(pytest.param(t, marks=pytest.mark.slow) for t in (1, 4))])
def test_tp_engine_greedy_matches_single_device_and_pages_are_sharded(tp):
  want, want_k = single_device_outputs()
  mesh = make_mesh(tp=tp)
  engine = make_tp_engine(CONFIG, PARAMS, CACHE, mesh=mesh, **ENGINE_KW)
  outs = engine.generate(PROMPTS, GREEDY)
  assert [o.outputs[0] for o in outs] == want
  k = engine.state.pages.k
  heads = CONFIG.num_kv_heads // tp
  shards = sorted(k.addressable_shards, key=lambda s: s.index[1].start or 0)
  assert len(shards) == tp
  assert {s.device for s in shards} == set(mesh.devices.flat)
  full = np.asarray(k)
  for i, shard in enumerate(shards):
    assert shard.data.shape == (CACHE.num_layers, heads, CACHE.num_blocks, CACHE.block_size,
                                CACHE.head_dim)
    assert shard.data.nbytes == full.nbytes // tp
    np.testing.assert_array_equal(np.asarray(shard.data), full[:, i * heads:(i + 1) * heads])
  # Same blocks hold the same K as on one device (same scheduler, same allocator).
  np.testing.assert_allclose(full, want_k, rtol=1e-5, atol=1e-5)
  # Block-manager state is replicated: every device holds the whole table.
  tables = engine.state.blocks.block_tables
  assert tables.sharding.is_fully_replicated and len(tables.addressable_shards) == tp


@pytest.mark.parametrize("tp,routing", [(4, "prefix_affinity"),
                                        pytest.param(1, "least_loaded", marks=pytest.mark.slow)])
def test_dp2_greedy_matches_single_device(tp, routing):
  want, _ = single_device_outputs()
  front = DataParallelEngine(CONFIG, PARAMS, CACHE, mesh=make_mesh(tp=tp, dp=2),
                             routing=routing, **ENGINE_KW)
  try:
    # Prompts 4 and 5 share their first block with prompt 2.
    prompts = PROMPTS + [PROMPTS[2][:8] + [1, 2], PROMPTS[2]]
    ids = [front.add_request(p, GREEDY) for p in prompts]
    replica = [front.replica_of(i) for i in ids]
    done = {}
    while front.has_unfinished():
      done.update((o.request_id, o.outputs[0]) for o in front.step())
    front.flush()
    outs = [done[i] for i in ids]
    assert outs[:4] == want and outs[5] == want[2]
    m = front.metrics()
    routed = [r["routed"] for r in m["replicas"]]
    assert routed == [replica.count(0), replica.count(1)] and min(routed) >= 1
    assert m["combined"]["finished"] == len(prompts) == sum(r["finished"] for r in m["replicas"])
    assert m["combined"]["generated_tokens"] == fx.MAX_TOKENS * len(prompts)
    assert m["combined"]["num_free_blocks"] == 2 * CACHE.num_blocks   # all freed after flush
    devices = [set(r["devices"]) for r in m["replicas"]]
    assert not devices[0] & devices[1] and all(len(d) == tp for d in devices)
    if routing == "prefix_affinity":
      assert replica[2] == replica[4] == replica[5]
      assert m["combined"]["affinity_hits"] == 2
  finally:
    front.close()


def test_bad_mesh_shapes_raise_clear_errors():
  with pytest.raises(ValueError, match=r"needs 16 devices, only 8"):
    make_mesh(tp=16)
  with pytest.raises(ValueError, match=r"dp=2 x tp=8 needs 16 devices"):
    make_mesh(tp=8, dp=2)
  with pytest.raises(ValueError, match=r"tp=4 does not divide the model's num_kv_heads=2"):
    make_mesh(tp=4, model_config=fx.model_config(num_heads=8, num_kv_heads=2))
  with pytest.raises(ValueError, match=r"intermediate_size=66"):
    make_tp_engine(fx.model_config(intermediate_size=66), PARAMS, CACHE, mesh=make_mesh(tp=4))
  with pytest.raises(ValueError, match=r"1-D \('tp',\) mesh"):
    TensorParallelDecoder(CONFIG, make_mesh(tp=2, dp=2))
  with pytest.raises(ValueError, match=r"tp must be >= 1"):
    make_mesh(tp=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tp_engine_multistep_and_preemption_match_single_device(mode):
  """A cache too small for all prompts (preemption) and 3 decode steps per device call."""
  cache = CACHE.replace(num_blocks=6)   # the longest request needs all 6 blocks
  kw = dict(ENGINE_KW, decode_steps_per_sync=3, preemption_mode=mode)
  single = Engine(CONFIG, PARAMS, cache, **kw)
  want = [o.outputs[0] for o in single.generate(PROMPTS, GREEDY)]
  engine = make_tp_engine(CONFIG, PARAMS, cache, mesh=make_mesh(tp=2), **kw)
  got = [o.outputs[0] for o in engine.generate(PROMPTS, GREEDY)]
  assert got == want
  assert engine.num_preemptions == single.num_preemptions > 0
  if mode == "swap":
    assert engine.num_swaps == single.num_swaps > 0
