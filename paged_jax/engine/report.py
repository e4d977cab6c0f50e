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
    end = ch.end + len(ch.draft)   # a speculating row computes its drafts too (a chunk)
    work = (end - start, end)
    (decode if ch.num_scheduled == 1 and ch.start >= ch.seq.prompt_len else prefill).append(work)
  return tuple(prefill), tuple(decode)


def _loop_rows(outputs, spec_tokens: int) -> Tuple[int, ...]:
  """Live rows of each of the step's K - 1 decode-loop iterations: a slot's valid tokens
  past those its first iteration emitted (1, or a speculating row's accepted drafts + 1)
  are loop tokens, one per iteration, contiguous. The outputs are K deep, K + k in a step
  with drafts (`spec_tokens` = k there, else 0)."""
  valid = np.asarray(outputs.valid)                                   # [K (+ k), S]
  loop = valid.sum(axis=0) - np.asarray(outputs.emitted)              # [S]
  return tuple(int(np.sum(loop >= j)) for j in range(1, valid.shape[0] - spec_tokens))


def _started(group: Group) -> bool:
  return any(q.num_generated for q in group.seqs) or bool(group.finished)


@dataclasses.dataclass
class Before:
  """What a report needs from before `Scheduler.update` applies a step: the groups the
  plan runs, and which of them have no generated token yet."""
  running: List[Group]
  not_started: set
  spec_tokens: int = 0    # speculative decoding's k (0: off)

  @classmethod
  def of(cls, batch: Batch, scheduler) -> "Before":
    running = ([g for g in scheduler.running if g not in batch.preempted]
               + batch.admitted + batch.swapped_in)
    spec = scheduler.speculative
    return cls(running, {g.request_id for g in running if not _started(g)},
               spec.num_speculative_tokens if spec else 0)

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
        decode_loop_rows=_loop_rows(outputs, self.spec_tokens if bucket.spec else 0)
        if ok else ())


REPORT_COUNTERS = ("device_steps", "swapped_blocks", "generated_tokens")


def step_report(sched, base: Tuple[int, ...], applied: Optional[Dict[str, Any]]
                ) -> Tuple[StepReport, Tuple[int, ...]]:
  """The StepReport of one `Engine.step()` and the counters it was made at: `base`,
  the `REPORT_COUNTERS` at the last report; `applied`, `Before.parts` of the step
  applied (None: none was)."""
  now = tuple(sched.stats[k] for k in REPORT_COUNTERS)
  return StepReport(
      dispatches=now[0] - base[0], swapped_blocks=now[1] - base[1],
      generated_tokens=now[2] - base[2], num_running_groups=len(sched.running),
      num_running_seqs=sum(len(g.seqs) for g in sched.running), **(applied or {})), now


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
  if sched.speculative is not None:   # drafts proposed / accepted, and by draft position
    k = sched.speculative.num_speculative_tokens
    out.update(spec_steps=stats["spec_steps"],   # steps with at least one draft
               spec_draft_tokens=stats["spec_draft_tokens"],
               spec_accepted_tokens=stats["spec_accepted_tokens"],
               spec_accepted_by_position=[stats[("spec_accepted", i)] for i in range(k)],
               spec_drafted_by_position=[stats[("spec_drafted", i)] for i in range(k)])
    if sched.drafter is not None:   # the draft model's dispatches and catch-up tokens
      out.update(draft_dispatches=sched.drafter.stats["dispatches"],
                 draft_catchup_tokens=sched.drafter.stats["catchup_tokens"])
  if cache_config.hybrid:
    out.update(num_sliding_blocks=cache_config.num_sliding_blocks,
               num_free_sliding_blocks=c.sliding_free)
  return out


def describe(cache_config, options, max_model_len: int) -> str:
  """One line on the engine's pool and options (logged at INFO when one is built)."""
  c, o = cache_config, options
  return (f"block_size={c.block_size} num_blocks={c.num_blocks} KV capacity={c.num_slots} "
          f"tokens ({c.kv_cache_bytes / 2**20:.1f} MiB {c.dtype}), max_seqs={c.max_seqs}, "
          f"max_model_len={max_model_len}, budget={o.max_num_batched_tokens} tokens/step, "
          f"decode_steps_per_sync={o.decode_steps_per_sync}, preemption="
          f"{o.preemption_mode}, prefix_caching={c.enable_prefix_caching}")
