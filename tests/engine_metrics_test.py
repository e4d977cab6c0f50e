"""`metrics()` is exact at every moment without `flush()` (issue 24): after every
`step()`, and after `generate()`, the free and evictable counts equal a plain count of
the blocks live sequences hold (distinct block ids of the device's active rows, and a
plain-Python count from the host's records where nothing is shared); a request whose
last output was returned holds no slot; and a busy step makes exactly one dispatch
(two only when a beam search finished: its frees are a host decision). With n > 1,
beams, prefix caching on and off."""

import collections
import functools

import jax
import numpy as np
import pytest

from paged_jax.config import cdiv
from paged_jax.engine import SamplingParams

from engine_oracle import greedy, oracle_engine, random_prompts

# The cache shape of engine_test.py (its compiled step is reused).
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET = 16, 12, 8, 8

make_engine = functools.partial(oracle_engine, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                max_seqs=MAX_SEQS, budget=BUDGET)


def workload(kind):
  prompts = random_prompts(51, 5, lo=6, hi=24)
  if kind == "singles":
    return prompts, [greedy(m) for m in (3, 9, 5, 12, 7)]
  if kind == "n2":
    return prompts, [SamplingParams(max_tokens=m, n=2, temperature=0.8, seed=m)
                     for m in (4, 9, 6, 3, 8)]
  return prompts, [greedy(m, beam_width=2, n=1) if i % 2 else greedy(m)
                   for i, m in enumerate((4, 6, 5, 3, 7))]


def held_blocks(engine) -> int:
  """Distinct blocks the device's active rows reference."""
  blocks = jax.device_get(engine.state.blocks)
  tables = np.asarray(blocks.block_tables)[np.asarray(blocks.active)]
  return len(set(tables[tables >= 0].tolist()))


def check_exact(engine, returned):
  m, sched = engine.metrics(), engine.scheduler
  used = NUM_BLOCKS - m["num_free_blocks"] - m["num_evictable_blocks"]
  assert used == held_blocks(engine), (m, held_blocks(engine))
  if not engine.prefix_caching:
    assert m["num_evictable_blocks"] == 0
  active = set(np.flatnonzero(np.asarray(jax.device_get(engine.state.blocks.active))).tolist())
  live = {q.slot for g in sched.running for q in g.seqs if q.on_device}
  # Only a running beam group's dropped beams wait for the next step's free.
  assert active == live | set(sched.carry.frees)
  assert set(sched.carry.frees) <= {s for g in sched.running for s in g.slots}
  assert not returned & set(sched.groups)
  if all(len(g.seqs) == 1 and not g.is_beam for g in sched.running) and not engine.prefix_caching:
    # Nothing shared: a plain count of each sequence's blocks from the host's records.
    assert used == sum(cdiv(q.num_computed, BLOCK_SIZE) for g in sched.running
                       for q in g.seqs if q.on_device)


@pytest.mark.parametrize("caching", [False, True], ids=["no_cache", "prefix_cache"])
@pytest.mark.parametrize("kind", ["singles", "n2", "beams"])
def test_metrics_are_exact_after_every_step_and_a_busy_step_dispatches_once(kind, caching):
  prompts, params = workload(kind)
  engine = make_engine(caching=caching)
  calls = collections.Counter()
  inner = engine._step   # pylint: disable=protected-access

  def counted(*a, **kw):
    calls["dispatch"] += 1
    return inner(*a, **kw)

  engine._step = counted   # pylint: disable=protected-access
  beams = set()
  for p, sp in zip(prompts, params):
    rid = engine.add_request(p, sp)
    if sp.beam_width > 1:
      beams.add(rid)
  returned = set()
  while engine.has_unfinished():
    before = calls["dispatch"]
    outs = engine.step()
    rep = engine.last_step
    returned |= {o.request_id for o in outs}
    assert rep.dispatches == calls["dispatch"] - before
    assert rep.dispatches == 1 + bool(beams & set(rep.finished_ids)), rep
    check_exact(engine, returned)
  assert returned == set(range(len(prompts)))
  m = engine.metrics()
  assert m["num_free_blocks"] + m["num_evictable_blocks"] == NUM_BLOCKS
  assert engine.num_preemptions == 0 or kind != "singles"


def test_metrics_after_generate_equal_a_plain_count_of_cached_blocks():
  # Prefix caching: after generate() every block is free or cached-and-evictable; the
  # cached ones are exactly the distinct full blocks of computed tokens (prompt +
  # generated but the last, which is sampled, never fed), shared prefix counted once.
  # 24 blocks: nothing is evicted, so the count is exact.
  prefix = random_prompts(52, 1, lo=20, hi=20)[0]
  prompts = random_prompts(53, 4, lo=3, hi=14, prefix=prefix)
  engine = make_engine(caching=True, num_blocks=24)
  n = 24
  outs = engine.generate(prompts, greedy(6))
  m = engine.metrics()
  chains = set()
  for p, o in zip(prompts, outs):
    ids = p + o.outputs[0]
    computed = len(ids) - 1
    chains |= {tuple(ids[:k * BLOCK_SIZE]) for k in range(1, computed // BLOCK_SIZE + 1)}
  assert m["num_evictable_blocks"] == len(chains) > 1
  assert m["num_free_blocks"] == n - len(chains)
  assert engine.prefix_stats()["evictions"] == 0
