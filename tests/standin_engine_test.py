"""The stand-in forward (paged_jax.models.standin) under the real Engine, and the
device-time model fed by the engine's own step reports.

1. The same stream on the same cache geometry schedules identically with the stand-in
   and with a real model (same steps, chunks, decode rows, preemptions, swaps, running
   counts): the stand-in changes the forward only, never the engine's policy.
2. The stand-in's pages follow the block tables (each token's K/V is at its slot).
3. A ModelClock fed by `Engine.last_step` advances by exactly the model's figure for a
   schedule worked out by hand, and StepShape.from_report reads each field.
"""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import perf
from paged_jax.engine import Engine, SamplingParams
from paged_jax.models import standin

from engine_oracle import MC, PARAMS, random_prompts

BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET = 4, 24, 6, 16


def standin_engine(*, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                   budget=BUDGET, max_len=64, **kw):
  cfg, params = standin.model(vocab_size=MC.vocab_size, max_position_embeddings=256)
  cc = cfg.cache_config(block_size=block_size, num_blocks=num_blocks, max_seqs=max_seqs,
                        max_blocks_per_seq=max_len // block_size)
  return Engine(cfg, params, cc, max_num_batched_tokens=budget, model_apply=standin.apply,
                shape_buckets=False, **kw)


def real_engine(**kw):
  cc = MC.cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=64 // BLOCK_SIZE)
  return Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="reference",
                shape_buckets=False, **kw)


def schedule(engine, prompts, params, max_steps=2000):
  """Per step, what the engine planned and did (everything but sampled token values)."""
  ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
  log = []
  for _ in range(max_steps):
    if not engine.has_unfinished():
      break
    engine.step()
    r = engine.last_step
    log.append((r.ok, r.prefill_chunks, r.decode_rows, r.decode_loop_rows,
                tuple(sorted(r.preempted_ids)), tuple(sorted(r.finished_ids)),
                tuple(sorted(r.first_token_ids)), r.num_running_groups, r.num_running_seqs,
                r.swapped_blocks, r.cow_copies, r.generated_tokens))
  else:
    raise AssertionError("not finished")
  return ids, log


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_standin_schedules_like_the_real_model(mode):
  # 7 requests need ~3x the 96-slot pool at their peak: preemption is certain. One asks
  # for n = 2 samples (they share the prompt's blocks: copy-on-write of the last one).
  prompts = random_prompts(5, 7, lo=4, hi=20)
  max_tokens = [30, 12, 41, 7, 25, 33, 18]
  params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
  params[3] = SamplingParams(max_tokens=max_tokens[3], temperature=1.0, seed=3, n=2)
  _, real = schedule(real_engine(preemption_mode=mode), prompts, params)
  _, fake = schedule(standin_engine(preemption_mode=mode), prompts, params)
  assert len(fake) == len(real)
  for k, (a, b) in enumerate(zip(real, fake)):
    assert a == b, f"step {k}: real {a} != stand-in {b}"
  assert sum(len(s[4]) for s in real) > 0                 # preempted
  if mode == "swap":
    assert sum(s[9] for s in real) > 0
  assert sum(s[10] for s in real) > 0                     # n = 2 copied its last block


def test_requests_run_to_max_tokens_and_pages_follow_the_block_tables():
  engine = standin_engine(num_blocks=64)
  prompts = random_prompts(9, 5, lo=3, hi=30)
  max_tokens = [17, 1, 33, 9, 23]
  for p, m in zip(prompts, max_tokens):
    engine.add_request(p, SamplingParams(max_tokens=m, temperature=1.0, seed=1))
  checked = 0
  outs = []
  while engine.has_unfinished():
    outs += engine.step()
    tables = np.asarray(engine.state.blocks.block_tables)
    for g in engine.scheduler.running:
      for q in g.seqs:
        if q.on_device and q.num_computed:
          got = standin.page_tokens(engine.state.pages, tables[q.slot], q.num_computed)
          np.testing.assert_array_equal(got, q.tokens[:q.num_computed])
          checked += 1
  assert checked > 50
  lens = {o.request_id: len(o.outputs[0]) for o in outs}
  assert [lens[i] for i in range(5)] == max_tokens     # no early stop


def test_standin_logits_are_deterministic_and_differ_by_row():
  engine = standin_engine(num_blocks=32)
  greedy = SamplingParams(max_tokens=12, temperature=0.0)
  a = engine.generate([[1, 2, 3], [1, 2, 3], [4, 5]], greedy)
  b = engine.generate([[4, 5], [1, 2, 3]], greedy)          # other slots, other blocks
  assert a[0].outputs == a[1].outputs == b[1].outputs
  assert a[2].outputs == b[0].outputs != a[0].outputs
  assert len(set(a[0].outputs[0])) > 3                # not one token repeated
  cfg = engine.model_config
  assert cfg.num_layers == cfg.num_kv_heads == 1 and cfg.head_dim == standin.HEAD_DIM


def _dm():
  return perf.DeviceTimeModel.named("opt-13b", "a100-40gb")


def test_model_clock_on_engine_reports_charges_a_hand_worked_schedule():
  # Three prompts of 5, 7, 9 tokens fit one step's budget: step 0 prefills all three and
  # samples each one's first token; then request i decodes at context prompt + k in step k
  # until it has its max_tokens.
  prompts, max_tokens = [[1] * 5, [2] * 7, [3] * 9], [4, 6, 3]
  engine = standin_engine(budget=32, num_blocks=32)
  for p, m in zip(prompts, max_tokens):
    engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0))
  expected = [perf.StepShape.prefill([5, 7, 9], block_size=BLOCK_SIZE)]
  for k in range(1, max(max_tokens)):
    expected.append(perf.StepShape.decode(
        [len(p) + k for p, m in zip(prompts, max_tokens) if k < m], block_size=BLOCK_SIZE))
  clock = perf.ModelClock(_dm(), block_size=BLOCK_SIZE)
  shapes = []
  while engine.has_unfinished():
    engine.step()
    shapes.append(clock.shape_of(engine.last_step))
    clock.stepped(engine.last_step)
  engine.flush()
  assert [s.as_dict() for s in shapes] == [s.as_dict() for s in expected]
  want = sum(_dm().step_seconds(s) for s in expected)
  # Summed in another order than the clock sums: equal to rounding (jax 0.11.2 differs in the last ulp).
  assert clock.now() == pytest.approx(want, rel=1e-12)
  assert clock.totals()["num_steps"] == len(expected)
  # With padding, the projections cost the compiled shape's tokens (here the largest).
  padded = perf.StepShape.from_report(engine.last_step, block_size=BLOCK_SIZE, padding=True)
  assert padded.bucket_tokens == engine.last_step.bucket.tokens == 32


class _Sample:
  def __init__(self, report):
    self.report, self.swapped_tokens = report, 0


def test_from_report_reads_swaps_copies_loops_and_failed_steps():
  # Swap preemption under a tight pool, n = 3 samples, multi-step decoding.
  engine = standin_engine(num_blocks=16, preemption_mode="swap", decode_steps_per_sync=4,
                          budget=32)
  prompts = random_prompts(2, 4, lo=6, hi=12)
  params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, n=1 + (i == 0) * 2)
            for i in range(4)]
  for p, sp in zip(prompts, params):
    engine.add_request(p, sp)
  clock = perf.ModelClock(_dm(), block_size=BLOCK_SIZE)
  swapped = cow = passes = 0
  while engine.has_unfinished():
    engine.step()
    rep = engine.last_step
    shape = clock.shape_of(_Sample(rep))
    clock.stepped(_Sample(rep))
    swapped += shape.swapped_blocks
    cow += shape.cow_blocks
    if rep.ok and rep.dispatches:
      assert shape.decode_iterations == 4 and list(shape.loop_rows) == list(rep.decode_loop_rows)
      assert shape.num_rows == len(rep.prefill_chunks) + len(rep.decode_rows)
      passes += 1
    else:
      assert shape.num_rows == 0
  assert swapped == engine.stats["swapped_blocks"] > 0
  assert cow > 0                                  # n = 3 copied its shared last block
  parts = clock.totals()["by_part_s"]
  assert parts["swap"] > 0 and parts["copy_on_write"] > 0 and passes > 0
  with pytest.raises(ValueError, match="report is None"):
    clock.stepped(_Sample(None))


def test_engines_of_a_module_level_forward_share_one_compiled_step():
  # A sweep builds a fresh engine per point: with standin.apply they share the jitted step
  # (and its compiled shapes); a closure may hold per-engine state and gets its own.
  a, b = standin_engine(), standin_engine(num_blocks=2 * NUM_BLOCKS)
  assert a._compiled is b._compiled
  local = lambda *args: standin.apply(*args)
  cfg, params = standin.model(vocab_size=MC.vocab_size, max_position_embeddings=256)
  cc = cfg.cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                        max_blocks_per_seq=64 // BLOCK_SIZE)
  c = Engine(cfg, params, cc, max_num_batched_tokens=BUDGET, model_apply=local,
             shape_buckets=False)
  d = Engine(cfg, params, cc, max_num_batched_tokens=BUDGET, model_apply=local,
             shape_buckets=False)
  assert c._compiled is not a._compiled and c._compiled is not d._compiled
  # Shared, the second engine serves the same schedule as the first.
  prompts = random_prompts(3, 4, 3, 12)
  params_ = [SamplingParams(max_tokens=5, temperature=0.0)] * 4
  assert schedule(a, prompts, params_)[1] == schedule(standin_engine(), prompts, params_)[1]
