"""The undo of an interrupted step (`snapshot.Snapshot`) covers every field of the
records a step changes: what it saves is derived from the dataclass fields of
`Scheduler`, `Group` and `Sequence`, so a field added later is covered without a list
to keep in step. Checked two ways: every non-FIXED field changed (in place and by
assignment) comes back on restore; FIXED fields never change over real steps (beams,
n > 1, swaps, preemption, prefix caching); and no state hides outside the fields."""

import collections
import dataclasses
import functools

import numpy as np
import pytest

from paged_jax.engine import SamplingParams, Scheduler
from paged_jax.engine.sequence import Batch, Chunk, Group, GroupStatus, Sequence
from paged_jax.engine.snapshot import Snapshot

from engine_oracle import greedy, oracle_engine, random_prompts


def live_scheduler():
  """A scheduler mid-run: a running 2-sample group, a waiting one, carried work."""
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=16)
  sp = SamplingParams(max_tokens=8, n=2, temperature=1.0)
  seqs = [Sequence(seq_id=j, index=j, sample_seed=j, tokens=[1, 2, 3, 4, 5], prompt_len=4,
                   num_computed=4, slot=j, on_device=True) for j in range(2)]
  run = Group(request_id="r", arrival=0, params=sp, prompt=[1, 2, 3, 4], seqs=seqs,
              slots_needed=2, slots=[0, 1], status=GroupStatus.RUNNING)
  wait = Group(request_id="w", arrival=1, params=sp, prompt=[7],
               seqs=[Sequence(seq_id=5, index=0, sample_seed=0, tokens=[7], prompt_len=1)],
               slots_needed=2)
  sched.running.append(run)
  sched.groups["r"] = run
  sched.add(wait)
  sched.carry.forks.append((seqs[0], seqs[1]))
  sched.carry.frees.append(3)
  sched.carry.chunks.append(Chunk(seqs[0], 1, samples=True, allocate=False))
  sched.stats["steps"] = 3
  return sched, [run, wait] + seqs + wait.seqs


def contents(record):
  """Each field: (the object, a copy of what it holds) for comparison after restore."""
  out = {}
  for f in dataclasses.fields(record):
    v = getattr(record, f.name)
    if isinstance(v, (list, dict)):
      out[f.name] = (v, type(v)(v))
    elif isinstance(v, Batch):
      out[f.name] = (v, contents(v))
    else:
      out[f.name] = (v, None)
  return out


SENTINEL = object()


def change_every_field(record, in_place):
  for f in dataclasses.fields(record):
    if f.metadata.get("fixed"):
      continue
    v = getattr(record, f.name)
    if in_place and isinstance(v, list):
      v.append(SENTINEL)
    elif in_place and isinstance(v, dict):
      v[SENTINEL] = 1
    elif in_place and isinstance(v, Batch):
      change_every_field(v, in_place)
    else:
      setattr(record, f.name, SENTINEL)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "assigned"])
def test_every_non_fixed_field_of_every_record_is_restored(in_place):
  sched, records = live_scheduler()
  touched = [sched] + records   # the waiting group is at the queue's head: touched too
  want = [contents(r) for r in touched]
  snap = Snapshot(sched)
  for r in touched:
    change_every_field(r, in_place)
  snap.restore()
  for r, w in zip(touched, want):
    got = contents(r)
    for name, (obj, held) in w.items():
      assert got[name][0] is obj, (type(r).__name__, name)   # the same object back
      assert got[name][1] == held, (type(r).__name__, name)   # with the same contents


def test_no_state_lives_outside_the_dataclass_fields():
  sched, records = live_scheduler()
  for r in [sched] + records:
    names = {f.name for f in dataclasses.fields(r)}
    extra = set(vars(r)) - names
    # The scheduler's id counter for beam hypotheses only needs to be unique.
    assert extra <= ({"_seq_ids"} if r is sched else set()), (type(r).__name__, extra)


def fixed_fields(record):
  return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)
          if f.metadata.get("fixed")}


@pytest.mark.parametrize("caching", [False, True], ids=["no_cache", "prefix_cache"])
def test_fixed_fields_never_change_over_real_steps(caching):
  engine = oracle_engine(block_size=16, num_blocks=12, max_seqs=8, budget=8, caching=caching,
                         preemption_mode="swap")
  prompts = random_prompts(3, 6, lo=10, hi=30)   # engine_faults_test's: it preempts
  params = [greedy(12), SamplingParams(max_tokens=10, temperature=0.9, n=2, seed=5),
            greedy(10, beam_width=2, n=1), greedy(14), greedy(9),
            SamplingParams(max_tokens=8, temperature=1.1, top_p=0.9, seed=11)]
  for p, sp in zip(prompts, params):
    engine.add_request(p, sp)
  sched = engine.scheduler
  seen = collections.Counter()
  while engine.has_unfinished():
    groups = list(sched.groups.values())
    records = [sched] + groups + [q for g in groups for q in g.seqs + g.finished]
    before = [(r, fixed_fields(r)) for r in records]
    engine.step()
    for r, fixed in before:
      assert fixed_fields(r) == fixed, type(r).__name__
      seen[type(r).__name__] += 1
  assert engine.num_preemptions > 0 and min(seen.values()) > 10, (engine.num_preemptions, seen)
  assert np.all(np.asarray(engine.state.blocks.active) == 0)
