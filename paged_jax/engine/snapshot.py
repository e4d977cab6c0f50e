"""Undo for one engine step: the host state of a scheduler and its groups.

The engine takes a snapshot before planning and before applying a step's
outputs; if anything raises (KeyboardInterrupt included) it restores it, so host
bookkeeping changes only with outputs in hand.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Dict

from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.sequence import Group

_SEQ_FIELDS = ("num_computed", "slot", "on_device", "pending_fork", "last_block_shared",
               "share_id", "cum_logprob", "topk", "swapped_kv", "finish_reason")
_GROUP_FIELDS = ("status", "num_preemptions")
_SCHED_LISTS = ("waiting", "running", "swapped", "free_slots", "pending_frees",
                "pending_forks", "released_slots", "pending_swap_outs")


class Snapshot:
  """The host state of a scheduler and its groups, to undo a step that raised.

  Captures queues, slot lists, counters and every live sequence's fields (token
  lists only grow during a step, so their lengths suffice): O(live sequences).
  """

  def __init__(self, sched: Scheduler, groups: Dict[Any, Group]):
    self.sched = sched
    self.lists = {k: list(getattr(sched, k)) for k in _SCHED_LISTS}
    self.counts = (sched.num_preemptions, sched.num_swaps)
    self.groups = dict(groups)
    self.group_state = []
    self.seq_state = []
    # A step only touches running and swapped groups and the waiting ones it can
    # admit (at most one per free slot, from the queue's head).
    touched = sched.running + sched.swapped + sched.waiting[:len(sched.free_slots) + 1]
    for g in touched:
      self.group_state.append((g, list(g.seqs), list(g.finished), list(g.slots),
                               tuple(getattr(g, f) for f in _GROUP_FIELDS)))
      for q in g.seqs:
        self.seq_state.append((q, len(q.tokens), tuple(getattr(q, f) for f in _SEQ_FIELDS)))

  def restore(self, groups: Dict[Any, Group]) -> None:
    """Puts everything back; `groups` (the engine's dict) is refilled in place."""
    sched = self.sched
    for k, v in self.lists.items():
      setattr(sched, k, v)
    sched.num_preemptions, sched.num_swaps = self.counts
    groups.clear()
    groups.update(self.groups)
    for g, seqs, finished, slots, fields in self.group_state:
      g.seqs, g.finished, g.slots = seqs, finished, slots
      for f, v in zip(_GROUP_FIELDS, fields):
        setattr(g, f, v)
    for q, n, fields in self.seq_state:
      del q.tokens[n:]
      for f, v in zip(_SEQ_FIELDS, fields):
        setattr(q, f, v)


@contextlib.contextmanager
def sigint_deferred():
  """Holds a SIGINT (KeyboardInterrupt) until the block ends (main thread only)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  caught = []
  old = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, old)
    if caught and callable(old):
      old(*caught[0])
