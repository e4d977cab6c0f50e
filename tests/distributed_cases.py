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

from paged_jax import attention, kv_cache
from paged_jax.config import ModelConfig
from paged_jax.distributed import (DataParallelEngine, TensorParallelLlama, make_mesh,
                                   make_tp_engine)
from paged_jax.engine import Engine, SamplingParams
from paged_jax.models import llama

NUM_DEVICES = 8


def setup_module():
  if jax.device_count() != NUM_DEVICES:
    pytest.fail(f"run with XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES} "
                f"(found {jax.device_count()} devices)")


def model_config(**kw):
  # 16 query heads over 8 KV heads (GQA, group 2): every tp in {1, 2, 4, 8} divides both.
  base = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=16,
              num_kv_heads=8, head_dim=8, rope_theta=500.0, max_position_embeddings=256)
  base.update(kw)
  return ModelConfig(**base)


def random_params(config, seed):
  """Flax-initialised tree refilled with O(1) random values so logits are well separated."""
  params = llama.init_params(config, jax.random.key(seed))
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  new = [1.0 + 0.3 * jax.random.normal(k, x.shape) if x.ndim == 1 else
         jax.random.normal(k, x.shape) / np.sqrt(x.shape[0]) * 1.5
         for k, x in zip(keys, leaves)]
  return jax.tree_util.tree_unflatten(treedef, new)


CONFIG = model_config()
PARAMS = random_params(CONFIG, seed=7)
CACHE = CONFIG.cache_config(block_size=4, num_blocks=48, max_seqs=8, max_blocks_per_seq=12)
ENGINE_KW = dict(max_num_batched_tokens=8, attention_backend="reference")
GREEDY = SamplingParams(max_tokens=7, temperature=0.0)
_rng = np.random.default_rng(3)
PROMPTS = [list(_rng.integers(0, 97, n)) for n in (9, 3, 14, 5)]


@functools.lru_cache(maxsize=None)
def single_device_outputs():
  engine = Engine(CONFIG, PARAMS, CACHE, **ENGINE_KW)
  outs = engine.generate(PROMPTS, GREEDY)
  return [o.outputs[0] for o in outs], np.asarray(engine.state.pages.k)


def ragged_step(rng, tables, lens, new_counts, t_rows=16):
  """Host-built metadata for one ragged step appending new_counts[i] tokens to seq i."""
  bs = CACHE.block_size
  toks, pos, slots, cu = [], [], [], [0]
  for i, n in enumerate(new_counts):
    for p in range(lens[i], lens[i] + n):
      toks.append(int(rng.integers(0, 97)))
      pos.append(p)
      slots.append(tables[i][p // bs] * bs + p % bs)
    lens[i] += n
    cu.append(len(toks))
  s, pad = len(new_counts), t_rows - len(toks)
  meta = attention.AttentionMetadata(
      slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
      block_tables=jnp.asarray(tables, jnp.int32),
      kv_lens=jnp.asarray(lens, jnp.int32),
      cu_q_lens=jnp.asarray(cu, jnp.int32),
      num_seqs=jnp.asarray(s, jnp.int32),
      logits_indices=jnp.asarray([c - 1 for c in cu[1:]], jnp.int32))
  return (jnp.asarray(toks + [1] * pad, jnp.int32), jnp.asarray(pos + [0] * pad, jnp.int32),
          meta, toks)


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_forward_logits_match_single_device(tp):
  rng = np.random.default_rng(tp)
  # Two sequences on shuffled, disjoint blocks; a prefill step, then mixed steps.
  perm = rng.permutation(CACHE.num_blocks)
  tables = [list(perm[:12]), list(perm[12:24])]
  lens = [0, 0]
  single = jax.jit(llama.LlamaForCausalLM(CONFIG, attention_backend="reference").apply)
  tp_model = TensorParallelLlama(CONFIG, make_mesh(tp=tp), attention_backend="reference")
  sharded = jax.jit(tp_model.apply)
  params = tp_model.shard_params(PARAMS)
  pages_1, pages_tp = kv_cache.init(CACHE), tp_model.init_pages(CACHE)
  for counts in ([7, 5], [1, 6], [1, 1], [3, 1]):
    tokens, positions, meta, toks = ragged_step(rng, tables, lens, counts)
    want, pages_1 = single(PARAMS, tokens, positions, pages_1, meta)
    got, pages_tp = sharded(params, tokens, positions, pages_tp, meta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))
  # Same K/V, each shard holding its own KV heads.
  np.testing.assert_allclose(np.asarray(pages_tp.k), np.asarray(pages_1.k), rtol=1e-5, atol=1e-5)
  assert pages_tp.k.sharding.spec[1] == "tp"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
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


@pytest.mark.parametrize("tp,routing", [(4, "least_loaded"), (1, "prefix_affinity")])
def test_dp2_greedy_matches_single_device(tp, routing):
  want, _ = single_device_outputs()
  front = DataParallelEngine(CONFIG, PARAMS, CACHE, mesh=make_mesh(tp=tp, dp=2),
                             routing=routing, **ENGINE_KW)
  try:
    prompts = PROMPTS + [PROMPTS[2][:8] + [1, 2], PROMPTS[2]]
    outs = front.generate(prompts, GREEDY)
    assert [o.outputs[0] for o in outs[:4]] == want
    assert outs[5].outputs[0] == want[2]
    m = front.metrics()
    routed = [r["routed"] for r in m["replicas"]]
    assert sum(routed) == len(prompts) and min(routed) >= 1       # both replicas served
    assert m["combined"]["finished"] == len(prompts)
    assert m["combined"]["generated_tokens"] == sum(r.get("generated_tokens", 0)
                                                    for r in m["replicas"]) == 7 * len(prompts)
    devices = [set(r["devices"]) for r in m["replicas"]]
    assert not devices[0] & devices[1] and all(len(d) == tp for d in devices)
    if routing == "prefix_affinity":  # prompts 2, 4, 5 share their first two blocks
      assert front.replica_of  # (mapping dropped on finish; checked via router)
      assert m["combined"]["affinity_hits"] >= 2
  finally:
    front.close()


def test_bad_mesh_shapes_raise_clear_errors():
  with pytest.raises(ValueError, match=r"needs 16 devices, only 8"):
    make_mesh(tp=16)
  with pytest.raises(ValueError, match=r"dp=2 x tp=8 needs 16 devices"):
    make_mesh(tp=8, dp=2)
  with pytest.raises(ValueError, match=r"tp=4 does not divide the model's num_kv_heads=2"):
    make_mesh(tp=4, model_config=model_config(num_heads=8, num_kv_heads=2))
  with pytest.raises(ValueError, match=r"intermediate_size=66"):
    make_tp_engine(model_config(intermediate_size=66), PARAMS, CACHE, mesh=make_mesh(tp=4))
  with pytest.raises(ValueError, match=r"1-D \('tp',\) mesh"):
    TensorParallelLlama(CONFIG, make_mesh(tp=2, dp=2))
  with pytest.raises(ValueError, match=r"tp must be >= 1"):
    make_mesh(tp=0)
