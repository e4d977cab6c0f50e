"""One update's writes to the scheduler's records, committed at once.

`Scheduler.update` first works out every new value (which may raise: a bug, a bad
output, an injected fault) into a `Changes`, reading its own pending writes through
`get`, and only then `commit()`s them: plain assignments and list extends, with SIGINT
held, so neither an exception nor Ctrl-C can leave the records half updated. (vLLM v1
and nano-vllm write their request records in place as they go; here a notebook's
KeyboardInterrupt must leave the engine consistent and serving.)
"""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
from typing import Any, Dict, List, Tuple


class Changes:
  """Pending field writes per record, token appends per sequence, counter additions."""

  def __init__(self):
    self._fields: Dict[int, Tuple[Any, Dict[str, Any]]] = {}
    self._appends: List[Tuple[list, List[int]]] = []
    self._counts: List[Tuple[collections.Counter, collections.Counter]] = []

  def set(self, record, **values) -> None:
    """Writes `values` into `record`'s fields at commit."""
    entry = self._fields.get(id(record))
    if entry is None:
      self._fields[id(record)] = (record, values)
    else:
      entry[1].update(values)

  def get(self, record, name: str):
    """`record.name` as it will be after commit."""
    entry = self._fields.get(id(record))
    if entry is not None and name in entry[1]:
      return entry[1][name]
    return getattr(record, name)

  def extend(self, tokens: list, values: List[int]) -> None:
    """Appends `values` to a sequence's token list at commit."""
    if values:
      self._appends.append((tokens, values))

  def count(self, counter: collections.Counter, delta) -> None:
    """Adds `delta`'s counts to `counter` at commit."""
    self._counts.append((counter, delta))

  def commit(self) -> None:
    """Applies every write (assignments and extends only: nothing here can raise)."""
    with sigint_deferred():
      for record, values in self._fields.values():
        vars(record).update(values)
      for tokens, values in self._appends:
        tokens.extend(values)
      for counter, delta in self._counts:
        counter.update(delta)


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
