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
import operator
import signal
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

# (record, values of its plain fields, its append-only lists, their lengths, copies of
# the contents of its mutable plain fields: (index in values, how, contents))
_Saved = Tuple[Any, Tuple[Any, ...], Tuple[Any, ...], Tuple[int, ...],
               List[Tuple[int, str, Any]]]


class _Plan(NamedTuple):
  names: Tuple[str, ...]          # saved whole (their contents too when mutable)
  get: Callable[[Any], Tuple[Any, ...]]
  appends: Tuple[str, ...]        # append-only lists: saved by length
  get_appends: Callable[[Any], Tuple[Any, ...]]


def _getter(names: Tuple[str, ...]) -> Callable[[Any], Tuple[Any, ...]]:
  """record -> the tuple of its `names` fields, in one C call (attrgetter)."""
  if len(names) == 1:
    return lambda r, n=names[0]: (getattr(r, n),)
  return operator.attrgetter(*names) if names else lambda r: ()


_PLANS = {}   # class -> _Plan


def _plan(cls) -> _Plan:
  """What `save` keeps of dataclass `cls`: read from `dataclasses.fields` once per class
  (a step saves hundreds of records)."""
  if cls not in _PLANS:
    kept = [f for f in dataclasses.fields(cls) if not f.metadata.get("fixed")]
    names = tuple(f.name for f in kept if not f.metadata.get("append_only"))
    appends = tuple(f.name for f in kept if f.metadata.get("append_only"))
    _PLANS[cls] = _Plan(names, _getter(names), appends, _getter(appends))
  return _PLANS[cls]


@functools.lru_cache(maxsize=None)
def _is_record(cls) -> bool:
  """A mutable dataclass type (saved field by field)."""
  return dataclasses.is_dataclass(cls) and not cls.__dataclass_params__.frozen


# How a field value is saved, by its type: "list" / "dict" (its contents copied),
# "record" (field by field) or "" (by reference). Learned as types are met, so a record
# whose fields all hold scalars (most sequences) is saved in a few C calls.
_HOW = {t: "" for t in (type(None), bool, int, float, str, tuple)}


_COPY = {"list": list, "dict": dict}
# the field types of a record -> (index, how) of its fields whose contents are copied
_MUTABLE: Dict[Tuple[type, ...], Tuple[Tuple[int, str], ...]] = {}


def _how(cls) -> str:
  if cls not in _HOW:
    _HOW[cls] = ("list" if issubclass(cls, list) else "dict" if issubclass(cls, dict)
                 else "record" if _is_record(cls) else "")
  return _HOW[cls]


def save(record) -> _Saved:
  """The state fields of a dataclass `record`, to hand to `restore`."""
  plan = _PLANS.get(type(record)) or _plan(type(record))
  values = plan.get(record)
  appends = plan.get_appends(record)
  lengths = tuple(map(len, appends))
  types = tuple(map(type, values))
  mutable = _MUTABLE.get(types)
  if mutable is None:   # a combination of field types not met before
    mutable = _MUTABLE[types] = tuple((i, _how(t)) for i, t in enumerate(types) if _how(t))
  if not mutable:
    return record, values, appends, lengths, ()
  contents = [(i, how, save(values[i]) if how == "record" else _COPY[how](values[i]))
              for i, how in mutable]
  return record, values, appends, lengths, contents


def restore(saved: _Saved) -> None:
  """Puts a record's fields back as `save` found them (same objects, same contents)."""
  record, values, appends, lengths, contents = saved
  plan = _plan(type(record))
  for name, v in zip(plan.names, values):
    setattr(record, name, v)
  for name, lst, n in zip(plan.appends, appends, lengths):
    setattr(record, name, lst)
    del lst[n:]
  for i, how, c in contents:
    v = values[i]
    if how == "list":
      v[:] = c
    elif how == "dict":
      v.clear()
      v.update(c)
    else:
      restore(c)


class Snapshot:
  """The host state of a scheduler and the requests a step can touch.

  A step touches running and swapped groups and the waiting ones it can admit (at most
  one per free slot, from the queue's head), and their sequences: O(live sequences).
  """

  def __init__(self, sched):
    self.saved = saved = [save(sched)]
    touched = sched.running + sched.swapped + sched.waiting[:len(sched.free_slots) + 1]
    for g in touched:
      saved.append(save(g))
      saved.extend(map(save, g.seqs))
      saved.extend(map(save, g.finished))

  def restore(self) -> None:
    for saved in self.saved:
      restore(saved)

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
