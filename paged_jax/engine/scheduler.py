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

`update` applies the plan's own decisions (admissions, swap-ins, preemptions, aborts)
together with the step's outputs, and commits them at once (`commit.Changes`): an
exception or Ctrl-C before the commit leaves every record as it was, and the step's
outputs can be applied again. A sequence that finishes on device (stop id, max_tokens)
is freed by that same step; host decisions (beam selection, preemption after a failed
step) leave work for the next plan in `carry`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from paged_jax.engine import beam
from paged_jax.engine import block_needs
from paged_jax.engine import planning
from paged_jax.engine import policy as policy_lib
from paged_jax.engine.commit import Changes, sigint_deferred
from paged_jax.engine.options import check_preemption_mode
from paged_jax.engine.params import RequestOutput
from paged_jax.engine.sequence import (Batch, Chunk, DeviceCounts, Group, GroupStatus,
                                       SeqState, Sequence)

_new = lambda factory: dataclasses.field(default_factory=factory)


def request_output(group: Group, seqs: List[Sequence]) -> RequestOutput:
  """The output of `group` from its (finished or, on abort, live) sequences."""
  return RequestOutput(
      request_id=group.request_id, prompt_token_ids=group.prompt,
      outputs=[q.tokens[q.prompt_len:] for q in seqs],
      finish_reasons=[q.finish_reason for q in seqs],
      cumulative_logprobs=[q.cum_logprob for q in seqs] if group.is_beam else None,
      num_preemptions=group.num_preemptions,
      logprobs=None if group.is_beam else [list(q.logprobs) for q in seqs],
      top_logprobs=[list(q.top_logprobs) for q in seqs] if group.params.logprobs else None,
      **_prompt_fields(group.prompt_scores))


def _prompt_fields(scores) -> Dict[str, Any]:
  """RequestOutput's prompt_logprobs / prompt_top_logprobs from `Group.prompt_scores`."""
  if scores is None:
    return {}
  return dict(prompt_logprobs=[None if x is None else x[0] for x in scores],
              prompt_top_logprobs=[None if x is None else list(x[1]) for x in scores])


def _insert(queue: List[Group], group: Group) -> None:
  """Into a queue kept in sort-key order (after equal keys)."""
  queue.insert(bisect.bisect([g.sort_key for g in queue], group.sort_key), group)


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
      _insert(self.waiting, group)

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
    done = _Update(self, batch, outputs, ch).run()
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


class _Update:
  """The new values one `Scheduler.update` writes, worked out into `ch` (nothing is
  written before `ch.commit()`): queues as new lists, records through `ch.set`."""

  def __init__(self, sched: Scheduler, batch: Batch, outputs, ch: Changes):
    self.s, self.b, self.ch = sched, batch, ch
    self.counts = sched.counts
    if isinstance(outputs, DeviceCounts):
      self.counts, outputs = outputs, None
    elif outputs is not None:
      self.counts = DeviceCounts.of(outputs)
    self.out = outputs
    self.running, self.waiting = list(sched.running), list(sched.waiting)
    self.swapped, self.groups = list(sched.swapped), dict(sched.groups)
    self.carry = Batch()
    self.stats = collections.Counter()
    self.done: List[Group] = []       # finished requests (outputs built after commit)
    self.preemptions = self.swaps = 0

  def get(self, record, name):
    return self.ch.get(record, name)

  def run(self) -> List[Group]:
    s, b, out, ch = self.s, self.b, self.out, self.ch
    ok = out is None or bool(out.ok)
    # 1. The plan's own decisions: they stand whatever the step did.
    for g in b.aborted:
      self.abort(g)
    for g in b.preempted:
      self.preempt(g, swap=g in b.swap_out)
    for g in b.swap_out:   # copied out before the step (carried ones: preempted earlier)
      ch.set(g, swapped_kv=b.swapped_out[g])
      self.stats["swap_out_bytes"] += b.swapped_out[g].nbytes
      self.stats["swapped_blocks"] += b.swapped_out[g].num_blocks
    for g in b.admitted:
      self.waiting.remove(g)
      self.start(g)
    for g in b.swapped_in:   # restored by the engine before the step
      self.swapped.remove(g)
      self.start(g)
      self.stats["swapped_blocks"] += g.swapped_kv.num_blocks
      ch.set(g, swapped_kv=None)
      for q in g.seqs:
        ch.set(q, state=SeqState.RUNNING)
    # 2. Device work that stood even when the reservations failed: attaches, beam forks.
    hits = {q: int(out.hit_tokens[b.slot(q)]) for q in b.attaches} if out is not None else {}
    if b.attaches and out is not None:   # what the planner's attach-ahead reads
      frac = sum(hits.values()) / sum(b.attach_lens)
      ch.set(s, prefix_hit_ema=0.5 * (s.prefix_hit_ema + frac))
    for q, hit in hits.items():   # attached alone: it resumes after its hit
      ch.set(q, state=SeqState.RUNNING, num_computed=hit)
    for _, child in b.forks:
      ch.set(child, state=SeqState.RUNNING)
    if out is not None:
      self.stats["device_steps"] += 1
      self.stats["bucket_tokens"] += b.bucket.tokens if b.bucket else 0   # padded tokens
    if not ok:
      self.stats["out_of_blocks_retries"] += 1
      self.preempt_last()
    elif out is not None:
      self.apply_outputs(hits)
    if b.reset_prefix:   # an empty cache: the next lookups miss
      ch.set(s, prefix_hit_ema=0.0)
      for k in ("prefix_hit_tokens", "prefill_tokens", "computed_tokens"):
        self.stats[k] = -s.stats[k]
    self.write_scheduler(ok)
    return self.done

  # ---- queue moves ---------------------------------------------------------------------
  def start(self, g: Group) -> None:
    """An admitted or swapped-in group runs, in the slots the plan gave it."""
    self.ch.set(g, status=GroupStatus.RUNNING, slots=self.b.group_slots[g])
    for q in g.seqs:
      self.ch.set(q, slot=self.b.slot_of[q])
    self.running.append(g)

  def preempt(self, g: Group, swap: bool, carry: Optional[Batch] = None) -> None:
    """A running group goes back to the waiting queue (recompute: its rows dropped,
    prefilled again later, samples forked again) or to the swapped queue."""
    ch = self.ch
    self.running.remove(g)
    self.preemptions += 1
    ch.set(g, num_preemptions=g.num_preemptions + 1, slots=[])
    if swap:
      self.swaps += 1
      ch.set(g, status=GroupStatus.SWAPPED)
      for q in self.get(g, "seqs"):
        ch.set(q, state=SeqState.SWAPPED, slot=-1, topk=None)
      _insert(self.swapped, g)
    else:
      ch.set(g, status=GroupStatus.WAITING)
      for i, q in enumerate(self.get(g, "seqs")):
        ch.set(q, state=SeqState.FORKING if i else SeqState.WAITING, slot=-1, topk=None,
               num_computed=0, share_id=-1)
      _insert(self.waiting, g)

  def preempt_last(self) -> None:
    """After a device OUT_OF_BLOCKS: the running group of the largest key is preempted;
    its frees (and its copy to host) go to the next step, which admits nothing."""
    if not self.running:
      raise RuntimeError("OUT_OF_BLOCKS with no running group to preempt")
    victim = max(self.running, key=lambda g: g.sort_key)
    seqs = self.get(victim, "seqs")
    forking = {c for _, c in self.b.forks}
    swap = (self.s.preemption_mode == "swap" or (
        self.s.preemption_mode == "auto" and len(seqs) > 1)) and all(
            self.get(q, "state") is SeqState.RUNNING and self.get(q, "num_computed") > 0
            and self.get(q, "topk") is None and q not in forking for q in seqs)
    self.carry.frees.extend(self.get(q, "slot") for q in seqs
                            if self.get(q, "state") is SeqState.RUNNING)
    if swap:
      self.carry.swap_out[victim] = [self.get(q, "slot") for q in seqs]
    self.preempt(victim, swap)

  def abort(self, g: Group) -> None:
    """Stops a request: its live sequences end with reason "abort"."""
    for q in g.seqs:
      self.ch.set(q, finish_reason="abort", state=SeqState.FINISHED)
    for queue in (self.waiting, self.running, self.swapped):
      if g in queue:
        queue.remove(g)
    self.ch.set(g, status=GroupStatus.FINISHED, slots=[], swapped_kv=None)
    self.groups.pop(g.request_id, None)
    self.done.append(g)

  def finish(self, g: Group) -> None:
    """A group done on the host's side: its live rows are freed by the next step."""
    for q in self.get(g, "seqs"):
      if self.get(q, "state") is SeqState.RUNNING:
        self.carry.frees.append(self.get(q, "slot"))
      self.ch.set(q, state=SeqState.FINISHED)
    self.carry.forks = [(p, c) for p, c in self.carry.forks if c not in self.get(g, "seqs")]
    self.ch.set(g, status=GroupStatus.FINISHED, slots=[])
    self.running.remove(g)
    self.groups.pop(g.request_id, None)
    self.done.append(g)

  # ---- the step's outputs ----------------------------------------------------------------
  def apply_outputs(self, hits: Dict[Sequence, int]) -> None:
    b, out, ch, st = self.b, self.out, self.ch, self.stats
    bs = self.s.block_size
    st["steps"] += bool(b.chunks or b.attaches or b.swapped_in)   # not frees-only
    st["loop_out_of_blocks"] += int(out.loop_out_of_blocks)
    chunked = set()
    for c in b.chunks:
      q, hit = c.seq, hits.get(c.seq, 0)
      ran_from = max(c.start, hit)     # the hit tokens were not computed
      st["prefill_tokens"] += max(0, min(c.end, q.prompt_len) - ran_from)
      st["computed_tokens"] += max(0, c.end - ran_from)
      ch.set(q, state=SeqState.RUNNING, share_id=-1, num_computed=max(c.end, hit))
      chunked.add(q)
    st["prefix_hit_tokens"] += sum(hits.values())
    st["prefix_attached_ahead"] += sum(q not in chunked for q in hits)
    for leader, child in b.post_forks:
      sid = leader.seq_id if leader.prompt_len % bs else -1   # a shared partial block
      ch.set(child, state=SeqState.RUNNING, num_computed=leader.prompt_len, share_id=sid)
      ch.set(leader, share_id=sid)
    self.take_prompt_scores()
    self.append_tokens()

  def take_prompt_scores(self) -> None:
    """Prompt tokens' log-probabilities the step computed (`prompt_logprobs`) into their
    groups' `prompt_scores`, found by (slot, position): position p scores token p + 1."""
    out = self.out
    found = np.nonzero(out.prompt_pos >= 0)[0]
    if not found.size:
      return
    seq_at = {c.slot: c.seq for c in self.b.chunks}
    owner = self.owner()
    new: Dict[int, Tuple[Group, list]] = {}
    for t in found.tolist():
      group = owner[seq_at[int(out.prompt_slot[t])]]
      k = group.params.prompt_logprobs
      scores = new.setdefault(id(group), (group, list(self.get(group, "prompt_scores"))))[1]
      top = zip(out.prompt_top_ids[t, :k].tolist(), out.prompt_top_logprobs[t, :k].tolist())
      scores[int(out.prompt_pos[t]) + 1] = (float(out.prompt_logprobs[t]), tuple(top))
    for group, scores in new.values():
      self.ch.set(group, prompt_scores=tuple(scores))

  def owner(self) -> Dict[Sequence, Group]:
    return {q: g for g in self.running for q in self.get(g, "seqs")}

  def append_tokens(self) -> None:
    """Sampled tokens onto their sequences; finishes on stop id / max_tokens (the device
    freed those slots itself: `StepOutputs.finished`); beam selection."""
    b, out, ch = self.b, self.out, self.ch
    owner = self.owner()
    tokens, valid = out.tokens.T.tolist(), out.valid.T.tolist()   # [S][K] Python ints
    logprobs = out.logprobs.T.tolist()
    sampled = [c.seq for c in b.chunks if c.samples]
    sampled += [c for _, c in b.post_forks if len(c.tokens) == c.prompt_len]
    device_freed, beam_groups = [], []
    for q in sampled:
      group, slot = owner[q], b.slot(q)
      if group.is_beam:
        ch.set(q, topk=(out.topk_logprobs[slot], out.topk_ids[slot]))
        if group not in beam_groups:
          beam_groups.append(group)
        continue
      sp, nc, new = group.params, self.get(q, "num_computed"), []
      reason = None
      for k, tok in enumerate(tokens[slot]):
        if not valid[slot][k]:
          break
        nc += k > 0                      # the decode loop fed the previous token
        new.append(tok)
        reason = ("stop" if tok in sp.stop_token_ids else
                  "length" if q.num_generated + len(new) >= sp.max_tokens else None)
        if reason:
          break
      self.stats["generated_tokens"] += len(new)
      ch.extend(q.tokens, new)
      ch.extend(q.logprobs, logprobs[slot][:len(new)])
      if sp.logprobs:
        ids = out.top_ids[:len(new), slot, :sp.logprobs].tolist()
        vals = out.top_logprobs[:len(new), slot, :sp.logprobs].tolist()
        ch.extend(q.top_logprobs, [tuple(zip(i, v)) for i, v in zip(ids, vals)])
      ch.set(q, num_computed=nc)
      if reason:
        device_freed.append(slot)
        self.finish_seq(group, q, reason)
    freed = [int(i) for i in out.finished.nonzero()[0]]
    if sorted(device_freed) != freed:
      raise RuntimeError(f"the step freed slots {freed}, the host finished {sorted(device_freed)}")
    for group in beam_groups:
      if all(self.get(q, "topk") is not None for q in self.get(group, "seqs")):
        self.beam_step(group)

  def finish_seq(self, g: Group, q: Sequence, reason: str) -> None:
    """A sequence the device finished (and freed) in this step."""
    self.ch.set(q, finish_reason=reason, state=SeqState.FINISHED)
    live = [x for x in self.get(g, "seqs") if x is not q]
    self.ch.set(g, seqs=live, finished=self.get(g, "finished") + [q])
    if not live:
      self.finish(g)

  def beam_step(self, g: Group) -> None:
    """One beam selection (`beam.advance`): dropped beams are freed and new ones forked
    by the next step; a finished search finishes the group."""
    step = beam.advance(g, lambda: next(self.s._seq_ids), self.s.block_size, self.ch)  # pylint: disable=protected-access
    for parent in step.dropped:
      if self.get(parent, "state") is SeqState.RUNNING:
        self.carry.frees.append(self.get(parent, "slot"))
      self.ch.set(parent, state=SeqState.FINISHED)
    self.carry.forks.extend(step.forks)
    self.stats["generated_tokens"] += len(self.get(g, "seqs"))
    if step.done:
      self.finish(g)

  def write_scheduler(self, ok: bool) -> None:
    s, b = self.s, self.b
    ran = bool(b.chunks or b.attaches or b.swapped_in)
    self.ch.set(s, running=self.running, waiting=self.waiting, swapped=self.swapped,
                groups=self.groups, carry=self.carry, counts=self.counts,
                after_failed_step=(not ok) or (s.after_failed_step and not ran),
                num_preemptions=s.num_preemptions + self.preemptions,
                num_swaps=s.num_swaps + self.swaps)
    self.ch.count(s.stats, self.stats)
