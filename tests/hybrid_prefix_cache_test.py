"""Prefix caching with hybrid KV (sliding-window layers in a pool of their own): one hit
length for both KV groups, the longest whose sliding window before its end still has its
blocks (`paged_jax/prefix_cache/sliding.py`).

Against independent references: the hit rule equals a plain-Python model written from
positions (the keys a sliding query can read); greedy outputs of a Gemma-like model with
hybrid KV and caching equal the dense oracle on prompts sharing prefixes longer and
shorter than the window, submitted in waves; the hits each wave gets equal a trie model
of what earlier waves computed (and never exceed it with a tight sliding pool); both pools
get every block back (free + cached = all); salts isolate; an interrupt changes nothing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_oracle import run_counting_dispatches_and_syncs
from hybrid_support import GEMMA, PARAMS, dense_greedy, run_through_an_interrupt
from paged_jax import prefix_cache as pc
from paged_jax.config import CacheConfig, sliding_pool_blocks
from paged_jax.engine import Engine, SamplingParams
from paged_jax.prefix_cache import sliding
from paged_jax.prefix_cache import state as st

BS, BUDGET, MAX_SEQS, W = 4, 8, 4, GEMMA.sliding_window
GEN = 8


def _model_hit(n_hit, live, bs, window):
  """The per-group rule from positions: a hit of n blocks is servable iff every position
  the first query after it (at n * bs) can read, (n * bs - window, n * bs), lies in a block
  whose sliding K/V is live; later queries read their own new keys or that same range."""
  for n in range(n_hit, -1, -1):
    read = range(max(n * bs - window + 1, 0), n * bs)
    if all(live[p // bs] for p in read):
      return n
  raise AssertionError("n = 0 reads nothing")


@pytest.mark.parametrize("bs,window", [(4, 6), (4, 1), (1, 5), (4, 16), (8, 4), (4, 8)])
def test_hit_rule_equals_the_position_model(bs, window):
  p = 12
  cc = CacheConfig(num_blocks=p, block_size=bs, max_seqs=2, max_blocks_per_seq=p)
  rng = np.random.default_rng(bs * 100 + window)

  @jax.jit
  def rule(cached, gen, comp_gen, owner, n_hit):
    cache = pc.init(cc)
    cache = cache.replace(block_meta=cache.block_meta.at[:, st.CACHED].set(cached)
                          .at[:, st.GEN].set(gen))
    comp = sliding.init(p, p, window).replace(
        sliding_of=jnp.arange(p, dtype=jnp.int32), sliding_gen=comp_gen, owner=owner)
    ids = jnp.where(jnp.arange(p) < n_hit, jnp.arange(p), -1)
    return sliding.hit_rule(comp, cache, n_hit, ids), sliding.live(comp, cache, ids)

  shorter = 0
  for _ in range(150):
    # Each block's companion is live, or stale in one of three ways.
    kind = rng.choice(4, size=p, p=[0.8, 0.08, 0.06, 0.06])
    cached = (kind != 1).astype(np.int32)
    gen = rng.integers(1, 5, size=p).astype(np.int32)
    comp_gen = np.where(kind == 2, gen + 1, gen).astype(np.int32)
    owner = np.where(kind == 3, (np.arange(p) + 1) % p, np.arange(p)).astype(np.int32)
    n_hit = int(rng.integers(0, p + 1))
    got, live = rule(cached, gen, comp_gen, owner, n_hit)
    want_live = kind == 0
    np.testing.assert_array_equal(np.asarray(live)[:n_hit], want_live[:n_hit])
    want = _model_hit(n_hit, want_live, bs, window)
    assert int(got) == want, (n_hit, kind, bs, window)
    shorter += want < n_hit
  assert shorter > 10 or window == 1          # the rule did cut hits (a window of 1: never)


def _engine(num_sliding_blocks=None, steps=1, num_blocks=96, eviction_policy="lru", **kw):
  extra = {} if num_sliding_blocks is None else dict(num_sliding_blocks=num_sliding_blocks)
  extra.update(eviction_policy=eviction_policy)
  cc = GEMMA.cache_config(hybrid_kv=True, max_num_batched_tokens=BUDGET,
                          decode_steps_per_sync=steps, block_size=BS, num_blocks=num_blocks,
                          max_seqs=MAX_SEQS, max_blocks_per_seq=16,
                          enable_prefix_caching=True, **extra)
  return Engine(GEMMA, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="cpu",
                decode_steps_per_sync=steps, shape_buckets=False, **kw)


rng = np.random.default_rng(3)
_tok = lambda n: [int(t) for t in rng.integers(1, 64, size=n)]
A, B, C = _tok(14), _tok(5), _tok(10)     # A longer than the window (6), B shorter
S1, S2, S3, S5, TAIL = _tok(5), _tok(4), _tok(6), _tok(3), _tok(3)
# Within a wave no two prompts share a first block (each wave's hits come from earlier
# waves only, so the trie model below predicts them); the wave 3 prompt `C+` extends a
# wave 1 prompt with that request's output (filled in at run time): hits into generated
# tokens' blocks.
WAVES = [[A + S1, B + S2, C], [A + S3, B + S2, _tok(12)], [A[:9] + S5, B + S1, "C+"]]


def _trie_hit(prompt, computed, bs):
  """Blocks of `prompt` a main-pool cache holding every full block of each `computed`
  sequence can hit (the last prompt token is always recomputed)."""
  best = 0
  for c in computed:
    k = 0
    while (k + 1) * bs <= min(len(c), len(prompt)) and c[:(k + 1) * bs] == prompt[:(k + 1) * bs]:
      k += 1
    best = max(best, k)
  return min(best, (len(prompt) - 1) // bs)


def _run_waves(engine, salt=None):
  """Runs WAVES one after the other; returns (outputs per wave, hit tokens per wave,
  the trie model's hit tokens per wave)."""
  params = SamplingParams(max_tokens=GEN, temperature=0.0, cache_salt=salt)
  computed, outs, hits, model = [], [], [], []
  for wave in WAVES:
    prompts = [C + outs[0][2][1] + TAIL if p == "C+" else p for p in wave]
    before = engine.stats["prefix_hit_tokens"]
    model.append(sum(BS * _trie_hit(p, computed, BS) for p in prompts))
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
      done.update({o.request_id: o.outputs[0] for o in engine.step()})
    outs.append([done[i] for i in ids])
    hits.append(engine.stats["prefix_hit_tokens"] - before)
    # The computed tokens: the prompt and every output token but the last.
    computed += [p + o[:-1] for p, o in zip(prompts, outs[-1])]
    outs[-1] = [(p, o) for p, o in zip(prompts, outs[-1])]
  return outs, hits, model


def _check_pools(engine):
  """Every block back: main free + cached == all; sliding free + companions == all, every
  companion the cache's alone and live for a cached main block."""
  m = engine.metrics()
  assert m["num_running"] == m["num_waiting"] == 0
  assert m["num_free_blocks"] + m["num_evictable_blocks"] == m["num_blocks"]
  s = jax.device_get(engine.state)
  sb, comp, cache = s.groups[1].blocks, s.prefix.sliding, s.prefix.cache
  owner = np.asarray(comp.owner)
  held = owner >= 0
  assert int(sb.num_free) + held.sum() == sb.num_blocks
  assert m["num_free_sliding_blocks"] == int(sb.num_free)
  np.testing.assert_array_equal(np.asarray(sb.ref_count)[held], 1)
  np.testing.assert_array_equal(np.asarray(sb.ref_count)[~held], 0)
  assert np.asarray(sliding.live(comp, cache, jnp.asarray(owner[held]))).all()
  assert held.sum() <= int(pc.num_cached_blocks(cache))
  stats = engine.prefix_stats()
  assert stats["companion_blocks"] == held.sum()
  return held.sum()


def test_waves_equal_the_dense_oracle_hit_as_the_model_and_give_every_block_back():
  # A sliding pool with room for every companion: each hit is the main cache's.
  engine = _engine(num_sliding_blocks=256)
  outs, hits, model = _run_waves(engine)
  for wave in outs:
    for prompt, out in wave:
      assert out == dense_greedy(prompt, GEN)
  assert hits == model and hits[1] > 0 and hits[2] > 0
  assert _check_pools(engine) > 0


@pytest.mark.parametrize("kw", [{}, dict(hash_mode="constant", max_probe=64),
                                dict(eviction_policy="protect_shallow")],
                         ids=["lru", "every_hash_collides", "protect_shallow"])
def test_a_tight_sliding_pool_evicts_companions_and_stays_exact(kw):
  """The smallest sliding pool the engine accepts: companions compete with live blocks
  and get evicted; also when every hash collides (only exact verification tells blocks
  apart) and under the other eviction policy."""
  engine = _engine(**kw)
  nsb = engine.cache_config.num_sliding_blocks
  outs, hits, model = _run_waves(engine)
  for wave in outs:
    for prompt, out in wave:
      assert out == dense_greedy(prompt, GEN)
  assert all(h <= m for h, m in zip(hits, model)) and 0 < sum(hits) < sum(model)
  held = _check_pools(engine)
  assert held <= nsb
  engine.reset_prefix_cache()
  s = jax.device_get(engine.state)
  assert int(s.groups[1].blocks.num_free) == nsb
  assert int(sliding.num_companions(s.prefix.sliding)) == 0
  assert engine.metrics()["num_free_blocks"] == engine.cache_config.num_blocks


def test_cache_salts_isolate_both_groups():
  engine = _engine(num_sliding_blocks=256)
  params = lambda salt: SamplingParams(max_tokens=GEN, temperature=0.0, cache_salt=salt)
  prompt = A + S1
  want = dense_greedy(prompt, GEN)
  for salt, hit in [("a", 0), ("b", 0), (None, 0), ("a", 16), ("b", 16), (None, 16)]:
    before = engine.stats["prefix_hit_tokens"]
    rid = engine.add_request(prompt, params(salt))
    out = {}
    while engine.has_unfinished():
      out.update({o.request_id: o.outputs[0] for o in engine.step()})
    assert out[rid] == want
    assert engine.stats["prefix_hit_tokens"] - before == hit, salt
  _check_pools(engine)


def test_one_dispatch_and_one_host_sync_per_step(monkeypatch):
  engine = _engine()
  for p in WAVES[0] + WAVES[1]:
    engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0))
  run_counting_dispatches_and_syncs(engine, monkeypatch)


@pytest.mark.parametrize("point,k", [("dispatch", 5), ("wait", 9)])
def test_an_interrupted_step_changes_no_output_and_leaks_no_block(monkeypatch, point, k):
  """KeyboardInterrupt before the k-th dispatch, or while the host waits for its outputs,
  in a wave that hits: the outputs equal an uninterrupted run's, both pools end whole."""
  params = SamplingParams(max_tokens=GEN, temperature=0.0)
  engine = _engine()
  first = [engine.add_request(p, params) for p in WAVES[0]]
  while engine.has_unfinished():
    engine.step()
  ids = [engine.add_request(p, params) for p in WAVES[1]]
  outs = {i: o[0] for i, o in run_through_an_interrupt(monkeypatch, engine, point, k).items()}
  assert [outs[i] for i in ids] == [dense_greedy(p, GEN) for p in WAVES[1]]
  assert engine.stats["prefix_hit_tokens"] > 0 and len(first) == 3
  _check_pools(engine)


def test_short_shared_prefixes_hit_on_every_group():
  """A stream of short prompts sharing a prefix shorter than the window (5 < 6 tokens)
  and one a block longer: each hits what the trie model says (no 0% cliff), one by one."""
  engine = _engine()
  shared = _tok(5)
  prompts = [shared + _tok(k) for k in (1, 2, 3, 1, 2)] + [shared + _tok(6)] * 2
  computed, params = [], SamplingParams(max_tokens=2, temperature=0.0)
  for prompt in prompts:
    want = BS * _trie_hit(prompt, computed, BS)
    before = engine.stats["prefix_hit_tokens"]
    rid = engine.add_request(prompt, params)
    out = {}
    while engine.has_unfinished():
      out.update({o.request_id: o.outputs[0] for o in engine.step()})
    assert engine.stats["prefix_hit_tokens"] - before == want
    assert out[rid] == dense_greedy(prompt, 2)
    computed.append(prompt + out[rid][:-1])
  assert engine.stats["prefix_hit_tokens"] == 4 * 5 + 8   # every later prompt hit
  _check_pools(engine)


def test_defaults_give_a_hybrid_model_both_and_each_can_be_turned_off():
  both = GEMMA.cache_config()
  assert both.hybrid and both.enable_prefix_caching and both.num_sliding_blocks > 0
  off = GEMMA.cache_config(hybrid_kv=False)
  assert not off.hybrid and off.enable_prefix_caching
  no_cache = GEMMA.cache_config(enable_prefix_caching=False)
  assert no_cache.hybrid and not no_cache.enable_prefix_caching
  import dataclasses   # pylint: disable=g-import-not-at-top
  all_sliding = dataclasses.replace(GEMMA, layer_types=None)    # Mistral: every layer slides
  assert all_sliding.sliding_layers == (0, 1, 2) and not all_sliding.cache_config().hybrid
  full = dataclasses.replace(GEMMA, layer_types=None, sliding_window=None)
  assert not full.cache_config().hybrid and full.cache_config().enable_prefix_caching
  with pytest.raises(TypeError, match="hybrid_kv must be a bool or None"):
    GEMMA.cache_config(hybrid_kv="yes")
  from paged_jax.distributed import validate_tp  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="pass hybrid_kv=False") as e:   # one pool under TP
    validate_tp(GEMMA, 1, both)
  assert "\n" not in str(e.value)
  validate_tp(GEMMA, 1, off)


def test_generate_uses_hybrid_kv_and_caching_by_default_on_a_gemma_checkpoint(monkeypatch):
  """`experiments.generate` on the Gemma-2 fixture builds its engine with both (and with
  --preemption_mode=swap, which hybrid KV refuses, falls back to one pool)."""
  import os   # pylint: disable=g-import-not-at-top
  from experiments import generate   # pylint: disable=g-import-not-at-top
  seen = []

  class Stop(Exception):
    pass

  def record(model_config, params, cache_config, **kw):
    del model_config, params
    seen.append((cache_config, kw["preemption_mode"]))
    raise Stop

  monkeypatch.setattr("paged_jax.engine.Engine", record)   # generate imports it in run()
  ckpt = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_golden", "gemma2")
  for mode in ("recompute", "swap"):
    with pytest.raises(Stop):
      generate.run(checkpoint=ckpt, prompt_ids="1,2,3", max_tokens=4, preemption_mode=mode)
  (rec, _), (swap, _) = seen
  assert rec.hybrid and rec.enable_prefix_caching
  assert not swap.hybrid and swap.enable_prefix_caching


def test_a_tight_main_pool_preempts_evicts_and_stays_exact():
  """10 main blocks for 4 slots: recompute preemption and main-cache evictions (whose
  companions then go stale and are released) while waves hit; outputs stay the oracle's."""
  engine = _engine(num_blocks=10)
  assert engine.cache_config.num_sliding_blocks == 10   # the main pool's size: below 18
  outs, hits, _ = _run_waves(engine)
  for wave in outs:
    for prompt, out in wave:
      assert out == dense_greedy(prompt, GEN)
  assert engine.num_preemptions > 0 and sum(hits) > 0
  assert engine.prefix_stats()["evictions"] > 0
  _check_pools(engine)


@pytest.mark.parametrize("steps,params,num_blocks", [
    (3, SamplingParams(max_tokens=GEN, temperature=1.0, seed=3, n=2), 96),
    (1, SamplingParams(max_tokens=GEN, temperature=0.0, beam_width=2, n=2), 96),
    (3, SamplingParams(max_tokens=GEN, temperature=1.0, seed=3, n=2), 12),
], ids=["samples", "beams", "samples_sliding_pool_as_main"])
def test_sampling_multistep_and_beams_equal_one_pool_without_caching(steps, params,
                                                                      num_blocks):
  """Seeded parallel samples (forks, copy-on-write in both groups) with 3 decode steps per
  sync, and beam search, over the waves: the same tokens as one pool without caching. With
  12 main blocks the sliding pool is the main pool's size (`sliding_pool_blocks`' second
  bound, under its window bound of 20): preemption, evictions and forks never run it
  short."""
  def run(engine):
    got = []
    for wave in WAVES[:2]:
      ids = [engine.add_request(p, params) for p in wave]
      done = {}
      while engine.has_unfinished():
        done.update({o.request_id: o.outputs for o in engine.step()})
      got.append([done[i] for i in ids])
    return got

  cc = GEMMA.cache_config(hybrid_kv=False, enable_prefix_caching=False, block_size=BS,
                          num_blocks=96, max_seqs=MAX_SEQS, max_blocks_per_seq=16)
  plain = Engine(GEMMA, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="cpu",
                 decode_steps_per_sync=steps, shape_buckets=False)
  engine = _engine(steps=steps, num_blocks=num_blocks)
  windows = sliding_pool_blocks(W, BS, MAX_SEQS, BUDGET, steps)   # 20 at 3 steps a sync
  assert engine.cache_config.num_sliding_blocks == min(num_blocks, windows)
  assert run(engine) == run(plain)
  if num_blocks == 96:
    assert engine.stats["prefix_hit_tokens"] > 0
  else:   # the pools were tight: the main cache's blocks were taken back
    assert engine.num_preemptions > 0 or engine.prefix_stats()["evictions"] > 0
  _check_pools(engine)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_checkpoints_in_waves_print_transformers_tokens(family):
  """The committed Gemma-2 / Gemma-3 fixtures (window 8, transformers' greedy tokens) with
  hybrid KV and caching by default, in three waves: the golden prompts, the same prompts
  again (hits longer than the window), and each prompt extended by the first 16 tokens of
  its golden output (hits into generated tokens; greedy continues with the rest)."""
  import json   # pylint: disable=g-import-not-at-top
  import os   # pylint: disable=g-import-not-at-top
  from paged_jax.models import load_hf_checkpoint   # pylint: disable=g-import-not-at-top
  directory = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_golden",
                           family)
  with open(os.path.join(directory, "golden.json")) as f:
    golden = json.load(f)
  mc, params = load_hf_checkpoint(directory)
  cc = mc.cache_config(block_size=BS, num_blocks=64, max_seqs=4, max_blocks_per_seq=16)
  assert cc.hybrid and cc.enable_prefix_caching and mc.sliding_window == 8
  engine = Engine(mc, params, cc, attention_backend="cpu")
  n = golden["max_tokens"]
  waves = [[(p, o) for p, o in zip(golden["prompts"], golden["outputs"])]] * 2
  waves.append([(p + o[:16], o[16:]) for p, o in waves[0]])
  for k, wave in enumerate(waves):
    before = engine.stats["prefix_hit_tokens"]
    ids = [engine.add_request(p, SamplingParams(max_tokens=len(o), temperature=0.0))
           for p, o in wave]
    done = {}
    while engine.has_unfinished():
      done.update({o.request_id: o.outputs[0] for o in engine.step()})
    assert [done[i] for i in ids] == [o for _, o in wave], k
    if k:
      assert engine.stats["prefix_hit_tokens"] - before > 0, k
  assert n == 32
  _check_pools(engine)
