"""`StepOutputs.sole_blocks`, which the scheduler credits for the slots a step frees
before it reserves, checked against the real thing: after every step of engines
that share blocks (parallel sampling, beams, forks, prefix caching, preemption),
freeing each active slot alone on a copy of the device state must make exactly
that many blocks available (free + evictable). And the engine, planning with
these counts, must serve every older group in the step that preempts."""

import jax
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax.engine import SamplingParams
from paged_jax.prefix_cache import step as prefix_step

from engine_oracle import PARAMS, VOCAB
import engine_oracle


def make(caching, num_blocks):
  return engine_oracle.oracle_engine(block_size=4, num_blocks=num_blocks, max_seqs=6,
                                     budget=16, caching=caching)


@jax.jit
def _available_after_free(state, slot):
  """Free + evictable blocks once `slot` alone is freed (on a copy of the state)."""
  slots = jax.numpy.reshape(slot, (1,)).astype(jax.numpy.int32)
  if state.prefix is None:
    b, _ = bm.free(state.blocks, slots)
    return b.num_free
  ps, b = prefix_step.free(state.prefix, state.blocks, slots)
  c = prefix_step.counters(ps, b)
  return c["num_free"] + c["evictable_blocks"]


def available_now(state):
  if state.prefix is None:
    return int(state.blocks.num_free)
  c = jax.device_get(prefix_step.counters(state.prefix, state.blocks))
  return int(c["num_free"]) + int(c["evictable_blocks"])


def check_sole_blocks(eng):
  """Every active slot: available after freeing it alone - available now == sole."""
  before = available_now(eng.state)
  active = np.asarray(eng.state.blocks.active)
  checked = 0
  for slot in np.flatnonzero(active):
    after = int(_available_after_free(eng.state, np.int32(slot)))
    sole = int(eng.scheduler.counts.sole_blocks[slot])
    assert after - before == sole, (
        f"slot {slot}: freeing it frees {after - before} blocks, the step said {sole}")
    checked += 1
  return checked


@pytest.mark.parametrize("caching", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["no_cache", "prefix_cache"])
def test_sole_blocks_equal_what_a_free_releases(caching):
  rng = np.random.default_rng(11)
  prefix = [int(t) for t in rng.integers(0, VOCAB, 10)]
  prompts = [prefix + [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 9)))]
             for _ in range(6)]
  params = [SamplingParams(max_tokens=7, temperature=0.8, n=2, seed=3),
            SamplingParams(max_tokens=6, temperature=0.0, beam_width=2),
            SamplingParams(max_tokens=8, temperature=0.0)] * 2
  eng = make(caching, num_blocks=12)
  for p, sp in zip(prompts, params):
    eng.add_request(p, sp)
  checked, steps = 0, 0
  while eng.has_unfinished():
    eng.step()
    checked += check_sole_blocks(eng)
    steps += 1
    assert steps < 500
  assert checked > 20 and eng.num_preemptions > 0, (checked, eng.num_preemptions)


def test_a_preempting_step_still_serves_the_older_requests():
  """20 blocks for 5 requests that each grow to 6 blocks: the pool runs out while
  all decode. The step that preempts must run every older request too (vLLM's
  rule), and the outputs equal the dense oracle."""
  prompts = engine_oracle.random_prompts(5, 5, 8, 12)
  eng = make(False, num_blocks=20)
  served_rows = []
  original = eng.scheduler.schedule

  def spy(*args, **kwargs):
    batch = original(*args, **kwargs)
    if batch.preempted:
      running = [g for g in eng.scheduler.running if g not in batch.preempted]
      served = {id(c.seq) for c in batch.chunks}
      served_rows.append(all(id(g.leader) in served for g in running))
    return batch

  eng.scheduler.schedule = spy
  outs = eng.generate(prompts, engine_oracle.greedy(14))
  assert served_rows and all(served_rows), served_rows
  for p, o in zip(prompts, outs):
    assert list(o.outputs[0]) == engine_oracle.dense_greedy(PARAMS, p, 14)
