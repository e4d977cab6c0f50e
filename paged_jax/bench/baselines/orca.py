"""Orca-style contiguous KV reservation policies (the vLLM paper's baselines, Sec. 6.1).

Each admitted request reserves ONE contiguous span of the KV memory up front
and keeps it until it finishes:

  * Orca(Max):    `max_len` slots (the context limit), whatever the request.
  * Orca(Pow2):   the next power of two >= the request's final length
                  (prompt + output), capped at `max_len`.
  * Orca(Oracle): exactly the final length (an oracle that knows the output length).

Placement is first fit in a `ContiguousArena`, so external fragmentation from
the holes finished requests leave behind is measured, not assumed.
"""

from __future__ import annotations

from typing import Hashable

from paged_jax.bench.baselines.arena import ContiguousArena
from paged_jax.config import check_int

POLICIES = ("max", "pow2", "oracle")


def reservation_tokens(policy: str, total_len: int, max_len: int) -> int:
  """Slots a request of final length `total_len` (prompt + output) reserves."""
  if policy not in POLICIES:
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
  check_int("total_len", total_len, 1, max_len)
  if policy == "max":
    return max_len
  if policy == "pow2":
    return min(1 << (total_len - 1).bit_length(), max_len)
  return total_len


class OrcaAllocator:
  """Contiguous reservations over a `kv_budget_tokens`-slot arena.

  Attributes:
    policy: "max", "pow2" or "oracle".
    max_len: context limit in tokens (prompt + output <= max_len).
    arena: the underlying first-fit `ContiguousArena`.
  """

  def __init__(self, policy: str, kv_budget_tokens: int, max_len: int):
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    check_int("max_len", max_len, 1, kv_budget_tokens)   # one request must fit
    self.policy, self.max_len = policy, max_len
    self.arena = ContiguousArena(kv_budget_tokens)

  def reservation(self, total_len: int) -> int:
    return reservation_tokens(self.policy, total_len, self.max_len)

  def try_admit(self, request_id: Hashable, total_len: int) -> bool:
    """Reserves the request's span first-fit; False (nothing changes) if no hole fits."""
    return self.arena.allocate(request_id, self.reservation(total_len)) is not None

  def release(self, request_id: Hashable) -> int:
    """Frees the request's span; returns its size."""
    return self.arena.release(request_id)

  def reserved(self, request_id: Hashable) -> int:
    return self.arena.span(request_id)[1]
