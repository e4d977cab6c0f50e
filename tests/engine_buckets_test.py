"""Shape buckets: a step runs on the smallest (tokens, rows, block-table width,
decode_only) bucket that holds what is live. Outputs must equal the unbucketed
engine's (`shape_buckets=False`: every step at the largest shape, ragged
attention) token for token, and greedy ones the dense oracle's; each bucket
traces once and their number stays within the bucket set. The unbucketed engine
with `decode_shape` runs decode-only steps on one decode shape (T = R = max_seqs):
step for step the same state and outputs as the largest shape's."""

import functools

import jax
import numpy as np
import pytest

from paged_jax.engine import SamplingParams
from paged_jax.engine import step as step_lib
from paged_jax.engine.buckets import Bucket, StepBuckets, reachable_buckets

from engine_oracle import (ORACLE_LEN, PARAMS, dense_greedy, oracle_engine, random_prompts,
                           record_buckets)

# 16 slots (rows 8, 16), 4-token blocks of up to 64 tokens (widths 4, 8, 16 blocks),
# 32 tokens per step (tokens 16, 32); 40 blocks: the traffic below preempts.
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET = 4, 40, 16, 32


make_engine = functools.partial(oracle_engine, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                max_seqs=MAX_SEQS, budget=BUDGET)
prompts_of = random_prompts


@pytest.mark.parametrize("max_seqs", [1, 7, 8, 9, 16, 17, 36, 64, 100, 256, 257])
def test_row_buckets_bound_padding(max_seqs):
  # Every live row count n gets the smallest row bucket >= n, and that bucket pads by
  # less than 2x, and by at most 1.5x from 16 rows up (the 1.5x points); the largest
  # bucket is max_seqs itself. Checked by brute force over n.
  b = StepBuckets.make(max_seqs=max_seqs, max_num_batched_tokens=256, max_blocks_per_seq=8,
                       block_size=16, decode_steps=1)
  assert list(b.rows) == sorted(set(b.rows)) and b.rows[-1] == max_seqs
  for n in range(1, max_seqs + 1):
    rows = b.pick(1, n, 1, True)[1]
    assert rows == min(r for r in b.rows if r >= n)
    assert rows < max(2 * n, 8 + 1), (n, rows, b.rows)
    if n >= 16:
      assert rows <= 1.5 * n, (n, rows, b.rows)


@pytest.mark.parametrize("decode_shape", [False, True])
def test_unbucketed_decode_shape_picks_the_decode_shape_for_decode_only_steps(decode_shape):
  # 12 slots, 40 tokens a step, 6-block tables: the largest shape (40, 12, 6) for every
  # step, and with decode_shape a decode-only step (however few rows, or a frees-only
  # step) on (12, 12, 6, decode kernel) instead.
  b = StepBuckets.make(max_seqs=12, max_num_batched_tokens=40, max_blocks_per_seq=6,
                       block_size=4, decode_steps=2, enabled=False, decode_shape=decode_shape)
  mixed, decode = Bucket(40, 12, 6, False), Bucket(12, 12, 6, True)
  for tokens, rows, max_len in [(30, 5, 9), (2, 1, 1), (40, 12, 24)]:
    assert b.pick(tokens, rows, max_len, False) == mixed
  for rows, max_len in [(0, 0), (1, 1), (5, 9), (12, 24)]:
    assert b.pick(rows, rows, max_len, True) == (decode if decode_shape else mixed)
  assert b.pick(3, 3, 7, True, all_greedy=True).all_greedy
  assert reachable_buckets(b, max_rows=12, max_len=24) == [mixed] + [decode] * decode_shape
  assert b.max_variants == 2 * 2 * (1 + decode_shape)   # x sampling / all-greedy x logprobs
  # Bucketed engines always have their decode buckets: the option changes nothing.
  kw = dict(max_seqs=12, max_num_batched_tokens=40, max_blocks_per_seq=6, block_size=4,
            decode_steps=1)
  assert StepBuckets.make(**kw, decode_shape=True) == StepBuckets.make(**kw)


def _device_state(engine):
  """The allocator's arrays (tables, lengths, free stack, ref counts) and the KV pages."""
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(
      (engine.state.blocks, engine.state.pages.k, engine.state.pages.v))]


def test_unbucketed_decode_shape_steps_equal_the_largest_shapes():
  # Two unbucketed engines in lockstep on the same seeded traffic (greedy prompts of
  # mixed lengths, an n=2 group, 40 blocks: it preempts and recomputes), one
  # with the decode shape: before every step both hold the same state (block tables,
  # lengths, free stack exactly; KV pages to float rounding), so each step's report,
  # outputs and next state must agree,
  # while the decode-only steps of the first run on the decode shape and the second's
  # on the largest one.
  # Greedy only (one sampling variant to compile: the test stays cheap); n=2 gives a
  # step more sampled lanes than rows.
  reqs = [(p, SamplingParams(max_tokens=int(6 + 4 * i), temperature=0.0))
          for i, p in enumerate(prompts_of(21, 6, 2, 30))]
  reqs.append((prompts_of(22, 1, 10, 10)[0], SamplingParams(max_tokens=14, n=2,
                                                            temperature=0.0)))
  fast, full = (make_engine(shape_buckets=False, decode_shape=d) for d in (True, False))
  for engine in (fast, full):
    for i, (p, sp) in enumerate(reqs):
      engine.add_request(p, sp, request_id=i)
  done, kinds = {}, set()
  while fast.has_unfinished() or full.has_unfinished():
    outs = [{o.request_id: o.outputs for o in e.step()} for e in (fast, full)]
    a, b = fast.last_step, full.last_step
    assert outs[0] == outs[1]
    done.update(outs[0])
    assert (a.prefill_chunks, a.decode_rows, a.generated_tokens, a.preempted_ids) == (
        b.prefill_chunks, b.decode_rows, b.generated_tokens, b.preempted_ids)
    if b.bucket is not None:
      assert b.bucket[:4] == (BUDGET, MAX_SEQS, ORACLE_LEN // BLOCK_SIZE, False)
      decode_only = bool(a.decode_rows) and not a.prefill_chunks
      assert a.bucket[:4] == ((MAX_SEQS, MAX_SEQS, ORACLE_LEN // BLOCK_SIZE, True)
                              if decode_only else b.bucket[:4])
      kinds.add(decode_only)
    for x, y in zip(_device_state(fast), _device_state(full), strict=True):
      if np.issubdtype(x.dtype, np.floating):  # K/V: matmuls of T vs 32 rows round apart
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
      else:
        np.testing.assert_array_equal(x, y)
  assert kinds == {False, True} and fast.num_preemptions > 0
  assert sorted(done) == list(range(len(reqs)))
  for i, (p, sp) in enumerate(reqs[:-1]):
    assert done[i][0] == dense_greedy(PARAMS, p, sp.max_tokens)


def mixed_requests():
  """Greedy prompts of mixed lengths (chunked prefills beside decodes), a parallel
  sampling group (n=3, seeded temperature) and a beam search."""
  greedy = prompts_of(1, 10, 1, 30)
  reqs = [(p, SamplingParams(max_tokens=int(8 + 3 * i), temperature=0.0))
          for i, p in enumerate(greedy)]
  reqs.append((prompts_of(2, 1, 12, 12)[0],
               SamplingParams(max_tokens=10, n=3, temperature=0.8, seed=5)))
  reqs.append((prompts_of(3, 1, 9, 9)[0], SamplingParams(max_tokens=6, beam_width=2,
                                                          temperature=0.0)))
  return reqs


def run(engine, reqs):
  outs = engine.generate([p for p, _ in reqs], [sp for _, sp in reqs])
  return [o.outputs for o in outs]


# Slow (cold: every bucket compiles twice over, ~2-4 min on a loaded 2-core CPU); the
# trace-count test below runs by default.
@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_bucketed_outputs_equal_the_largest_bucket_and_the_oracle(monkeypatch, decode_steps):
  reqs = mixed_requests()
  used = record_buckets(monkeypatch)
  engine = make_engine(decode_steps_per_sync=decode_steps)
  got = run(engine, reqs)
  assert engine.num_preemptions > 0                       # the traffic really preempted
  # Several buckets, decode-only ones among them, none at the largest width.
  assert len({b[:3] for b in used}) >= 3 and any(b.decode_only for b in used)
  assert min(b.rows for b in used) < MAX_SEQS and min(b.width for b in used) < ORACLE_LEN // 4
  monkeypatch.undo()
  full = make_engine(shape_buckets=False, decode_steps_per_sync=decode_steps)
  assert got == run(full, reqs)
  for (p, sp), o in zip(reqs, got):
    if sp.n == 1 and sp.beam_width == 1:
      assert o[0] == dense_greedy(PARAMS, p, sp.max_tokens)
  assert engine.num_free == NUM_BLOCKS


@pytest.mark.slow
def test_bucketed_prefix_caching_equals_the_largest_bucket(monkeypatch):
  shared = prompts_of(4, 1, 20, 20)[0]
  reqs = [(p, SamplingParams(max_tokens=8, temperature=0.0))
          for p in prompts_of(5, 8, 2, 12, prefix=shared)]
  used = record_buckets(monkeypatch)
  engine = make_engine(caching=True, decode_steps_per_sync=4)
  got = run(engine, reqs[:2]) + run(engine, reqs[2:])      # later prompts hit the cache
  assert engine.metrics()["prefix_hit_blocks"] > 0 and len(set(used)) >= 2
  monkeypatch.undo()
  full = make_engine(shape_buckets=False, caching=True, decode_steps_per_sync=4)
  assert got == run(full, reqs[:2]) + run(full, reqs[2:])
  for (p, sp), o in zip(reqs, got):
    assert o[0] == dense_greedy(PARAMS, p, 8)


def test_each_bucket_traces_once_and_their_number_is_bounded():
  # A long run of changing traffic: every shape it meets traces exactly once (a new
  # entry in the engine's bucket record), however many steps run on it.
  engine = make_engine(decode_steps_per_sync=2)
  before_seen, before = engine.buckets_seen, sum(step_lib.TRACE_COUNT.values())
  rng = np.random.default_rng(11)
  steps, added = 0, 0
  while steps < 80:
    if added < 24 and rng.random() < 0.4:
      sp = SamplingParams(max_tokens=int(rng.integers(1, 24)), n=int(rng.integers(1, 3)),
                          temperature=float(rng.choice([0.0, 0.7])), seed=int(rng.integers(99)))
      engine.add_request(prompts_of(int(rng.integers(1e6)), 1, 1, 36)[0], sp)
      added += 1
    if engine.has_unfinished():
      engine.step()
    steps += 1
  seen = engine.buckets_seen
  new = seen - before_seen
  assert sum(step_lib.TRACE_COUNT.values()) - before == len(new)
  assert len(seen) <= engine.buckets.max_variants
  assert len(seen) >= 4                                  # it did move between buckets


def _decode_step_cost(max_seqs):
  """XLA's cost analysis of the compiled decode-only step at the smallest bucket
  (R = T = 8 rows, W = 4 blocks) on an engine with `max_seqs` slots: (bytes accessed,
  while loops in the optimized HLO, bytes of one KV block over every layer)."""
  from paged_jax.engine.inputs import empty_inputs
  engine = oracle_engine(block_size=16, num_blocks=1024, max_seqs=max_seqs, budget=32)
  inputs = step_lib.StepInputs(**empty_inputs(8, max_seqs, 1, num_rows=8))
  exe = engine._step.lower(engine.params, engine.state, inputs, width=4,   # pylint: disable=protected-access
                           decode_only=True, all_greedy=True).compile()
  cost = exe.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  pool_bytes = sum(x.nbytes for x in (engine.state.pages.k, engine.state.pages.v))
  return cost["bytes accessed"], exe.as_text().count(" while("), pool_bytes // 1024


def test_decode_step_work_follows_the_row_bucket_not_max_seqs():
  # One live decode row costs the same compiled work at max_seqs 128 as at 8: the
  # step's forks, allocations and copy-on-write page copies run on the row bucket's
  # lanes, so no loop runs max_seqs trips and no page traffic grows with the slots
  # (a copy over every slot's pair reads and writes 128 blocks of every layer). What may
  # grow is the slot-wide integer bookkeeping (block tables, lengths: a few KB a slot).
  small, small_loops, block = _decode_step_cost(8)
  large, large_loops, _ = _decode_step_cost(128)
  assert large_loops == small_loops
  assert large - small < 128 * block, (small, large, block)


@pytest.mark.parametrize("backend,override,bucketed", [
    ("cpu", None, False), ("xla", None, True), ("reference", None, True),
    ("cpu", True, True), ("xla", False, False)])
def test_one_width_where_attention_does_not_read_it(backend, override, bucketed):
  # The CPU kernels visit keys up to each sequence's length: W buckets would only add
  # compiled shapes there (docs/notes/compile_budget.md, "Widths"); the gathering
  # backends read all W columns and keep them. `width_buckets` overrides either way.
  from paged_jax.engine import Engine   # pylint: disable=g-import-not-at-top
  from engine_oracle import MC   # pylint: disable=g-import-not-at-top
  cc = MC.cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=ORACLE_LEN // BLOCK_SIZE)
  engine = Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend=backend,
                  width_buckets=override)
  assert engine.buckets.widths == ((4, 8, 16) if bucketed else (16,))
  assert engine.buckets.tokens == (16, 32) and engine.buckets.rows == (8, 16)


def test_one_width_engine_equals_the_width_bucketed_one(monkeypatch):
  # Same tokens with every step at the widest table; every step it ran was that wide.
  from paged_jax.engine import Engine   # pylint: disable=g-import-not-at-top
  from engine_oracle import MC   # pylint: disable=g-import-not-at-top
  cc = MC.cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=ORACLE_LEN // BLOCK_SIZE)
  prompts = prompts_of(7, 10, 1, 20)
  sps = [SamplingParams(max_tokens=int(n), temperature=0.0) for n in (3, 9, 20, 5, 14, 2, 30,
                                                                        8, 11, 4)]
  outs = {}
  for widths in (True, False):
    used = record_buckets(monkeypatch)
    engine = Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="cpu",
                    width_buckets=widths)
    outs[widths] = [r.outputs for r in engine.generate(prompts, sps)]
    if widths:
      assert len({b.width for b in used}) > 1
    else:
      assert {b.width for b in used} == {ORACLE_LEN // BLOCK_SIZE}
  assert outs[True] == outs[False]
