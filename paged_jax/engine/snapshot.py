"""Undo for one engine step: the host state of a scheduler and of the requests a step
can touch, saved before planning and before applying a step's outputs, and put back if
anything raises (KeyboardInterrupt included), so host bookkeeping changes only with
outputs in hand.

What is saved is derived from the records' dataclass fields (`dataclasses.fields` of
`Scheduler`, `Group`, `Sequence`), not listed by hand: every field is saved unless its
metadata marks it FIXED (set before a request's first step, never changed by one) or
APPEND_ONLY (a list a step only appends to: saved by length). Lists and dicts are saved
as copies of their contents and put back into the same objects (callers holding one,
e.g. `engine.stats`, see the restored contents); a nested mutable dataclass (the
scheduler's carried Batch) is saved field by field. tests/engine_undo_test.py checks
that a change to any field of any of the three is undone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
from typing import Any, List, Tuple

_Saved = List[Tuple[str, Any, str, Any]]   # (field, object, how, contents)


@functools.lru_cache(maxsize=None)
def _plan(cls) -> Tuple[Tuple[str, bool], ...]:
  """(field name, append_only) of the fields of dataclass `cls` that `save` keeps: read
  from `dataclasses.fields` once per class (a step saves hundreds of records)."""
  return tuple((f.name, bool(f.metadata.get("append_only")))
               for f in dataclasses.fields(cls) if not f.metadata.get("fixed"))


@functools.lru_cache(maxsize=None)
def _is_record(cls) -> bool:
  """A mutable dataclass type (saved field by field)."""
  return dataclasses.is_dataclass(cls) and not cls.__dataclass_params__.frozen


def save(record) -> _Saved:
  """The state fields of a dataclass `record`, to hand to `restore`."""
  out = []
  for name, append_only in _plan(type(record)):
    v = getattr(record, name)
    if append_only:
      out.append((name, v, "len", len(v)))
    elif isinstance(v, list):
      out.append((name, v, "list", list(v)))
    elif isinstance(v, dict):
      out.append((name, v, "dict", dict(v)))
    elif _is_record(type(v)):
      out.append((name, v, "record", save(v)))
    else:
      out.append((name, v, "value", None))
  return out


def restore(record, saved: _Saved) -> None:
  """Puts `record`'s fields back as `save` found them (same objects, same contents)."""
  for name, v, how, contents in saved:
    setattr(record, name, v)
    if how == "len":
      del v[contents:]
    elif how == "list":
      v[:] = contents
    elif how == "dict":
      v.clear()
      v.update(contents)
    elif how == "record":
      restore(v, contents)


class Snapshot:
  """The host state of a scheduler and the requests a step can touch.

  A step touches running and swapped groups and the waiting ones it can admit (at most
  one per free slot, from the queue's head), and their sequences: O(live sequences).
  """

  def __init__(self, sched):
    self.saved = [(sched, save(sched))]
    touched = sched.running + sched.swapped + sched.waiting[:len(sched.free_slots) + 1]
    for g in touched:
      self.saved.append((g, save(g)))
      self.saved.extend((q, save(q)) for q in g.seqs + g.finished)

  def restore(self) -> None:
    for record, saved in self.saved:
      restore(record, saved)

  @contextlib.contextmanager
  def on_error(self):
    """Restores the snapshot if the block raises (then re-raises)."""
    try:
      yield
    except BaseException:
      self.restore()
      raise


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
