"""KV-memory accounting: where a serving run's KV budget goes, step by step.

Partition (exact). At every step of a continuous-batching simulation each of the
budget's `T` token slots is in exactly one of these categories:

  token_utilization       holds a token's K/V state: the sum of the running
                          requests' current lengths.
  reservation             allocated to a running request and will be filled by
                          its own future tokens: `min(allocated, final_len) - current_len`.
  internal_fragmentation  allocated to a running request and will never be
                          filled: `allocated - min(allocated, final_len)`. For
                          Orca this is over-reservation; for paged blocks it is
                          the unused tail of the request's final last block.
  external_fragmentation  free, and a *compacting* allocator with the same
                          budget and policy would hand it to waiting requests
                          now: the needs of the waiting requests, taken in FCFS
                          order while their sum fits in the total free memory.
                          Zero when nobody waits; zero for paged blocks, where
                          any free block serves any request.
  free                    the remaining free memory: too little for the next
                          waiting request (or held back as a watermark), or
                          nobody is waiting.

A fraction is that category's slots summed over the averaged steps, divided by
`T * steps`; the five fractions sum to 1 (exactly, up to float rounding).
Averaged steps: the *saturated* steps, those where a request is still waiting
after admission (the serving system is memory-bound), when there are any; else
all steps. `max_concurrent` is the peak number of requests holding memory at
once over all steps; `mean_concurrent` its mean over the averaged steps.
"""

from __future__ import annotations

from typing import Dict, Iterable, Sequence, Tuple

from paged_jax.config import cdiv

CATEGORIES = ("token_utilization", "reservation", "internal_fragmentation",
              "external_fragmentation", "free")


def request_usage(allocated: Sequence[int], current: Sequence[int],
                  final: Sequence[int]) -> Tuple[int, int, int]:
  """(tokens, reservation, internal_fragmentation) slots of the running requests.

  Args:
    allocated: slots each running request holds.
    current: tokens each holds now (<= allocated).
    final: each one's final length, prompt + output (>= current).
  """
  tokens = reserved = internal = 0
  for a, c, f in zip(allocated, current, final):
    if not 0 <= c <= a or c > f:
      raise ValueError(f"need 0 <= current <= allocated and current <= final, got "
                       f"allocated={a} current={c} final={f}")
    used = min(a, f)
    tokens += c
    reserved += used - c
    internal += a - used
  return tokens, reserved, internal


def compacting_admission(free_tokens: int, waiting_needs: Iterable[int]) -> int:
  """Slots a compacting allocator would give the FCFS waiting queue from `free_tokens`."""
  taken = 0
  for need in waiting_needs:
    if taken + need > free_tokens:
      break
    taken += need
  return taken


class MemoryAccount:
  """Accumulates the partition over steps (see the module docstring).

  Attributes:
    budget_tokens: T, the KV budget in token slots.
  """

  def __init__(self, budget_tokens: int):
    if budget_tokens < 1:
      raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    self.budget_tokens = budget_tokens
    # Sums of slots per category, over all steps and over saturated steps.
    self._all = dict.fromkeys(CATEGORIES, 0)
    self._sat = dict.fromkeys(CATEGORIES, 0)
    self._steps = self._sat_steps = 0
    self._running_sum = self._sat_running_sum = 0
    self.max_concurrent = 0

  def record(self, *, tokens: int, reservation: int, internal: int, external: int,
             num_running: int, saturated: bool, steps: int = 1,
             token_growth: int = 0) -> None:
    """Adds `steps` consecutive steps, the first with these slot counts.

    Over the run of steps the allocation is constant while every running request
    grows: tokens rise and reservation falls by `token_growth` slots per step.
    """
    free = self.budget_tokens - tokens - reservation - internal - external
    last_reserved = reservation - token_growth * (steps - 1)
    if min(tokens, reservation, internal, external, free, last_reserved, steps) < 0:
      raise ValueError(f"slot counts must be >= 0 and fit the budget {self.budget_tokens}: "
                       f"tokens={tokens} reservation={reservation} internal={internal} "
                       f"external={external} steps={steps} growth={token_growth}")
    ramp = token_growth * steps * (steps - 1) // 2
    add = {"token_utilization": steps * tokens + ramp, "reservation": steps * reservation - ramp,
           "internal_fragmentation": steps * internal, "external_fragmentation": steps * external,
           "free": steps * free}
    for key, value in add.items():
      self._all[key] += value
      if saturated:
        self._sat[key] += value
    self._steps += steps
    self._running_sum += steps * num_running
    if saturated:
      self._sat_steps += steps
      self._sat_running_sum += steps * num_running
    self.max_concurrent = max(self.max_concurrent, num_running)

  @property
  def steps(self) -> int:
    return self._steps

  def slot_sums(self, saturated: bool) -> Dict[str, int]:
    """Raw slot-step sums per category (integers)."""
    return dict(self._sat if saturated else self._all)

  def summary(self) -> Dict[str, float]:
    """Fractions of the KV budget per category plus concurrency and step counts."""
    use_sat = self._sat_steps > 0
    sums = self._sat if use_sat else self._all
    steps = self._sat_steps if use_sat else self._steps
    denom = self.budget_tokens * max(steps, 1)
    out = {key: sums[key] / denom for key in CATEGORIES}
    out["max_concurrent"] = self.max_concurrent
    out["mean_concurrent"] = (self._sat_running_sum if use_sat else self._running_sum) / max(
        steps, 1)
    out["steps"] = self._steps
    out["saturated_steps"] = self._sat_steps
    out["averaged_over"] = "saturated" if use_sat else "all"
    return out


def sharing_savings(state) -> Dict[str, float]:
  """KV blocks saved by sharing (fork / prefix reuse) in a `block_manager.BlockState`.

  Without sharing every active slot would own `cdiv(seq_len, block_size)` blocks;
  with sharing the pool holds `num_blocks - num_free` distinct blocks. The
  paper reports savings = 1 - shared / unshared (e.g. 37.6-55.2% for beam search
  on Alpaca).

  Returns:
    {"unshared_blocks", "used_blocks", "savings"} (savings 0.0 when nothing is held).
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  seq_lens = np.asarray(state.seq_lens)
  active = np.asarray(state.active)
  unshared = int(cdiv(seq_lens[active], state.block_size).sum())
  used = int(np.asarray(state.ref_count).shape[0] - int(state.num_free))
  return {"unshared_blocks": unshared, "used_blocks": used,
          "savings": 1.0 - used / unshared if unshared else 0.0}


def block_table_stats(requests: Sequence, block_size: int, max_len: int) -> Dict[str, float]:
  """{"mean_blocks_per_seq": mean cdiv(prompt + output, block_size) over `requests` (the
  blocks each sequence ends with), "block_table_width": cdiv(max_len, block_size) (entries
  of one block-table row)}."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  totals = np.array([r.total_len for r in requests])
  return {"mean_blocks_per_seq": float(np.mean(cdiv(totals, block_size))),
          "block_table_width": cdiv(max_len, block_size)}
