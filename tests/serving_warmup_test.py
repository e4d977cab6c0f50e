"""engines.warm_up compiles every step shape a run can reach, ahead of time: the
reachable set equals a brute-force enumeration of the shapes `StepBuckets.pick`
gives feasible batches, and after warm-up a mixed online run (requests added while
the engine steps, chunked prefills, decodes, n = 2 sampling) neither traces the
step nor compiles anything; `serve` warms up by replaying its requests on a fresh
copy."""


import jax
import numpy as np
import pytest

from paged_jax.bench import clocks
from paged_jax.bench import engines
from paged_jax.bench import serving
from paged_jax.bench import workloads
from paged_jax.bench.baselines import gate as gate_lib
from paged_jax.engine import Engine, SamplingParams
from paged_jax.engine import compile as compile_lib
from paged_jax.engine import reachable_buckets, release_compiled
from paged_jax.engine import step as step_lib
from paged_jax.engine.buckets import StepBuckets

from engine_oracle import MC, PARAMS, VOCAB, record_buckets


def brute_force(buckets: StepBuckets, max_rows: int, max_len: int, lanes: int) -> set:
  """Every bucket `pick` returns for a feasible batch: k chunks carrying num_tokens
  new tokens (decode-only: one each; mixed: one chunk >= 2), k..k * lanes sampled
  slots (parallel sampling), at most max_rows live, longest row 1..max_len; plus a
  frees-only step."""
  budget = buckets.tokens[-1]
  # The width depends on the longest row alone: cross every length's width with the
  # (tokens, rows, decode_only) of every batch.
  widths = {buckets.pick(1, 1, length, False).width for length in range(1, max_len + 1)}
  out = {buckets.pick(0, 0, 0, True)}
  for k in range(1, max_rows + 1):
    for rows in range(k, min(k * lanes, max_rows) + 1):
      if k <= budget:
        out.add(buckets.pick(k, rows, max_len, True))
      for num_tokens in range(k + 1, budget + 1):
        out.add(buckets.pick(num_tokens, rows, max_len, False))
  return {b._replace(width=w) for b in out for w in widths}


@pytest.mark.parametrize("max_seqs,budget,width,decode_steps,max_rows,max_len,lanes,enabled", [
    (36, 256, 16, 1, 36, 256, 1, True),    # the ShareGPT paged engine
    (32, 64, 8, 1, 32, 100, 2, True),      # parallel sampling: more lanes than chunks
    (8, 256, 1, 1, 8, 256, 1, True),       # Orca(Max): one 256-token block per sequence
    (20, 32, 16, 4, 12, 50, 1, True),      # multi-step: the loop's tokens widen the rows
    (16, 64, 8, 1, 16, 64, 1, False),      # unbucketed: the largest shape only
])
def test_reachable_buckets_equal_brute_force(max_seqs, budget, width, decode_steps, max_rows,
                                             max_len, lanes, enabled):
  b = StepBuckets.make(max_seqs=max_seqs, max_num_batched_tokens=budget,
                       max_blocks_per_seq=width, block_size=16, decode_steps=decode_steps,
                       enabled=enabled)
  got = reachable_buckets(b, max_rows=max_rows, max_len=max_len, lanes_per_row=lanes)
  assert len(got) == len(set(got)) <= b.max_variants
  assert set(got) == brute_force(b, max_rows, max_len, lanes)


@pytest.mark.parametrize("decode_steps,max_rows,lanes", [(1, 16, 1), (4, 5, 2)])
def test_reachable_unbucketed_decode_shape_equal_brute_force(decode_steps, max_rows, lanes):
  # Unbucketed with the decode shape: the largest shape and the decode one, both
  # reachable by any run (a frees-only step is decode-only).
  b = StepBuckets.make(max_seqs=16, max_num_batched_tokens=64, max_blocks_per_seq=8,
                       block_size=16, decode_steps=decode_steps, enabled=False,
                       decode_shape=True)
  got = reachable_buckets(b, max_rows=max_rows, max_len=64, lanes_per_row=lanes)
  assert len(got) == len(set(got)) == 2 <= b.max_variants
  assert set(got) == brute_force(b, max_rows, 64, lanes)


def test_reachable_buckets_reject_bad_bounds():
  b = StepBuckets.make(max_seqs=8, max_num_batched_tokens=32, max_blocks_per_seq=4,
                       block_size=4, decode_steps=1)
  with pytest.raises(ValueError, match="max_rows"):
    reachable_buckets(b, max_rows=0, max_len=8)


# 8 slots (rows 8), 4-token blocks, up to 32 tokens (widths 4, 8 blocks), 32 tokens
# per step (tokens 16, 32): 6 shapes (few: each compiles for seconds on a loaded CPU),
# all of which the stream below meets, each with and without sampling requests running.
MAX_SEQS, BLOCK, NUM_BLOCKS, MAX_LEN, BUDGET = 8, 4, 40, 32, 32


def mixed_stream(seed=0, count=28):
  rng = np.random.default_rng(seed)
  reqs = []
  t = 0.0
  for i in range(count):
    short = i < 6              # a burst of short requests first (the narrow width)
    prompt_len = int(rng.integers(2, 7 if short else 20))
    out_len = int(rng.integers(1, 8 if short else MAX_LEN - prompt_len + 1))
    t += float(rng.exponential(0.03))
    reqs.append(workloads.Request(i, rng.integers(0, VOCAB, prompt_len, dtype=np.int32),
                                  out_len, arrival_time=t))
  return reqs


def params_fn(r):
  if r.request_id % 4 == 3:        # parallel sampling: children share the prompt's blocks
    return SamplingParams(max_tokens=r.output_len, n=2, temperature=0.8, seed=r.request_id)
  return SamplingParams(max_tokens=r.output_len, temperature=0.0)


@pytest.mark.slow
def test_after_warm_up_a_mixed_run_neither_traces_nor_compiles(monkeypatch):
  cc = MC.cache_config(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=MAX_LEN // BLOCK)
  engine = Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="reference",
                  max_beam_width=2)
  reqs = mixed_stream()
  warm = engines.warm_up(engine, reqs, params_fn)
  assert warm["shapes"] == 12 and warm["compiled"] + warm["already"] == 12
  assert engines.warm_up(engine, reqs, params_fn)["compiled"] == 0    # once per shape

  used = record_buckets(monkeypatch)
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  traces = sum(step_lib.TRACE_COUNT.values())
  try:
    res = serving.serve_online(engine, reqs, gate_lib.OpenGate(), params_fn,
                               clock=clocks.StepClock(0.01))
  finally:
    try:
      from jax._src import monitoring  # pylint: disable=g-import-not-at-top
      monitoring.unregister_event_duration_listener(listener)
    except (ImportError, AttributeError, ValueError):
      pass
  assert res["summary"]["requests"] == len(reqs)
  # First tokens from the engine's own step reports: after arrival, no later than finish.
  assert np.all(res["first_token"] > res["arrival"])
  assert np.all(res["first_token"] <= res["finish"])
  assert np.any(res["first_token"] < res["finish"])
  assert sum(step_lib.TRACE_COUNT.values()) == traces
  assert compiles == []
  # The run really was mixed: both widths, prefills beside decodes and decode-only
  # steps, most of the set.
  assert {b.width for b in used} == {4, 8} and {b.decode_only for b in used} == {True, False}
  assert {b.all_greedy for b in used} == {True, False}   # greedy-only steps and sampling ones
  assert len(set(used)) >= 5, sorted(set(used))


def small_engine(max_seqs, num_blocks=NUM_BLOCKS):
  cc = MC.cache_config(block_size=BLOCK, num_blocks=num_blocks, max_seqs=max_seqs,
                       max_blocks_per_seq=MAX_LEN // BLOCK, enable_prefix_caching=False)
  return Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="reference")


def test_compiled_shapes_are_keyed_by_the_engines_geometry():
  # Engines of one model share the jitted step, not their state's shapes: a shape
  # compiled for 8 slots must compile again for 16 (a stub step records its traces).
  calls = []

  def stub_step(params, state, inputs, *, width, decode_only, all_greedy):
    del params
    calls.append((state.blocks.block_tables.shape[0], inputs.tokens.shape[0],
                  inputs.row_slot.shape[0], width, decode_only, all_greedy))
    return state
  stub = compile_lib.CompiledStep(stub_step)   # shared, as engines of one model share it
  a, b, c = small_engine(8), small_engine(16), small_engine(8, num_blocks=NUM_BLOCKS + 4)
  for e in (a, b, c):
    e._compiled = stub    # pylint: disable=protected-access
  shapes = [(16, 8, 4, False), (8, 8, 8, True)]
  one = dict(all_greedy=(False,))
  assert a.compile_buckets(shapes, **one)["compiled"] == 2
  again = a.compile_buckets(shapes, **one)
  assert (again["compiled"], again["already"]) == (0, 2)
  assert b.compile_buckets(shapes, **one)["compiled"] == 2
  assert c.compile_buckets(shapes, **one)["compiled"] == 2
  assert calls == [(8, 16, 8, 4, False, False), (8, 8, 8, 8, True, False)] + [
      (16, 16, 8, 4, False, False), (16, 8, 8, 8, True, False)] + [
      (8, 16, 8, 4, False, False), (8, 8, 8, 8, True, False)]
  # By default both sampling variants: the all-greedy ones are new, the others cached.
  both = a.compile_buckets(shapes)
  assert (both["compiled"], both["already"]) == (2, 2)
  assert calls[-2:] == [(8, 16, 8, 4, False, True), (8, 8, 8, 8, True, True)]
  with pytest.raises(ValueError, match="more than the bound"):
    a.compile_buckets(shapes, max_shapes=1)


def test_release_compiled_forgets_what_was_compiled():
  calls = []

  def stub_step(params, state, inputs, *, width, decode_only, all_greedy):
    del params, inputs, decode_only, all_greedy
    calls.append(width)
    return state
  engine = small_engine(8)
  engine._compiled = compile_lib.CompiledStep(stub_step)    # pylint: disable=protected-access
  shapes = [(16, 8, 4, False)]
  assert engine.compile_buckets(shapes, all_greedy=(True,))["compiled"] == 1
  assert engine.compile_buckets(shapes, all_greedy=(True,))["compiled"] == 0
  release_compiled()
  assert engine.compile_buckets(shapes, all_greedy=(True,))["compiled"] == 1
  assert calls == [4, 4]


@pytest.mark.slow
def test_serve_replay_warm_up_compiles_exactly_the_timed_runs_shapes():
  # All requests at t = 0: the schedule is deterministic, so an untimed run of the same
  # requests on a fresh copy compiles every shape the timed run meets. A geometry no
  # other test uses (7 slots, 45 blocks), so nothing is compiled for it beforehand.
  cc = MC.cache_config(block_size=BLOCK, num_blocks=45, max_seqs=7,
                       max_blocks_per_seq=MAX_LEN // BLOCK)
  engine = Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="reference",
                  max_beam_width=2)
  reqs = mixed_stream(seed=3, count=16)
  traces = sum(step_lib.TRACE_COUNT.values())
  res = serving.serve(engine, reqs, params_fn, keep_outputs=True)
  assert res["warm_up"]["replay"] and res["step_traces_in_run"] == 0
  assert sum(step_lib.TRACE_COUNT.values()) > traces       # the replay did compile
  # The timed run's outputs are those of an engine that never saw the replay.
  plain = serving.serve(engine.fresh_copy(), reqs, params_fn, warmup=None, keep_outputs=True)
  assert res["outputs"] == plain["outputs"]
  with pytest.raises(ValueError, match="warmup must be"):
    serving.serve(engine.fresh_copy(), reqs, params_fn, warmup="twice")


def test_caching_engines_compile_each_prefix_variant_within_the_bound():
  # With prefix caching a mixed shape compiles full, light and admit-only, a decode-only
  # shape full and light (an admission always has a prompt chunk); the count stays
  # within max_variants.
  calls = []

  def stub_step(params, state, inputs, *, width, decode_only, all_greedy, **prefix):
    del params, all_greedy
    calls.append((inputs.tokens.shape[0], width, decode_only,
                  prefix.get("prefix_light", False), prefix.get("prefix_admit_only", False)))
    return state
  cc = MC.cache_config(block_size=BLOCK, num_blocks=NUM_BLOCKS, max_seqs=8,
                       max_blocks_per_seq=MAX_LEN // BLOCK, enable_prefix_caching=True)
  engine = Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="reference")
  engine._compiled = compile_lib.CompiledStep(stub_step)    # pylint: disable=protected-access
  shapes = [(16, 8, 4, False), (8, 8, 8, True)]
  assert engine.compile_buckets(shapes, all_greedy=(False,))["compiled"] == 5
  assert sorted(calls) == sorted([(16, 4, False, False, False), (16, 4, False, True, False),
                                  (16, 4, False, False, True), (8, 8, True, False, False),
                                  (8, 8, True, True, False)])
  b = engine.buckets
  every = reachable_buckets(b, max_rows=8, max_len=MAX_LEN)
  assert sum(3 - s.decode_only for s in every) * 2 <= b.max_variants
  # pick keeps admit-only only for a caching engine's mixed step that is not light.
  assert b.pick(20, 3, 20, False, prefix_admit_only=True).prefix_admit_only
  assert not b.pick(3, 3, 20, True, prefix_admit_only=True).prefix_admit_only
  assert not b.pick(20, 3, 20, False, prefix_light=True, prefix_admit_only=True
                    ).prefix_admit_only
  assert not small_engine(8).buckets.pick(20, 3, 20, False,
                                          prefix_admit_only=True).prefix_admit_only
