"""What one engine step did: `StepReport`, read from `Engine.last_step` after `step()`.

For harnesses (time to first token without reading the scheduler) and for a device-time
model (the work of each chunk and row the step computed):

    engine.step()
    r = engine.last_step
    r.first_token_ids, r.finished_ids     # request ids
    r.prefill_chunks, r.decode_rows       # ((new tokens, context tokens attended), ...)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import numpy as np

from paged_jax.engine.inputs import Bucket
from paged_jax.engine.sequence import Batch, Group

Work = Tuple[Tuple[int, int], ...]   # ((new tokens, context tokens attended), ...)


@dataclasses.dataclass(frozen=True)
class StepReport:
  """One `Engine.step()`: its plan, what the device did, and what came out.

  Attributes:
    ok: the step's reservations succeeded (False: nothing ran; the engine preempted
      the newest group and re-plans).
    bucket: the compiled shape the step ran on (None when nothing was dispatched).
    dispatches: jitted step calls this `step()` made: 1; 2 when finished requests'
      blocks were freed by a frees-only call at its end; 0 when nothing ran.
    first_token_ids: request ids whose first generated token came out in this step.
    finished_ids: request ids whose output `step()` returns (finished in this step).
    preempted_ids: request ids preempted while planning this step (or after it failed).
    num_running_groups / num_running_seqs: requests / sequences running after the step.
    swapped_blocks: KV blocks copied to host and back in this step (out + in).
    prefill_chunks: per prefill chunk (prompt or recomputation), (new tokens, tokens in
      its context after the chunk: what its attention reads).
    decode_rows: the same per decode row (one new, generated token each).
    prefix_hit_tokens: prompt tokens attached from the prefix cache in this step.
    cow_copies: copy-on-write block copies (first forward and decode loop).
    decode_loop_rows: live rows of each decode-loop iteration after the first forward
      (length `decode_steps_per_sync - 1` when the step ran: the loop has a fixed trip
      count; iterations with 0 live rows run on padding).
    generated_tokens: tokens appended to sequences (every sample and beam).
  """
  ok: bool = True
  bucket: Optional[Bucket] = None
  dispatches: int = 0
  first_token_ids: Tuple[Any, ...] = ()
  finished_ids: Tuple[Any, ...] = ()
  preempted_ids: Tuple[Any, ...] = ()
  num_running_groups: int = 0
  num_running_seqs: int = 0
  swapped_blocks: int = 0
  prefill_chunks: Work = ()
  decode_rows: Work = ()
  prefix_hit_tokens: int = 0
  cow_copies: int = 0
  decode_loop_rows: Tuple[int, ...] = ()
  generated_tokens: int = 0

  @property
  def preempted(self) -> int:
    """Groups preempted in this step."""
    return len(self.preempted_ids)

  @property
  def decode_loop_iterations(self) -> int:
    """Decode-loop iterations the device ran after the first forward."""
    return len(self.decode_loop_rows)


def chunk_work(batch: Batch) -> Tuple[Work, Work]:
  """(prefill_chunks, decode_rows) of a planned batch, before its outputs are applied.

  A decode row feeds one generated token (`num_computed >= prompt_len`); everything
  else (prompt chunks, recomputation of generated tokens) is prefill."""
  prefill, decode = [], []
  for ch in batch.chunks:
    q = ch.seq
    work = (ch.num_tokens, q.num_computed + ch.num_tokens)
    (decode if ch.num_tokens == 1 and q.num_computed >= q.prompt_len else prefill).append(work)
  return tuple(prefill), tuple(decode)


def not_started(groups) -> set:
  """Ids of the groups that have not generated a token yet (before a step applies)."""
  return {g.request_id for g in groups
          if not any(q.num_generated for q in g.seqs) and not g.finished}


def has_started(group: Group) -> bool:
  return any(q.num_generated for q in group.seqs) or bool(group.finished)


def device_work(outputs) -> dict:
  """The fields a StepReport takes from the step's (host) outputs."""
  valid = np.asarray(outputs.valid)
  ok = bool(outputs.ok)
  return dict(ok=ok, cow_copies=int(outputs.cow_copies),
              decode_loop_rows=tuple(int(v) for v in valid[1:].sum(axis=1)) if ok else ())
