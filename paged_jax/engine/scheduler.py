"""Host-side scheduler: one plan in, one update out (vLLM v1's `schedule()` /
`update_from_output()`, nano-vllm's schedule / postprocess).

    batch = scheduler.schedule()              # the plan: reads the records, changes nothing
    ...                                       # inputs, the jitted step, one host sync
    finished = scheduler.update(batch, outputs)   # the ONE writer of the records

The scheduler decides WHAT runs in a step (`planning.py`); the jitted step (`step.py`,
whose docstring gives the order of its effects) does the block allocation on device. It
plans from the counts the previous step returned (free + evictable blocks,
`DeviceCounts`) and each chunk's exact block need (`block_needs.py`). Should a
reservation still fail on device (a status, never a spin), `update` preempts the
running group of the largest key and the next plan re-plans with the running groups
alone (no swap-in, no admission), so a retry never brings the shortage back.

`update` (its work in `update.py`) applies the plan's own decisions (admissions,
swap-ins, preemptions, aborts) together with the step's outputs, and commits them at
once (`commit.Changes`): an
exception or Ctrl-C before the commit leaves every record as it was, and the step's
outputs can be applied again. A sequence that finishes on device (stop id, max_tokens)
is freed by that same step; host decisions (beam selection, preemption after a failed
step) leave work for the next plan in `carry`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable, Dict, List, Optional

from paged_jax.engine import block_needs
from paged_jax.engine import planning
from paged_jax.engine import policy as policy_lib
from paged_jax.engine.commit import Changes, sigint_deferred
from paged_jax.engine.options import check_preemption_mode
from paged_jax.engine.params import RequestOutput
from paged_jax.engine.sequence import Batch, Chunk, DeviceCounts, Group, GroupStatus, SeqState
from paged_jax.engine.update import Update, insert_sorted, request_output

_new = lambda factory: dataclasses.field(default_factory=factory)


@dataclasses.dataclass(eq=False, kw_only=True, repr=False)
class Scheduler:
  """Continuous batching with chunked prefill and preemption (host Python).

  Attributes (set on construction):
    block_size, max_seqs, max_num_batched_tokens, preemption_mode, prefix_caching;
    lookup_budget: prompt tokens looked up in the prefix cache per step;
    lookahead: decode-loop tokens after a sample (decode_steps_per_sync - 1);
    token_bucket: tokens planned in a step -> the padded tokens its compiled shape
      computes (`StepBuckets.mixed_tokens`; None: no padding);
    policy: the scheduling policy's key function (`policy.py`; "fcfs" by default).
    speculative: a `speculative.SpeculativeConfig` (decoding sequences get drafts) or None.
    drafter: with method "draft_model", the engine's `draft_model.DraftModel` (its
      `drafts` are what the planner gives decoding sequences); None otherwise.
  Attributes (written by `update` only; `add` queues a new request):
    waiting / running / swapped: the queues (waiting and swapped in sort-key order).
    groups: unfinished requests by id.
    carry: what the last update left for the next step (beam forks, frees of dropped
      or finished beams, a swap-out after a failed step); a plan starts from it.
    counts: the last step's DeviceCounts.
    after_failed_step: the last step ran out of blocks on device; the next plan swaps
      in and admits nothing.
    prefix_hit_ema: with prefix caching, the fraction of looked-up prompt tokens the
      prefix cache held, averaged over the steps that attached (each step's weight
      halves with every later one); the planner attaches ahead when it is high.
    stats: counters (steps, tokens, retries, swaps, ...); num_preemptions, num_swaps.
    spec_gain_ema / spec_step_misses / spec_retry_step: speculative decoding's
      engine-wide back-off (`speculative.back_off`): the running average of drafting
      steps' accepted drafts per drafting row (None before the first), drafting steps in
      a row that left it under `speculative.STEP_MIN_GAIN`, and the step count
      (stats["steps"]) before which no sequence drafts (2**misses steps after the last
      such step, at most 1024; 0 while the average is at or above the threshold).
  """
  block_size: int
  max_seqs: int
  max_num_batched_tokens: int
  preemption_mode: str = "recompute"
  prefix_caching: bool = False
  lookup_budget: int = 0
  lookahead: int = 0
  token_bucket: Optional[Callable[[int], int]] = None
  policy: Any = "fcfs"
  speculative: Any = None
  drafter: Any = None
  waiting: List[Group] = _new(list)
  running: List[Group] = _new(list)
  swapped: List[Group] = _new(list)
  groups: Dict[Any, Group] = _new(dict)
  carry: Batch = _new(Batch)
  counts: Optional[DeviceCounts] = None
  after_failed_step: bool = False
  prefix_hit_ema: float = 0.0
  stats: collections.Counter = _new(collections.Counter)
  num_preemptions: int = 0
  num_swaps: int = 0
  spec_gain_ema: Optional[float] = None
  spec_step_misses: int = 0
  spec_retry_step: int = 0

  def __post_init__(self):
    check_preemption_mode(self.preemption_mode)
    self.policy = policy_lib.resolve(self.policy)
    self._seq_ids = itertools.count(1 << 40)   # beam hypotheses made by update

  # ---- requests in -------------------------------------------------------------------
  def add(self, group: Group) -> None:
    """Queues a new request (its key computed, and checked, before anything changes)."""
    other = self.waiting[0].sort_key if self.waiting else None
    key = policy_lib.sort_key(self.policy, group, other)
    with sigint_deferred():
      group.sort_key, group.status = key, GroupStatus.WAITING
      self.groups[group.request_id] = group
      insert_sorted(self.waiting, group)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self.swapped)

  @property
  def attach_ahead(self) -> bool:
    """Admitted prompts may be attached alone, a step before their first chunk: the
    recent lookups hit at least ATTACH_AHEAD_HIT_FRACTION of their tokens."""
    return self.prefix_hit_ema >= planning.ATTACH_AHEAD_HIT_FRACTION

  def busy_slots(self) -> set:
    """Slots a running group holds or a carried free names."""
    return set(self.carry.frees).union(*(g.slots for g in self.running))

  @property
  def free_slots(self) -> List[int]:
    """Slots a group admitted now may take, ascending."""
    busy = self.busy_slots()
    return [s for s in range(self.max_seqs) if s not in busy]

  # ---- plans ---------------------------------------------------------------------------
  def schedule(self, num_free_blocks: Optional[int] = None, sole_blocks=None) -> Batch:
    """The next step's plan (`planning.plan`); changes nothing."""
    return planning.plan(self, num_free_blocks, sole_blocks)

  def carried(self) -> Batch:
    """A plan of the carried work alone (a frees-only step)."""
    return planning.carried(self)

  def plan_abort(self, request_id: Any) -> Optional[Batch]:
    """A plan that stops a request now (with the carried work): its rows are freed by
    the step that runs it; None for an id that is not unfinished."""
    group = self.groups.get(request_id)
    if group is None:
      return None
    batch = planning.carried(self)
    batch.aborted.append(group)
    batch.swap_out.pop(group, None)
    batch.forks = [(p, c) for p, c in batch.forks if c not in group.seqs]
    batch.frees.extend(q.slot for q in group.seqs if q.state is SeqState.RUNNING)
    return batch

  def frees_owed(self) -> bool:
    """Carried frees of slots no running group holds (a finished or aborted request's,
    a group preempted after a failed step), or anything carried with nothing left to
    run: until a step runs them, `metrics()` would count those blocks as used."""
    if not self.has_unfinished():
      return bool(self.carry.frees or self.carry.forks or self.carry.swap_out)
    held = set().union(*(g.slots for g in self.running))
    return any(s not in held for s in self.carry.frees)

  # ---- block needs (block_needs.py, at this scheduler's block size) --------------------
  def group_need(self, group: Group) -> int:
    return block_needs.group_need(group, self.block_size)

  def chunks_need(self, group: Group, chunks: List[Chunk]) -> int:
    return block_needs.chunks_need(group, chunks, self.block_size)

  # ---- update: the plan and the step's outputs applied, in one place -------------------
  def update(self, batch: Batch, outputs=None) -> List[RequestOutput]:
    """Applies `batch` and the outputs of the step that ran it: `StepOutputs` as numpy,
    a `DeviceCounts` (a dispatch that only reports counts) or None (nothing was
    dispatched). Returns the requests that finished (aborted ones included). The plan's
    decisions, frees, forks and prefix attaches stood whatever happened; chunks,
    post-forks and tokens only when `outputs.ok` (the reservations succeeded; otherwise
    the running group of the largest key is preempted and the next plan re-plans).
    All or nothing: an exception leaves every record as it was."""
    ch = Changes()
    done = Update(self, batch, outputs, ch).run()
    ch.commit()
    return [self._output(g, aborted=g in batch.aborted) for g in done]

  @staticmethod
  def _output(group: Group, aborted: bool) -> RequestOutput:
    if aborted:
      seqs = sorted(group.finished + group.seqs, key=lambda q: q.index)
    elif group.is_beam:
      seqs = sorted(group.finished, key=lambda q: -q.cum_logprob)[:group.params.n]
    else:
      seqs = sorted(group.finished, key=lambda q: q.index)
    return request_output(group, seqs)
