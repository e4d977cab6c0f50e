"""Hybrid KV (`CacheConfig.sliding_layers`) end to end on a Gemma-like model (sliding-window
and full-attention layers): engine outputs with the sliding pool on equal those with it off
token for token (greedy and seeded sampling, chunked prefill, queueing, multi-step decoding,
parallel samples that copy on write, beam search, recompute preemption), greedy equals the
dense oracle, the sliding pool holds fewer blocks than the main one and gets every block
back; bad options are one-line errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_oracle import run_counting_dispatches_and_syncs
from hybrid_support import (GEMMA, PARAMS, dense_greedy as _dense_greedy,
                            run_through_an_interrupt)
from paged_jax import block_window
from paged_jax.config import CacheConfig, sliding_pool_blocks
from paged_jax.engine import Engine, SamplingParams

BS, BUDGET, MAX_SEQS = 4, 8, 4
rng = np.random.default_rng(0)
PROMPTS = [[int(t) for t in rng.integers(1, 64, size=n)] for n in (3, 29, 11, 17, 6, 23)]


def _engine(hybrid, num_blocks=96, steps=1, backend="cpu", **kw):
  cc = GEMMA.cache_config(hybrid_kv=hybrid, max_num_batched_tokens=BUDGET,
                          decode_steps_per_sync=steps, block_size=BS, num_blocks=num_blocks,
                          max_seqs=MAX_SEQS, max_blocks_per_seq=16,
                          enable_prefix_caching=False)   # the baseline too: blocks compared
  # One shape bucket: each engine compiles one step (cheap tests).
  return Engine(GEMMA, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend=backend,
                decode_steps_per_sync=steps, shape_buckets=False, **kw)


def _run(engine, params):
  """Outputs of every prompt, stepping by hand to record the blocks each pool holds."""
  ids = [engine.add_request(p, params) for p in PROMPTS]
  outs, peak = {}, {"full": 0, "sliding": 0}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o.outputs
    st = engine.state
    peak["full"] = max(peak["full"], st.blocks.num_blocks - int(st.blocks.num_free))
    if len(st.groups) > 1:
      sb = st.groups[1].blocks
      assert st.groups[1].window == engine.cache_config.sliding_window > 0
      held = sb.num_blocks - int(sb.num_free)
      peak["sliding"] = max(peak["sliding"], held)
      assert engine.metrics()["num_free_sliding_blocks"] == int(sb.num_free)
      np.testing.assert_array_equal(sb.seq_lens, st.blocks.seq_lens)
  return [outs[i] for i in ids], peak


@pytest.mark.parametrize("backend", ["cpu", pytest.param("reference", marks=pytest.mark.slow),
                                     pytest.param("xla", marks=pytest.mark.slow)])
def test_greedy_on_equals_off_equals_dense_and_the_sliding_pool_gives_back(backend):
  params = SamplingParams(max_tokens=24, temperature=0.0)
  off, peak_off = _run(_engine(False, backend=backend), params)
  engine = _engine(True, backend=backend)
  on, peak_on = _run(engine, params)
  assert on == off
  for p, o in zip(PROMPTS, on):
    assert o[0] == _dense_greedy(p, 24)
  assert len({t for o in on for t in o[0]}) > 8          # not a degenerate repeat
  # Sequences reach 53 tokens (14 blocks); a sliding layer keeps at most 3 + 2 of them.
  assert peak_on["full"] == peak_off["full"]
  assert peak_on["sliding"] <= MAX_SEQS * 5 < peak_on["full"]
  sb = engine.state.groups[1].blocks
  assert int(sb.num_free) == sb.num_blocks                # every block back
  assert engine.num_free == engine.cache_config.num_blocks
  m = engine.metrics()
  assert m["num_free_sliding_blocks"] == m["num_sliding_blocks"] == sb.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("kw,params", [
    (dict(steps=3), SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=2)),
    (dict(), SamplingParams(max_tokens=12, temperature=0.0, beam_width=2, n=2)),
    (dict(num_blocks=20), SamplingParams(max_tokens=20, temperature=0.8, seed=5)),
])
def test_sampling_beams_multistep_and_preemption_on_equal_off(kw, params):
  off, _ = _run(_engine(False, **kw), params)
  engine = _engine(True, **kw)
  on, _ = _run(engine, params)
  assert on == off
  if kw.get("num_blocks") == 20:
    assert engine.num_preemptions > 0                     # the tight pool did preempt
  sb = engine.state.groups[1].blocks
  assert int(sb.num_free) == sb.num_blocks


def test_released_entries_read_block_zero_for_the_kernels():
  tables = jnp.asarray([[-1, -1, 5, 7], [3, -1, -1, -1]], jnp.int32)
  np.testing.assert_array_equal(block_window.attention_tables(tables),
                                [[0, 0, 5, 7], [3, 0, 0, 0]])


@pytest.mark.parametrize("make,match", [
    (lambda: _engine(True, preemption_mode="swap"), "preemption_mode must be 'recompute'"),
    (lambda: Engine(GEMMA, PARAMS, GEMMA.cache_config(
        hybrid_kv=True, max_num_batched_tokens=1, block_size=BS, num_blocks=64,
        max_seqs=MAX_SEQS, max_blocks_per_seq=16), max_num_batched_tokens=BUDGET),
     "num_sliding_blocks must be >="),
    (lambda: dataclasses.replace(GEMMA, layer_types=None).cache_config(hybrid_kv=True),
     "needs both sliding-window and full-attention layers"),
    (lambda: CacheConfig(num_layers=3, sliding_layers=(2, 1), sliding_window=4,
                         num_sliding_blocks=8), "sliding_layers must be sorted distinct"),
    (lambda: CacheConfig(num_layers=3, sliding_layers=(1,), num_sliding_blocks=8),
     "sliding_window must be set"),
    (lambda: CacheConfig(num_layers=3, sliding_window=4), "need sliding_layers"),
    (lambda: Engine(GEMMA, PARAMS, CacheConfig(
        num_layers=3, num_kv_heads=1, head_dim=16, sliding_layers=(0,), sliding_window=6,
        num_sliding_blocks=4096)), "must be the model's"),
])
def test_bad_options_are_one_line_errors(make, match):
  with pytest.raises(ValueError, match=match) as e:
    make()
  assert "\n" not in str(e.value)


def test_one_dispatch_and_one_host_sync_per_step(monkeypatch):
  engine = _engine(True)
  for p in PROMPTS:
    engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0))
  run_counting_dispatches_and_syncs(engine, monkeypatch)


@pytest.mark.parametrize("point,k", [("dispatch", 3), ("wait", 7), ("dispatch", 11)])
def test_an_interrupted_step_changes_no_output_and_leaks_no_block(monkeypatch, point, k):
  """KeyboardInterrupt before the k-th dispatch, or while the host waits for its outputs:
  the engine keeps serving, the outputs equal an uninterrupted run, both pools end empty."""
  params = SamplingParams(max_tokens=10, temperature=0.0)
  want, _ = _run(_engine(True), params)
  engine = _engine(True)
  ids = [engine.add_request(p, params) for p in PROMPTS]
  outs = run_through_an_interrupt(monkeypatch, engine, point, k)
  assert [outs[i] for i in ids] == want
  sb = engine.state.groups[1].blocks
  assert int(sb.num_free) == sb.num_blocks
  assert engine.num_free == engine.cache_config.num_blocks


def test_step_for_compile_lowers_the_hybrid_step():
  from paged_jax.engine import step_for_compile   # pylint: disable=g-import-not-at-top
  cc = GEMMA.cache_config(hybrid_kv=True, max_num_batched_tokens=BUDGET, block_size=BS,
                          num_blocks=32, max_seqs=MAX_SEQS, max_blocks_per_seq=16)
  fn, args = step_for_compile(GEMMA, cc, max_num_batched_tokens=BUDGET,
                              attention_backend="reference")
  leaves = jax.tree_util.tree_leaves(args)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert "func" in fn.trace(*args).lower().as_text()


@pytest.mark.slow   # ~2 min each on a loaded 2-core machine (the CLI builds a fresh engine)
@pytest.mark.parametrize("family,block_size", [("gemma2", 1), ("gemma2", 4),
                                               ("gemma3_text", 4), ("gemma3_text", 1)])
def test_generate_with_hybrid_kv_prints_transformers_tokens(family, block_size):
  """`experiments.generate --hybrid_kv` on the committed transformers fixtures (window 8,
  32 tokens: every sequence outgrows its window) prints transformers' greedy tokens."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from experiments import generate  # pylint: disable=g-import-not-at-top
  directory = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_golden",
                           family)
  with open(os.path.join(directory, "golden.json")) as f:
    golden = json.load(f)
  ids = ";".join(",".join(str(t) for t in p) for p in golden["prompts"])
  result = generate.run(checkpoint=directory, prompt_ids=ids, max_tokens=golden["max_tokens"],
                        block_size=block_size, hybrid_kv=True)
  assert result == {"outputs": golden["outputs"]}


@pytest.mark.parametrize("max_seqs", [1, 4, 64, 4096])
def test_from_memory_budget_never_gives_hybrid_fewer_main_blocks_than_one_pool(max_seqs):
  """Both pools from one budget: the sliding pool is the fewer of a window per slot and
  the main pool's blocks, so hybrid KV's main pool is never smaller than one pool's (equal
  once the windows outgrow the main pool), and the budget holds both."""
  for budget in (1 << 16, 1 << 20, 3 << 20):
    kw = dict(block_size=BS, kv_budget_bytes=budget, max_seqs=max_seqs)
    on = CacheConfig.from_memory_budget(GEMMA, max_num_batched_tokens=BUDGET, **kw)
    off = CacheConfig.from_memory_budget(GEMMA, hybrid_kv=False, **kw)
    windows = sliding_pool_blocks(GEMMA.sliding_window, BS, max_seqs, BUDGET)
    assert on.num_sliding_blocks == min(windows, on.num_blocks)
    assert on.num_blocks >= off.num_blocks and on.kv_cache_bytes <= budget
    if windows >= on.num_blocks:
      assert on.num_blocks == off.num_blocks == on.num_sliding_blocks
    # One more main block would not fit beside its sliding pool.
    more = on.replace(num_blocks=on.num_blocks + 1, num_sliding_blocks=min(
        windows, on.num_blocks + 1))
    assert more.kv_cache_bytes > budget


def test_from_memory_budget_takes_the_sliding_pool_off_the_budget():
  budget = 1 << 20
  kw = dict(block_size=BS, kv_budget_bytes=budget, max_seqs=MAX_SEQS)
  on = CacheConfig.from_memory_budget(GEMMA, max_num_batched_tokens=BUDGET, **kw)  # default
  off = CacheConfig.from_memory_budget(GEMMA, hybrid_kv=False, **kw)
  per_layer_block = on.kv_bytes_per_token // GEMMA.num_layers * BS
  assert on.hybrid and on.sliding_layers == (0, 2) and on.full_layers == (1,)
  assert budget - per_layer_block < on.kv_cache_bytes <= budget   # one full block short at most
  assert budget - 3 * per_layer_block < off.kv_cache_bytes <= budget
  assert on.num_blocks > 2 * off.num_blocks     # the full layers' pool: 1 layer, not 3
