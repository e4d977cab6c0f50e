"""`Scheduler.update`'s work: a plan and the outputs of the step that ran it, applied to
the scheduler's records as one set of writes (`commit.Changes`, committed by the caller),
and the `RequestOutput`s built from the records. The only code that writes a `Group` or a
`Sequence` once it is queued.

    ch = Changes(); done = Update(scheduler, batch, outputs, ch).run(); ch.commit()

Order of `run`: the plan's own decisions (they stand whatever the step did), then, when
the step's reservations succeeded, its chunks, prompt scores and sampled tokens, then the
host decisions they lead to (finishes, beam selections), then the queues.
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from paged_jax.engine import beam
from paged_jax.engine import speculative
from paged_jax.engine.commit import Changes
from paged_jax.engine.params import RequestOutput
from paged_jax.engine.sequence import (Batch, DeviceCounts, Group, GroupStatus, SeqState,
                                       Sequence)


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


def partial_output(group: Group) -> RequestOutput:
  """What a queued or running group has so far: its samples in index order (a running
  sample's finish reason None); beams give empty outputs (hypotheses change until the
  end)."""
  if group.params.beam_width > 1:
    n = group.params.n
    return RequestOutput(group.request_id, group.prompt, [[] for _ in range(n)], [None] * n)
  return request_output(group, sorted(list(group.seqs) + list(group.finished),
                                      key=lambda q: q.index))


def _prompt_fields(scores) -> Dict[str, Any]:
  """RequestOutput's prompt_logprobs / prompt_top_logprobs from `Group.prompt_scores`."""
  if scores is None:
    return {}
  return dict(prompt_logprobs=[None if x is None else x[0] for x in scores],
              prompt_top_logprobs=[None if x is None else list(x[1]) for x in scores])


def insert_sorted(queue: List[Group], group: Group) -> None:
  """Into a queue kept in sort-key order (after equal keys)."""
  queue.insert(bisect.bisect([g.sort_key for g in queue], group.sort_key), group)


class Update:
  """The new values one `Scheduler.update` writes, worked out into `ch` (nothing is
  written before `ch.commit()`): queues as new lists, records through `ch.set`."""

  def __init__(self, sched, batch: Batch, outputs, ch: Changes):
    self.s, self.b, self.ch = sched, batch, ch
    self.counts = sched.counts
    # A counts-only report (the host tier's exchange, `engine.tier`) may land while a
    # plan's carried work is still owed: it keeps it.
    counts_only = isinstance(outputs, DeviceCounts) and batch.runs_nothing and not (
        batch.swap_out or batch.reset_prefix)
    if isinstance(outputs, DeviceCounts):
      self.counts, outputs = outputs, None
    elif outputs is not None:
      self.counts = DeviceCounts.of(outputs)
    self.out = outputs
    self.running, self.waiting = list(sched.running), list(sched.waiting)
    self.swapped, self.groups = list(sched.swapped), dict(sched.groups)
    self.carry = sched.carry if counts_only else Batch()
    self.stats = collections.Counter()
    self.done: List[Group] = []       # finished requests (outputs built after commit)
    self.preemptions = self.swaps = 0
    self.spec_rows = self.spec_accepted = 0   # this step's drafting rows, accepted drafts

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
      insert_sorted(self.swapped, g)
    else:
      ch.set(g, status=GroupStatus.WAITING)
      for i, q in enumerate(self.get(g, "seqs")):
        ch.set(q, state=SeqState.FORKING if i else SeqState.WAITING, slot=-1, topk=None,
               num_computed=0, share_id=-1)
      insert_sorted(self.waiting, g)

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
    drafts = {c.seq: len(c.draft) for c in b.chunks if c.draft}
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
      if q in drafts:   # the first iteration's tokens before its last are accepted drafts
        accepted = int(out.emitted[slot]) - 1
        self.count_drafts(drafts[q], accepted)
        # Back off after a draft that gained nothing: no drafts for 2**misses tokens.
        misses = 0 if accepted > 0 else q.spec_misses + 1
        ch.set(q, spec_misses=misses, spec_retry_at=(
            q.num_generated + len(new) + 2 ** min(misses, 6) if misses else 0))
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

  def count_drafts(self, drafted: int, accepted: int) -> None:
    """Speculative decoding's counters: drafts proposed and accepted, in total and by
    draft position (Engine.metrics' spec_*)."""
    self.spec_rows += 1
    self.spec_accepted += accepted
    st = self.stats
    st["spec_draft_tokens"] += drafted
    st["spec_accepted_tokens"] += accepted
    for i in range(drafted):
      st[("spec_drafted", i)] += 1
      st[("spec_accepted", i)] += i < accepted

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
    if self.spec_rows:   # the engine-wide back-off: a running average of the gain
      steps = s.stats["steps"] + self.stats["steps"]
      ema, misses, retry = speculative.back_off(
          s.spec_gain_ema, s.spec_step_misses, self.spec_accepted / self.spec_rows, steps)
      self.ch.set(s, spec_gain_ema=ema, spec_step_misses=misses, spec_retry_step=retry)
      self.stats["spec_steps"] += 1
    self.ch.count(s.stats, self.stats)
