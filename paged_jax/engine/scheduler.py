"""Host-side scheduler: one plan in, one update out (vLLM v1's `schedule()` /
`update_from_output()`, nano-vllm's schedule / postprocess).

    batch = scheduler.schedule()              # the plan: everything the step will do
    ...                                       # inputs, the jitted step, one host sync
    finished = scheduler.update(batch, outputs)   # the ONE place outputs are applied

The scheduler decides WHAT runs in a step; the jitted step (`step.py`, whose docstring
gives the order of its effects) does the block allocation on device. It plans from the
counts the previous step returned (free + evictable blocks, `DeviceCounts`) and each
chunk's exact block need (new blocks plus the copy-on-write copies of a shared last
block: every writer copies but the last remaining holder). The step frees before it
reserves, and the device also reports, per slot, the blocks that slot alone references:
those of the slots freed in a step count for that step's reservations. When a running
group does not fit, the newest groups are preempted until it does, and the step goes on
with everyone older (vLLM's rule). Should a reservation still fail on device (a status,
never a spin), `update` preempts the newest group and the next plan re-plans with the
running groups alone (no swap-in, no admission), so a retry never brings the shortage back.

A sequence that finishes on device (stop id, max_tokens) is freed by that same step;
only host decisions (beam selection, preemption after a failed step) leave work for the
next plan, carried in `carry` (a Batch the next `schedule()` starts from).

The records it plans with (Sequence, Group, Chunk, Batch, DeviceCounts) are in
`sequence.py`; the block counts it plans by are in `block_needs.py`.

The planning policy (`schedule()`) is in `planning.py`, mixed into Scheduler.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from paged_jax.engine import beam
from paged_jax.engine import block_needs
from paged_jax.engine.options import check_preemption_mode
from paged_jax.engine.params import RequestOutput
from paged_jax.engine.planning import Planner
from paged_jax.engine.sequence import (FIXED, Batch, Chunk, DeviceCounts, Group, GroupStatus,
                                       Sequence)

_fixed = lambda default: dataclasses.field(default=default, metadata=FIXED)
_new = lambda factory: dataclasses.field(default_factory=factory)


def request_output(group: Group, seqs: List[Sequence]) -> RequestOutput:
  """The output of `group` from its (finished or, on abort, live) sequences."""
  return RequestOutput(
      request_id=group.request_id, prompt_token_ids=group.prompt,
      outputs=[q.tokens[q.prompt_len:] for q in seqs],
      finish_reasons=[q.finish_reason for q in seqs],
      cumulative_logprobs=[q.cum_logprob for q in seqs] if group.is_beam else None,
      num_preemptions=group.num_preemptions)


@dataclasses.dataclass(eq=False, kw_only=True, repr=False)
class Scheduler(Planner):
  """FCFS continuous batching with chunked prefill and preemption (host Python).

  Attributes (FIXED: set on construction; the rest is the state a step changes, which
  `snapshot.Snapshot` saves and restores field by field):
    block_size, max_seqs, max_num_batched_tokens, preemption_mode, prefix_caching;
    lookup_budget: prompt tokens looked up in the prefix cache per step;
    lookahead: decode-loop tokens after a sample (decode_steps_per_sync - 1).
    token_bucket: tokens planned in a step -> the padded tokens its compiled shape
      computes (`StepBuckets.mixed_tokens`; None: no padding).
    waiting / running / swapped: the queues (waiting and swapped by arrival).
    groups: unfinished requests by id.
    carry: what the last update left for the next step (beam forks, frees of dropped
      or finished beams, a swap-out after a failed step); `schedule()` starts from it.
    counts: the last step's DeviceCounts (None: `schedule` needs them passed).
    after_failed_step: the last step ran out of blocks on device; the next plan swaps
      in and admits nothing (`schedule` clears it).
    prefix_hit_ema: with prefix caching, the fraction of looked-up prompt tokens the
      prefix cache held, averaged over the steps that attached (each step's weight
      halves with every later one); the planner attaches ahead when it is high.
    stats: counters (steps, tokens, retries, ...); num_preemptions, num_swaps.
  """
  block_size: int = dataclasses.field(metadata=FIXED)
  max_seqs: int = dataclasses.field(metadata=FIXED)
  max_num_batched_tokens: int = dataclasses.field(metadata=FIXED)
  preemption_mode: str = _fixed("recompute")
  prefix_caching: bool = _fixed(False)
  lookup_budget: int = _fixed(0)
  lookahead: int = _fixed(0)
  token_bucket: Optional[Callable[[int], int]] = _fixed(None)
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

  def __post_init__(self):
    check_preemption_mode(self.preemption_mode)
    self._seq_ids = itertools.count(1 << 40)   # beam hypotheses made by update

  # ---- queues and slots -----------------------------------------------------------------
  def add(self, group: Group) -> None:
    group.status = GroupStatus.WAITING
    self.groups[group.request_id] = group
    self._insert_by_arrival(self.waiting, group)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self.swapped)

  @staticmethod
  def _insert_by_arrival(queue: List[Group], group: Group) -> None:
    keys = [g.arrival for g in queue]
    queue.insert(bisect.bisect(keys, group.arrival), group)

  def _slots_free(self, pending_frees: List[int]) -> List[int]:
    """Slots no running group holds and no pending device free names, ascending."""
    busy = set(pending_frees).union(*(g.slots for g in self.running))
    return [s for s in range(self.max_seqs) if s not in busy]

  @property
  def free_slots(self) -> List[int]:
    """Slots a group admitted now may take (derived: nothing to keep in step)."""
    return self._slots_free(self.carry.frees)

  def frees_owed(self) -> bool:
    """Carried frees of slots no running group holds (a finished or aborted request's,
    a group preempted after a failed step), or anything carried with nothing left to
    run: until a step runs them, `metrics()` would count those blocks as used."""
    if not self.has_unfinished():
      return bool(self.carry.frees or self.carry.forks or self.carry.swap_out)
    held = set().union(*(g.slots for g in self.running))
    return any(s not in held for s in self.carry.frees)

  def take_carry(self) -> Batch:
    """The carried work alone, as a batch (a frees-only step)."""
    batch, self.carry = self.carry, Batch()
    return batch

  def _free_seq(self, seq: Sequence, batch: Batch, on_device: bool = False) -> None:
    """A finished / dropped / preempted sequence's slot: freed by `batch`'s step, or
    already by the step that finished it (`on_device`: the device freed it itself)."""
    if seq.on_device and not on_device:
      batch.frees.append(seq.slot)
    seq.on_device = False

  def _finish_group(self, group: Group, batch: Batch) -> None:
    """Frees every live sequence and gives the group's slots back."""
    for seq in group.seqs:
      self._free_seq(seq, batch)
    batch.forks = [(p, c) for p, c in batch.forks if c not in group.seqs]
    self._release_slots(group)
    group.status = GroupStatus.FINISHED
    if group in self.running:
      self.running.remove(group)
    self.groups.pop(group.request_id, None)

  @staticmethod
  def _release_slots(group: Group) -> None:
    group.slots = []
    for seq in group.seqs:
      seq.slot = -1

  def abort(self, request_id: Any) -> Optional[RequestOutput]:
    """Stops a request now (its frees carried to the next step); its output so far, or
    None for an id that is not unfinished."""
    group = self.groups.get(request_id)
    if group is None:
      return None
    for q in group.seqs:
      q.finish_reason = "abort"
      q.swapped_kv = None
    if group.status == GroupStatus.WAITING:
      self.waiting.remove(group)
    elif group.status == GroupStatus.SWAPPED:
      self.swapped.remove(group)
    self.carry.swap_out = [(g, s) for g, s in self.carry.swap_out if g is not group]
    out = request_output(group, sorted(group.finished + group.seqs, key=lambda q: q.index))
    self._finish_group(group, self.carry)
    return out

  # ---- block needs (block_needs.py, at this scheduler's block size and lookahead) ----
  def group_need(self, group: Group) -> int:
    return block_needs.group_need(group, self.block_size)

  def chunks_need(self, group: Group, chunks: List[Chunk]) -> int:
    return block_needs.chunks_need(group, chunks, self.block_size)

  def lookahead_need(self, group: Group, chunks: List[Chunk]) -> int:
    return block_needs.lookahead_need(group, chunks, self.block_size, self.lookahead)

  # ---- preemption -----------------------------------------------------------------------
  def preempt(self, group: Group, batch: Batch) -> None:
    """Preempts a running group: `batch`'s step frees its slots (after copying them to
    host when it swaps)."""
    self.running.remove(group)
    swap = self._swappable(group, batch)
    batch.forks = [(p, c) for p, c in batch.forks if c not in group.seqs]
    group.num_preemptions += 1
    self.num_preemptions += 1
    batch.preempted.append(group)
    if swap:   # the engine copies the slots out before the step frees them
      batch.swap_out.append((group, [q.slot for q in group.seqs]))
    for seq in group.seqs:
      seq.topk = None
      self._free_seq(seq, batch)
      if not swap:   # sharing is restored on swap-in; a recompute starts over
        seq.last_block_shared = False
        seq.num_computed = 0
    if not swap:
      for seq in group.seqs[1:]:
        seq.pending_fork = True
    self._release_slots(group)
    if swap:
      self.num_swaps += 1
      group.status = GroupStatus.SWAPPED
      self._insert_by_arrival(self.swapped, group)
    else:
      group.status = GroupStatus.WAITING
      self._insert_by_arrival(self.waiting, group)

  def _swappable(self, group: Group, batch: Batch) -> bool:
    """Whether a preempted group swaps: the mode says so, and every sequence's slot
    holds exactly its computed tokens (none pending a fork or a beam selection)."""
    if self.preemption_mode == "recompute" or (
        self.preemption_mode == "auto" and len(group.seqs) == 1):
      return False
    forking = {id(c) for _, c in batch.forks}
    return all(q.on_device and q.num_computed > 0 and not q.pending_fork and q.topk is None
               and id(q) not in forking for q in group.seqs)

  def preempt_newest(self) -> Group:
    """After a device OUT_OF_BLOCKS: preempts the newest running group (next plan re-plans)."""
    if not self.running:
      raise RuntimeError("OUT_OF_BLOCKS with no running group to preempt")
    victim = max(self.running, key=lambda g: g.arrival)
    self.preempt(victim, self.carry)   # its frees (and swap-out) go to the next step,
    self.carry.preempted.clear()       # which preempted nothing itself (its report)
    self.after_failed_step = True      # and serves only the running groups
    return victim

  # ---- update: a step's outputs applied, in one place -----------------------------------
  def update(self, batch: Batch, outputs) -> List[RequestOutput]:
    """Applies the outputs of the step that ran `batch` (`StepOutputs` as numpy); returns
    the requests that finished. Frees, forks and prefix attaches stood whatever happened;
    chunks, post-forks and tokens only when `outputs.ok` (the reservations succeeded;
    otherwise the newest group is preempted and the next plan re-plans)."""
    self.counts = DeviceCounts.of(outputs)
    ok = bool(outputs.ok)
    chunked = {id(ch.seq) for ch in batch.chunks} if ok else set()
    batch.attach_hits = [int(outputs.hit_tokens[seq.slot]) for seq in batch.attaches]
    if batch.attaches:   # what the planner's `attach_ahead` reads
      looked = sum(batch.attach_lens)
      self.prefix_hit_ema = 0.5 * (self.prefix_hit_ema + sum(batch.attach_hits) / looked)
    hit_of = batch.hit_of
    for seq, hit in zip(batch.attaches, batch.attach_hits):
      seq.on_device = True
      # An attached prompt comes from the waiting queue (num_computed 0). Attached
      # alone, it resumes after its hit; with a chunk that ran (planned from 0, its hit
      # tokens skipped on device) it has computed max(chunk end, hit), set once in
      # _append_tokens (a chunk inside the hit computed nothing).
      if id(seq) not in chunked:
        seq.num_computed = hit
    for _, child in batch.forks:
      child.on_device = True
    if not ok:   # a reservation failed on device: nothing ran
      self.stats["out_of_blocks_retries"] += 1
      self.preempt_newest()
      return []
    stats = self.stats
    stats["steps"] += bool(batch.chunks or batch.attaches or batch.swap_in)   # not frees-only
    stats["loop_out_of_blocks"] += int(outputs.loop_out_of_blocks)
    for ch in batch.chunks:
      seq, nc = ch.seq, ch.seq.num_computed
      nc_run = max(nc, hit_of.get(id(seq), 0))     # the hit tokens were not computed
      stats["prefill_tokens"] += max(0, min(nc + ch.num_tokens, seq.prompt_len) - nc_run)
      stats["computed_tokens"] += max(0, nc + ch.num_tokens - nc_run)
      seq.on_device = True
      seq.last_block_shared = False
    stats["prefix_hit_tokens"] += sum(batch.attach_hits)
    stats["prefix_attached_ahead"] += sum(id(seq) not in chunked for seq in batch.attaches)
    for leader, child in batch.post_forks:
      child.on_device = True
      child.pending_fork = False
      child.num_computed = leader.prompt_len
      shared = leader.prompt_len % self.block_size != 0
      child.last_block_shared = leader.last_block_shared = shared
      child.share_id = leader.share_id = leader.seq_id
    return self._append_tokens(batch, outputs, hit_of)

  def _append_tokens(self, batch: Batch, out, hit_of) -> List[RequestOutput]:
    """Sampled tokens onto their sequences; finishes on stop id / max_tokens (the
    device freed those slots itself: `StepOutputs.finished`); beam selection.
    `hit_of`: id(seq) -> hit tokens of this step's attaches (their chunks ran from 0)."""
    finished: List[RequestOutput] = []
    device_freed = []
    owner = {id(q): g for g in self.running for q in g.seqs}
    sampled = [ch.seq for ch in batch.chunks if ch.samples]
    for ch in batch.chunks:
      ch.seq.num_computed = max(ch.seq.num_computed + ch.num_tokens, hit_of.get(id(ch.seq), 0))
    sampled += [c for _, c in batch.post_forks if len(c.tokens) == c.prompt_len]
    beam_groups = []
    for seq in sampled:
      group, slot = owner[id(seq)], seq.slot
      if group.is_beam:
        seq.topk = (out.topk_logprobs[slot], out.topk_ids[slot])
        if group not in beam_groups:
          beam_groups.append(group)
        continue
      for k in range(out.tokens.shape[0]):
        if not out.valid[k, slot]:
          break
        if k > 0:
          seq.num_computed += 1
        tok = int(out.tokens[k, slot])
        seq.tokens.append(tok)
        self.stats["generated_tokens"] += 1
        reason = ("stop" if tok in group.params.stop_token_ids else
                  "length" if seq.num_generated >= group.params.max_tokens else None)
        if reason:
          device_freed.append(slot)
          self._finish_seq(group, seq, reason, finished)
          break
    if sorted(device_freed) != np.flatnonzero(out.finished).tolist():
      raise RuntimeError(f"the step freed slots {np.flatnonzero(out.finished).tolist()}, "
                         f"the host finished {sorted(device_freed)}")
    for group in beam_groups:
      if all(q.topk is not None for q in group.seqs):
        self._beam_step(group, finished)
    return finished

  def _finish_seq(self, group: Group, seq: Sequence, reason: str, finished: list) -> None:
    """A sequence the device finished (and freed) in this step."""
    seq.finish_reason = reason
    group.seqs.remove(seq)
    group.finished.append(seq)
    self._free_seq(seq, self.carry, on_device=True)
    if not group.seqs:
      self._finish(group, finished)

  def _finish(self, group: Group, finished: list) -> None:
    self._finish_group(group, self.carry)
    if group.is_beam:
      best = sorted(group.finished, key=lambda q: -q.cum_logprob)[:group.params.n]
    else:
      best = sorted(group.finished, key=lambda q: q.index)
    finished.append(request_output(group, best))

  def _beam_step(self, group: Group, finished: list) -> None:
    """Applies one beam selection (`beam.advance`): dropped beams are freed and new
    ones forked by the next step; a finished search finishes the group."""
    step = beam.advance(group, lambda: next(self._seq_ids), self.block_size)
    for parent in step.dropped:
      self._free_seq(parent, self.carry)
    self.carry.forks.extend(step.forks)
    self.stats["generated_tokens"] += len(group.seqs)
    if step.done:
      self._finish(group, finished)
