"""The scheduler's records change in one place, all at once: over real engine runs
(n > 1 samples, beams, swap preemption, prefix caching) `schedule()` changes nothing,
nothing else changes them between the plan and `update`, an exception anywhere inside
`update` before its commit leaves them exactly as they were (and the same update then
applies), and a SIGINT arriving during the commit is held until the commit is whole.

Records are compared by a deep fingerprint of every dataclass field of the scheduler,
its groups (queued, running, swapped) and their sequences, independent of the code
under test."""

import collections
import dataclasses
import enum
import os
import signal

import numpy as np
import pytest

from paged_jax.engine import SamplingParams
from paged_jax.engine import commit as commit_lib
from paged_jax.engine import scheduler as scheduler_mod

from engine_oracle import dense_greedy, greedy, oracle_engine, PARAMS, random_prompts


def _value(v, seen):
  if dataclasses.is_dataclass(v) and not isinstance(v, type):
    if id(v) in seen:
      return ("ref", id(v))
    seen.add(id(v))
    return (type(v).__name__, id(v), tuple((f.name, _value(getattr(v, f.name), seen))
                                           for f in dataclasses.fields(v)))
  if isinstance(v, (list, tuple)):
    return tuple(_value(x, seen) for x in v)
  if isinstance(v, dict):
    return tuple((_value(k, seen), _value(x, seen)) for k, x in v.items())
  if isinstance(v, np.ndarray):
    return ("array", v.shape, v.tobytes())
  if isinstance(v, (int, float, str, bool, type(None), enum.Enum)):
    return v
  return ("object", id(v))   # SwappedKV, callables: by identity


def fingerprint(sched):
  """Every field of the scheduler and of every record it can reach, deeply."""
  return _value(sched, set())


def workload():
  prompts = random_prompts(3, 6, lo=10, hi=30)   # engine_faults_test's: it preempts
  params = [greedy(12), SamplingParams(max_tokens=10, temperature=0.9, n=2, seed=5),
            greedy(10, beam_width=2, n=1), greedy(14), greedy(9),
            SamplingParams(max_tokens=8, temperature=1.1, top_p=0.9, seed=11)]
  return prompts, params


def make_engine(caching):
  return oracle_engine(block_size=16, num_blocks=12, max_seqs=8, budget=8, caching=caching,
                       preemption_mode="swap")


class Boom(Exception):
  pass


@pytest.mark.parametrize("caching", [False, True], ids=["no_cache", "prefix_cache"])
def test_only_update_writes_and_an_update_that_raises_writes_nothing(monkeypatch, caching):
  engine = make_engine(caching)
  sched = engine.scheduler
  prompts, params = workload()
  for p, sp in zip(prompts, params):
    engine.add_request(p, sp)
  plans, updates, aborted_updates = collections.Counter(), 0, 0
  planned = {}
  real_schedule, real_carried = sched.schedule, sched.carried
  real_update = scheduler_mod.Scheduler.update

  def schedule(*a, **kw):
    before = fingerprint(sched)
    batch = real_schedule(*a, **kw)
    assert fingerprint(sched) == before, "schedule() changed the records"
    planned[id(batch)] = before
    plans["schedule"] += 1
    return batch

  def carried():
    batch = real_carried()
    planned[id(batch)] = fingerprint(sched)
    plans["carried"] += 1
    return batch

  def update(self, batch, outputs=None):
    nonlocal updates, aborted_updates
    before = fingerprint(self)
    if id(batch) in planned:   # nothing wrote between the plan and its update
      assert before == planned.pop(id(batch)), "the records changed before update"
    updates += 1
    if updates % 3:   # every third update is also made to fail first (the test's cost)
      return real_update(self, batch, outputs)
    # How many writes this update works out (its commit made to fail first) ...
    writes = collections.Counter()
    real_set, real_commit = commit_lib.Changes.set, commit_lib.Changes.commit

    def counting_set(ch, record, **values):
      writes["set"] += 1
      return real_set(ch, record, **values)

    def no_commit(ch):
      raise Boom()

    monkeypatch.setattr(commit_lib.Changes, "set", counting_set)
    monkeypatch.setattr(commit_lib.Changes, "commit", no_commit)
    with pytest.raises(Boom):
      real_update(self, batch, outputs)
    assert fingerprint(self) == before, "an update that did not commit wrote"
    # ... then an exception at the first, a middle and the last of them.
    for k in sorted({1, (writes["set"] + 1) // 2, writes["set"]} - {0}):
      left = [k]

      def failing_set(ch, record, **values):
        left[0] -= 1
        if left[0] == 0:
          raise Boom()
        return real_set(ch, record, **values)

      monkeypatch.setattr(commit_lib.Changes, "set", failing_set)
      monkeypatch.setattr(commit_lib.Changes, "commit", real_commit)
      with pytest.raises(Boom):
        real_update(self, batch, outputs)
      assert fingerprint(self) == before, f"an update that raised at write {k} wrote"
      aborted_updates += 1
    monkeypatch.setattr(commit_lib.Changes, "set", real_set)
    monkeypatch.setattr(commit_lib.Changes, "commit", real_commit)
    return real_update(self, batch, outputs)

  monkeypatch.setattr(sched, "schedule", schedule)
  monkeypatch.setattr(sched, "carried", carried)
  monkeypatch.setattr(scheduler_mod.Scheduler, "update", update)
  outs = {}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
  assert engine.num_preemptions > 0 and engine.num_swaps > 0
  assert plans["schedule"] > 10 and updates >= plans["schedule"] and aborted_updates > 15, (
      plans, updates, aborted_updates)
  # The outputs are those of an engine that was never interfered with.
  monkeypatch.undo()
  ref = make_engine(caching)
  want = {o.request_id: o.outputs for o in ref.generate(prompts, params)}
  assert {i: o.outputs for i, o in outs.items()} == want
  assert want[0] == [dense_greedy(PARAMS, prompts[0], 12)]


def test_a_sigint_during_the_commit_is_held_until_it_is_whole(monkeypatch, request):
  """SIGINT delivered while the commit writes (the first record's fields) raises
  KeyboardInterrupt only after every write landed; the engine keeps serving and its
  outputs equal an uninterrupted run's."""
  # A process started in the background (`make test &`) inherits SIGINT ignored.
  old = signal.signal(signal.SIGINT, signal.default_int_handler)
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, old))
  prompts, params = workload()
  want = {o.request_id: o.outputs for o in make_engine(False).generate(prompts, params)}
  engine = make_engine(False)
  for p, sp in zip(prompts, params):
    engine.add_request(p, sp)
  outs = {}
  for _ in range(3):
    for o in engine.step():
      outs[o.request_id] = o
  real_commit = commit_lib.Changes.commit
  seen = {}

  def interrupted_commit(ch):
    first = next(iter(ch._fields.values()))   # pylint: disable=protected-access
    os.kill(os.getpid(), signal.SIGINT)       # arrives now, mid-commit
    real_commit(ch)
    seen["whole"] = all(getattr(r, k) is v for r, vals in ch._fields.values()   # pylint: disable=protected-access
                        for k, v in vals.items())
    seen["first"] = first

  monkeypatch.setattr(commit_lib.Changes, "commit", interrupted_commit)
  with pytest.raises(KeyboardInterrupt):
    for _ in range(50):
      for o in engine.step():
        outs[o.request_id] = o
  assert seen["whole"]
  monkeypatch.undo()
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
  assert {i: o.outputs for i, o in outs.items()} == want
