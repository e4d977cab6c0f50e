"""Faults in the draft model's dispatch (`DraftModel.prepare`, engine/draft_model.py): an
exception before the jitted proposal, one after it took (deleted) the donated draft pages,
an interrupt once it ran (its results lost) and a real SIGINT arriving during it, injected
at several dispatch counts of one run. After each the engine keeps serving: the draft's
pages are never left deleted, every request finishes with greedy outputs equal to the dense
oracle, no block leaks, and the target drafting for itself still has every draft accepted
(so the draft's record of its K/V, `computed`, never claims positions its pages lost)."""

import os
import signal

import jax
import pytest

from paged_jax.checks import consumed

from engine_oracle import MC, PARAMS, dense_greedy, greedy, oracle_engine, random_prompts

SELF = {"method": "draft_model", "model": (MC, PARAMS), "num_speculative_tokens": 3}
PROMPTS = [[1, 2, 3, 4, 5] * 3, [7, 8, 9] * 3, [5] * 6] + random_prompts(11, 3, lo=4, hi=16)
MAX_TOKENS = 24
# dispatch count -> the fault injected at it, and the exception the engine's step raises.
FAULTS = {2: "before", 4: "deleted", 6: "after", 8: "sigint", 10: "deleted"}
RAISES = {"before": KeyboardInterrupt, "deleted": RuntimeError, "after": KeyboardInterrupt,
          "sigint": KeyboardInterrupt}


class FaultyPropose:
  """Wraps the jitted proposal `real`; at the dispatch counts of `faults` it fails so:
  before: raises KeyboardInterrupt before the call (the pages untouched);
  deleted: deletes the donated pages, then raises RuntimeError (a call that failed after
    taking them);
  after: makes the call (it takes the pages), then raises KeyboardInterrupt (its results,
    the new pages among them, are lost);
  sigint: makes the call, then delivers a real SIGINT to this process."""

  def __init__(self, real, faults):
    self.real, self.faults, self.calls, self.fired = real, faults, 0, []

  def __call__(self, params, pages, *rest):
    self.calls += 1
    mode = self.faults.get(self.calls)
    if mode is not None:
      self.fired.append(mode)
    if mode == "before":
      raise KeyboardInterrupt
    if mode == "deleted":
      for x in jax.tree_util.tree_leaves(pages):
        x.delete()
      raise RuntimeError("injected: the proposal failed after taking its pages")
    out = self.real(params, pages, *rest)
    if mode == "after":
      raise KeyboardInterrupt
    if mode == "sigint":
      os.kill(os.getpid(), signal.SIGINT)   # arrives now, inside the dispatch
    return out


@pytest.fixture
def sigint_raises():
  """SIGINT raises KeyboardInterrupt here, also in a process started in the background,
  which inherits SIGINT ignored (then the engine's deferral would drop it)."""
  old = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(caching=True),
    dict(num_blocks=14, preemption_mode="recompute"),
], ids=["plain", "caching", "recompute"])
@pytest.mark.usefixtures("sigint_raises")
def test_a_failed_draft_dispatch_leaves_the_engine_serving_exact_outputs(monkeypatch, kw):
  engine = oracle_engine(**{**dict(block_size=4, num_blocks=64, max_seqs=4, budget=32), **kw},
                         speculative_config=SELF)
  drafter = engine._drafter   # pylint: disable=protected-access
  faulty = FaultyPropose(drafter._propose, FAULTS)   # pylint: disable=protected-access
  monkeypatch.setattr(drafter, "_propose", faulty)
  ids = [engine.add_request(p, greedy(MAX_TOKENS)) for p in PROMPTS]
  outs, raised, rows_at_last_fault = {}, [], None
  for _ in range(400):
    if not engine.has_unfinished():
      break
    try:
      for o in engine.step():
        outs[o.request_id] = o.outputs[0]
    except (KeyboardInterrupt, RuntimeError) as e:
      raised.append(type(e))
      mode = faulty.fired[-1]
      assert not consumed(drafter.pages), mode          # never left on deleted pages
      if mode in ("deleted", "after"):                  # their record went with them
        assert drafter.computed == {}, mode
      if mode == "sigint":   # held until the dispatch's new pages were kept: no reset
        assert drafter.computed, mode
      rows_at_last_fault = drafter.stats["drafting_rows"]
  assert not engine.has_unfinished()
  assert faulty.fired == list(FAULTS.values())          # every fault fired, once
  assert raised == [RAISES[m] for m in FAULTS.values()]
  for i, p in zip(ids, PROMPTS):
    assert outs[i] == dense_greedy(PARAMS, p, MAX_TOKENS)
  m = engine.metrics()
  assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0   # the draft K/V stay right
  assert drafter.stats["drafting_rows"] > rows_at_last_fault       # and it kept drafting
  if "num_blocks" in kw:
    assert m["num_preemptions"] > 0
  engine.flush()
  m = engine.metrics()
  assert m["num_free_blocks"] + m["num_evictable_blocks"] == m["num_blocks"]
