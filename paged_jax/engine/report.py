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
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from paged_jax.engine.buckets import Bucket
from paged_jax.engine.sequence import Batch, Group, GroupStatus, Sequence

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


def chunk_work(batch: Batch, hits: Optional[Dict[Sequence, int]] = None) -> Tuple[Work, Work]:
  """(prefill_chunks, decode_rows) of a planned batch.

  A decode row feeds one generated token (it starts at or past its prompt); everything
  else (prompt chunks, recomputation of generated tokens) is prefill.

  Args:
    hits: {sequence: prompt tokens attached from the prefix cache in this step}. The
      planner plans such a prompt's first chunk from 0 and the device skips the hit
      tokens (`prefix_cache.step.skip_hits`), so the chunk computes only its tokens past
      the hit; one wholly inside the hit computes nothing and is left out.
  """
  prefill, decode = [], []
  for ch in batch.chunks:
    start = max(ch.start, (hits or {}).get(ch.seq, 0))
    if start >= ch.end:
      continue
    work = (ch.end - start, ch.end)
    (decode if ch.num_tokens == 1 and ch.start >= ch.seq.prompt_len else prefill).append(work)
  return tuple(prefill), tuple(decode)


def _started(group: Group) -> bool:
  return any(q.num_generated for q in group.seqs) or bool(group.finished)


@dataclasses.dataclass
class Before:
  """What a report needs from before `Scheduler.update` applies a step: the groups the
  plan runs, and which of them have no generated token yet."""
  running: List[Group]
  not_started: set

  @classmethod
  def of(cls, batch: Batch, scheduler) -> "Before":
    running = ([g for g in scheduler.running if g not in batch.preempted]
               + batch.admitted + batch.swapped_in)
    return cls(running, {g.request_id for g in running if not _started(g)})

  def parts(self, batch: Batch, outputs, finished, bucket: Bucket) -> Dict[str, Any]:
    """The StepReport fields of the step once `update` applied `outputs`."""
    done = [o.request_id for o in finished]
    preempted = batch.preempted + [g for g in self.running
                                   if g.status in (GroupStatus.WAITING, GroupStatus.SWAPPED)]
    ok = bool(outputs.ok)
    hits = {q: int(outputs.hit_tokens[batch.slot(q)]) for q in batch.attaches}
    # The chunks as planned, less the prefix-cache hits the step reported.
    prefill, decode = chunk_work(batch, hits) if ok else ((), ())
    return dict(
        ok=ok, bucket=bucket, finished_ids=tuple(done),
        first_token_ids=tuple(g.request_id for g in self.running if g.request_id in
                              self.not_started and (g.request_id in done or _started(g))),
        preempted_ids=tuple(g.request_id for g in preempted),
        prefill_chunks=prefill, decode_rows=decode,
        prefix_hit_tokens=sum(hits.values()) if ok else 0,
        cow_copies=int(outputs.cow_copies),
        decode_loop_rows=tuple(int(v) for v in np.asarray(outputs.valid)[1:].sum(axis=1))
        if ok else ())


def metrics(sched, cache_config, stats) -> Dict[str, Any]:
  """`Engine.metrics()`: the scheduler's queues and the device counts of the last step
  (`sched.counts`), with the engine's host counters `stats`; no device work."""
  c = sched.counts
  out = {"num_blocks": cache_config.num_blocks, "num_free_blocks": c.num_free,
         "num_evictable_blocks": c.num_evictable, "num_running": len(sched.running),
         "num_waiting": len(sched.waiting), "num_swapped": len(sched.swapped),
         "num_preemptions": sched.num_preemptions, "num_swaps": sched.num_swaps,
         "prefix_hit_blocks": c.prefix_hit_blocks,
         "prefix_query_blocks": c.prefix_query_blocks,
         "prefix_hit_rate": (c.prefix_hit_blocks / c.prefix_query_blocks
                             if c.prefix_query_blocks else 0.0),
         "prefix_hit_tokens": stats["prefix_hit_tokens"],
         "prefill_tokens": stats["prefill_tokens"],
         "steps": stats["steps"], "generated_tokens": stats["generated_tokens"]}
  if cache_config.hybrid:
    out.update(num_sliding_blocks=cache_config.num_sliding_blocks,
               num_free_sliding_blocks=c.sliding_free)
  return out
