"""Admission gates in front of a running engine: what may enter it, and when.

An online serving loop offers every arriving request to a gate; the gate says
which requests may enter the engine now and is told when each one finishes.

  * `OpenGate`: everything enters at once (vLLM: the paged engine's own block
    accounting decides what runs).
  * `OrcaGate(policy, ...)`: Orca's contiguous reservations. A request enters
    only once one contiguous span of the reservation its policy asks for
    (`orca.reservation_tokens`: max length / next power of two / true length,
    times its number of sequences) fits first-fit in a `ContiguousArena` of
    `kv_budget_tokens` slots; the span is held until the request finishes.
    Strict FCFS: a head request that does not fit blocks the ones behind it
    (head-of-line blocking, as in `simulate.simulate_orca`).

The engine behind an `OrcaGate` keeps its paged pool; the gate's arena is what
limits concurrency, so it runs exactly the requests the reservations admit.

Host-side Python; lengths in tokens.
"""

from __future__ import annotations

import collections
from typing import Deque, Dict, Hashable, List, Tuple

from paged_jax.bench.baselines.arena import ContiguousArena
from paged_jax.bench.baselines.orca import POLICIES, reservation_tokens


class OpenGate:
  """Admits every request on arrival (the paged system)."""

  name = "open"

  def __init__(self):
    self._queue: List[Hashable] = []

  def offer(self, request_id: Hashable, total_len: int, num_seqs: int = 1) -> None:
    del total_len, num_seqs
    self._queue.append(request_id)

  def admit(self) -> List[Hashable]:
    """Requests that may enter the engine now, in arrival order."""
    out, self._queue = self._queue, []
    return out

  def release(self, request_id: Hashable) -> None:
    del request_id

  @property
  def num_waiting(self) -> int:
    return len(self._queue)


class OrcaGate:
  """FCFS admission by contiguous first-fit reservation (Orca Max / Pow2 / Oracle).

  Attributes:
    policy: "max", "pow2" or "oracle".
    max_len: context limit in tokens (Orca(Max)'s per-sequence reservation).
    arena: the `ContiguousArena` of `kv_budget_tokens` slots holding live spans.
  """

  def __init__(self, policy: str, kv_budget_tokens: int, max_len: int):
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not 1 <= max_len <= kv_budget_tokens:
      raise ValueError(f"max_len must be in [1, kv_budget_tokens={kv_budget_tokens}], "
                       f"got {max_len}")
    self.policy, self.max_len = policy, max_len
    self.name = f"orca_{policy}"
    self.arena = ContiguousArena(kv_budget_tokens)
    self._queue: Deque[Tuple[Hashable, int]] = collections.deque()
    self._held: Dict[Hashable, int] = {}

  def reservation(self, total_len: int, num_seqs: int = 1) -> int:
    """Slots a request of final length `total_len` with `num_seqs` sequences reserves:
    one span per request, `num_seqs` copies of the policy's per-sequence size (a
    contiguous layout cannot share the prompt between samples or beams)."""
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
      raise ValueError(f"num_seqs must be an int >= 1, got {num_seqs!r}")
    return num_seqs * reservation_tokens(self.policy, total_len, self.max_len)

  def offer(self, request_id: Hashable, total_len: int, num_seqs: int = 1) -> None:
    """Queues a request; raises ValueError if its reservation can never fit."""
    size = self.reservation(total_len, num_seqs)
    if size > self.arena.capacity:
      raise ValueError(f"request {request_id!r} reserves {size} slots, more than the "
                       f"{self.arena.capacity}-slot arena")
    self._queue.append((request_id, size))

  def admit(self) -> List[Hashable]:
    """Reserves spans for queued requests in FCFS order until the head does not fit."""
    out = []
    while self._queue:
      rid, size = self._queue[0]
      if self.arena.allocate(rid, size) is None:
        break
      self._queue.popleft()
      self._held[rid] = size
      out.append(rid)
    return out

  def release(self, request_id: Hashable) -> None:
    """Frees a finished request's span."""
    self._held.pop(request_id)
    self.arena.release(request_id)

  @property
  def num_waiting(self) -> int:
    return len(self._queue)

  @property
  def reserved_tokens(self) -> int:
    """Slots held by admitted, unfinished requests."""
    return self.arena.used


def make_gate(system: str, kv_budget_tokens: int, max_len: int):
  """"paged" -> OpenGate(); "orca_max" / "orca_pow2" / "orca_oracle" -> OrcaGate."""
  if system == "paged":
    return OpenGate()
  if system.startswith("orca_") and system[5:] in POLICIES:
    return OrcaGate(system[5:], kv_budget_tokens, max_len)
  raise ValueError(f"system must be paged or orca_{{{','.join(POLICIES)}}}, got {system!r}")
