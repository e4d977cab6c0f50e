"""`Engine.last_step` (StepReport) against plain-Python counts of the same workload:
each request's first token and finish reported once, in the step they happened; the
work of every prefill chunk and decode row; copy-on-write copies of parallel samples;
decode-loop rows; preemptions and swapped blocks summing to the engine's counters."""

import functools

import pytest

from paged_jax.engine import SamplingParams
from paged_jax.engine.report import StepReport

from engine_oracle import greedy, oracle_engine, random_prompts

# The cache shape of engine_test.py (its compiled step is reused).
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET = 16, 12, 8, 8

make_engine = functools.partial(oracle_engine, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                max_seqs=MAX_SEQS, budget=BUDGET)


def run(engine, max_steps=1000):
  """Steps to completion; per step (returned ids, report, generated tokens per id)."""
  log = []
  for _ in range(max_steps):
    if not engine.has_unfinished():
      return log
    out = engine.step()
    running = {g.request_id: sum(q.num_generated for q in g.seqs + g.finished)
               for g in engine.scheduler.running}
    log.append(([o.request_id for o in out], engine.last_step, running))
  raise AssertionError("not finished")


def test_first_tokens_finishes_and_chunk_work_equal_a_plain_count():
  prompts = random_prompts(41, 6, lo=3, hi=20)
  max_tokens = [1, 5, 9, 3, 7, 4]
  engine = make_engine()
  assert engine.last_step == StepReport()
  ids = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens)]
  log = run(engine)
  first, finish = {}, {}
  for k, (returned, rep, running) in enumerate(log):
    assert isinstance(rep, StepReport) and rep.dispatches == 1 and rep.ok
    assert list(rep.finished_ids) == returned
    for rid in rep.first_token_ids:
      assert rid not in first
      first[rid] = k
    for rid in returned:
      finish[rid] = k
    # The report's first tokens are exactly the requests that now hold one and did not.
    before = log[k - 1][2] if k else {}
    now_started = {r for r, n in running.items() if n > 0 and not before.get(r)}
    assert set(rep.first_token_ids) - set(returned) == now_started
    assert rep.num_running_groups == len(running)
    assert rep.num_running_seqs == len(running)   # one sequence per request here
  assert set(first) == set(finish) == set(ids)
  for rid, m in zip(ids, max_tokens):
    assert first[rid] <= finish[rid] and (first[rid] == finish[rid]) == (m == 1)
  # Plain count: every prompt prefilled once (no preemption, no caching), each decode
  # row feeds one generated token and attends to the prompt plus those tokens.
  assert engine.num_preemptions == 0
  reps = [r for _, r, _ in log]
  assert sum(n for r in reps for n, _ in r.prefill_chunks) == sum(map(len, prompts))
  want = sorted((1, len(p) + j) for p, m in zip(prompts, max_tokens) for j in range(1, m))
  assert sorted(w for r in reps for w in r.decode_rows) == want
  assert sum(r.generated_tokens for r in reps) == sum(max_tokens)
  assert all(r.cow_copies == 0 and r.decode_loop_rows == () for r in reps)


def test_parallel_samples_copy_their_shared_block_once_each_but_the_last():
  # A 14-token prompt in one 16-token block, shared by 3 samples after the prefill:
  # their first decode copies it for all but the last holder (2 copies), then never.
  prompt = random_prompts(4, 1, lo=14, hi=14)[0]
  engine = make_engine()
  engine.add_request(prompt, SamplingParams(n=3, max_tokens=4, temperature=0.9, seed=2))
  reps = [r for _, r, _ in run(engine)]
  assert sum(r.cow_copies for r in reps) == 2
  assert max(r.num_running_seqs for r in reps) == 3
  assert sum(r.generated_tokens for r in reps) == 12


def test_decode_loop_rows_preemptions_and_swaps_sum_to_the_engine_counters():
  # 8 short prompts admitted at once, each growing to 3 blocks (engine_test's case).
  prompts = random_prompts(21, 8, lo=1, hi=8)
  engine = make_engine(preemption_mode="swap", decode_steps_per_sync=4)
  for p in prompts:
    engine.add_request(p, greedy(44))
  reps = [r for _, r, _ in run(engine)]
  assert engine.num_preemptions > 0
  assert sum(r.preempted for r in reps) == engine.num_preemptions
  assert sum(r.swapped_blocks for r in reps) == engine.stats["swapped_blocks"] > 0
  assert all(len(r.decode_loop_rows) == 3 for r in reps if r.ok)
  assert sum(r.generated_tokens for r in reps) == 8 * 44
  # Swapped groups come back computed (nothing recomputed): the first forward samples
  # once per decode row and once per prompt's last chunk (its first token).
  first_forward = sum(r.generated_tokens - sum(r.decode_loop_rows) for r in reps)
  assert first_forward == sum(len(r.first_token_ids) + len(r.decode_rows) for r in reps)


def test_prefill_work_leaves_out_prefix_cache_hits():
  # B shares A's first 40 tokens: two whole 16-token blocks (32 tokens) hit once A has
  # run. B's first chunk (8 tokens, planned from 0) lies inside the hit and computes
  # nothing; its work is the 13 tokens past the hit, in chunks that end where they read.
  prefix = random_prompts(5, 1, lo=40, hi=40)[0]
  a, b = random_prompts(6, 2, lo=3, hi=5, prefix=prefix)
  engine = make_engine(caching=True)
  engine.add_request(a, greedy(2))
  reps_a = [r for _, r, _ in run(engine)]
  engine.add_request(b, greedy(2))
  reps_b = [r for _, r, _ in run(engine)]
  hit = 16 * (len(prefix) // 16)
  assert sum(r.prefix_hit_tokens for r in reps_a) == 0
  assert sum(r.prefix_hit_tokens for r in reps_b) == hit
  assert sum(n for r in reps_a for n, _ in r.prefill_chunks) == len(a)
  chunks_b = [c for r in reps_b for c in r.prefill_chunks]
  assert sum(n for n, _ in chunks_b) == len(b) - hit
  # Each chunk reads the context up to its end, contiguous from the hit to the prompt end.
  ends = [ctx for _, ctx in chunks_b]
  assert ends[-1] == len(b) and ends == sorted(ends)
  assert [ctx - n for n, ctx in chunks_b] == [hit] + ends[:-1]
  assert engine.stats["prefill_tokens"] == len(a) + len(b) - hit
