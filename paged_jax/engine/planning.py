"""Planning one step: `plan(scheduler) -> Batch`, which chunks run, who is admitted,
swapped in or preempted. It reads the scheduler's records and writes only the Batch it
returns (`Scheduler.update` applies it with the step's outputs), so a plan that is
dropped (an exception, Ctrl-C, a dispatch that never happened) changed nothing.

Policy (vLLM's, arXiv:2309.06180 sec. 4.5; the order is the scheduling policy's key,
`policy.py`: arrival for "fcfs"):
  * running groups are served first, in key order; decodes take 1 token of the
    per-step token budget, prefills take what is left (chunked prefill); with
    several decode steps per sync a sampling row also reserves the blocks of the
    step's decode loop (`block_needs.lookahead_need`, vLLM's lookahead slots), so
    the loop does not run out of blocks and idle;
  * when the blocks run out, the running groups of the largest key are preempted
    (all their sequences: "all or nothing") until the group being served fits, or
    that group itself when its key is the largest;
  * preempted groups are either recomputed (back to the waiting queue, their K/V
    dropped) or swapped (K/V copied to host, each block shared by the group's
    sequences once, and restored with that sharing; `preemption_mode`: "swap" always,
    "auto" only groups of several sequences, vLLM V0's default). A group caught
    mid-fork (samples not yet forked, beams with a fork or a selection pending) is
    recomputed: its device rows are not yet what its records say;
  * swapped groups come back (in key order) only in steps without preemption, and
    not in the plan right after a step that failed on device; a swap-in is weighed
    with its first step's exact need (its restored rows append, copy-on-write too);
  * waiting groups are admitted strictly in key order when slots, blocks for every
    sequence of the group (`group_need`: a recomputed group's samples too; plus the
    decode loop's when its chunk samples) and token budget are available; with prefix
    caching an admitted leader is attached to its longest cached prefix in the step
    that admits it (`Batch.attaches`), which also runs its first chunk (the step skips
    the chunk's hit tokens; a chunk inside the hit computes nothing), unless the
    recent lookups mostly hit and the skipped tokens would enlarge the step's shape:
    then it is attached alone and its first chunk, from its hit, runs in the next step
    (`_attach_ahead`).
Groups with several sequences re-enter by prefilling the prompt once on their leader
and forking it (`post_forks`) so the prompt blocks are shared again.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from paged_jax.engine import block_needs
from paged_jax.engine.sequence import Batch, Chunk, Group, SeqState, Sequence


# With prefix caching, a prompt admitted while the recent lookups hit at least this
# fraction of their tokens, and whose skipped tokens would enlarge the step's token
# bucket, is attached alone and prefilled from the next step (`_attach_ahead`). Planned
# from 0 in the attaching step, its chunk would size the step's bucket by tokens the step
# skips: on the demo's 5-shot rows (90% hits) the caching engine's steps ran the
# 1,024-token bucket for ~100 tokens computed. Otherwise the chunk runs in the attaching
# step, so a miss costs no step.
ATTACH_AHEAD_HIT_FRACTION = 0.5


def carried(sched) -> Batch:
  """A plan that starts from what the last update carried over (a copy: the scheduler's
  own `carry` is left for `update` to replace)."""
  c = sched.carry
  return Batch(frees=list(c.frees), forks=list(c.forks), swap_out=dict(c.swap_out))


def lookup_len(group: Group) -> int:
  """Prompt tokens a newly admitted leader looks up in the prefix cache (only the
  prompt while children wait to fork at its end). A request scoring its prompt
  (`prompt_logprobs`) looks up one token, which never hits (a hit always leaves the
  last looked-up token to compute): its whole prompt is computed, so every position gets
  its log-probability; its blocks are still registered."""
  if group.prompt_scores is not None:
    return 1
  lead = group.leader
  waits = any(q.state is SeqState.FORKING for q in group.seqs[1:])
  return lead.prompt_len if waits else len(lead.tokens)


def swappable(group: Group, batch: Batch, mode: str) -> bool:
  """Whether a preempted group swaps: `mode` says so, and every sequence's row holds
  exactly its computed tokens (none pending a fork or a beam selection)."""
  if mode == "recompute" or (mode == "auto" and len(group.seqs) == 1):
    return False
  forking = {c for _, c in batch.forks}
  return all(q.state is SeqState.RUNNING and q.num_computed > 0 and q.topk is None
             and q not in forking for q in group.seqs)


def preempt_into(batch: Batch, group: Group, mode: str) -> None:
  """Plans the preemption of running `group` in `batch`: its rows are freed by the
  step, after a copy to host memory when it swaps."""
  if swappable(group, batch, mode):
    batch.swap_out[group] = [q.slot for q in group.seqs]
  batch.forks = [(p, c) for p, c in batch.forks if c not in group.seqs]
  batch.frees.extend(q.slot for q in group.seqs if q.state is SeqState.RUNNING)
  batch.preempted.append(group)


@dataclasses.dataclass
class _Plan:
  """One plan in progress: the scheduler (read only) and what the plan has decided."""
  sched: object
  batch: Batch
  budget: int           # tokens left this step
  free: int             # blocks the step's reservations may still take
  swap_room: int        # blocks swap-ins may still take (they copy in before the frees)
  sole: object          # i32[max_seqs] blocks only that slot holds, or None
  taken: set            # slots held, freed this step, or given out by this plan

  # ---- chunks and their blocks ---------------------------------------------------------
  def chunks_for(self, group: Group, resident: bool = False) -> List[Chunk]:
    """This step's chunks for a group (its leader capped at the prompt while samples
    wait to fork from it). resident: plan them as if the group's rows were on device
    (a swap-in being weighed: restored rows append, with copy-on-write)."""
    forked = {c for _, c in self.batch.forks}   # beams forked before the reservations
    waits = lambda q: q.state is SeqState.FORKING and q not in forked
    capped = len(group.seqs) > 1 and any(waits(q) for q in group.seqs)
    chunks, budget = [], self.budget
    for seq in group.seqs:
      if waits(seq) or seq.topk is not None or budget <= 0:
        continue
      end = len(seq.tokens)
      if capped and seq is group.leader:
        end = min(end, seq.prompt_len)
      todo = end - seq.num_computed
      if todo <= 0:
        continue
      n = min(todo, budget)
      budget -= n
      on_device = seq.state is SeqState.RUNNING or resident or seq in forked
      draft = self.draft(group, seq, budget) if todo == 1 and on_device else ()
      budget -= len(draft)
      chunks.append(Chunk(seq, n, samples=seq.num_computed + n == len(seq.tokens),
                          allocate=not on_device, start=seq.num_computed,
                          slot=self.batch.slot(seq), draft=draft))
    return chunks

  def draft(self, group: Group, seq: Sequence, budget: int) -> tuple:
    """Speculative decoding's draft for a decoding sequence (`may_draft`): prompt lookup
    (`speculative.propose_ngram`, or the config's proposer), or the draft model's tokens
    for it (`draft_model.DraftModel.prepare` ran before this plan), cut to the budget
    left and to what the request may still generate."""
    k = min(may_draft(self.sched, group, seq), budget)
    if k <= 0:
      return ()
    spec = self.sched.speculative
    if spec.method == "draft_model":
      return self.sched.drafter.for_seq(seq, k)
    return spec.propose(seq.tokens, k)

  def need(self, group: Group, chunks: List[Chunk]) -> int:
    """Blocks the group's chunks take this step, its decode loop's included."""
    s = self.sched
    return s.chunks_need(group, chunks) + block_needs.lookahead_need(
        group, chunks, s.block_size, s.lookahead)

  def take(self, group: Group, chunks: List[Chunk]) -> None:
    """Adds the group's chunks (and its samples' forks once the leader's prompt is in)."""
    b = self.batch
    b.chunks.extend(chunks)
    self.budget -= sum(c.num_scheduled for c in chunks)
    lead = [c for c in chunks if c.seq is group.leader]
    if len(group.seqs) > 1 and lead and lead[0].end == group.leader.prompt_len:
      forked = {c for _, c in b.forks}
      b.post_forks.extend((group.leader, q) for q in group.seqs
                          if q.state is SeqState.FORKING and q not in forked)

  def sole_of(self, slots) -> int:
    """Blocks that freeing `slots` returns for certain: the device-reported count of
    blocks each slot alone references (a lower bound when freed slots share blocks)."""
    return 0 if self.sole is None else int(sum(int(self.sole[s]) for s in slots))

  def give_slots(self, group: Group) -> None:
    """The group's sequences get the lowest slots no one holds."""
    s = self.sched
    slots = [i for i in range(s.max_seqs) if i not in self.taken][:group.slots_needed]
    self.taken.update(slots)
    self.batch.group_slots[group] = slots
    self.batch.slot_of.update(zip(group.seqs, slots))

  def slots_left(self) -> int:
    return self.sched.max_seqs - len(self.taken)

  # ---- the three queues ----------------------------------------------------------------
  def serve_running(self) -> None:
    """Running groups in key order; when one does not fit, the groups of the largest
    keys are preempted, one at a time, until it does (vLLM's rule; their slots' sole
    blocks come back in this step); with nothing after it, the group itself is."""
    s, b = self.sched, self.batch
    queue = sorted(s.running, key=lambda g: g.sort_key)
    i = 0
    while i < len(queue):
      group = queue[i]
      chunks = self.chunks_for(group)
      need = self.need(group, chunks)
      if need > self.free and any(c.draft for c in chunks):   # drafts never preempt
        chunks = [dataclasses.replace(c, draft=()) for c in chunks]
        need = self.need(group, chunks)
      while need > self.free and self.sole is not None and len(queue) > i + 1:
        victim = queue.pop()
        self.free += self.sole_of(q.slot for q in victim.seqs if q.state is SeqState.RUNNING)
        preempt_into(b, victim, s.preemption_mode)
      if need > self.free:
        if self.sole is not None or not b.frees:
          preempt_into(b, queue[-1], s.preemption_mode)
        return
      self.take(group, chunks)
      self.free -= need
      i += 1

  def swap_in(self) -> None:
    """Swapped groups in key order, while their copy and first step fit."""
    s, b = self.sched, self.batch
    for group in s.swapped:
      if self.budget <= 0:
        return
      if group.swapped_kv is None:
        # Preempted after a failed step (`update`): the engine copies it out after this
        # plan, before the step frees its slots. It returns from the next plan.
        return
      need = group.swapped_kv.num_blocks   # its distinct blocks, copied once
      # As once swapped in: rows restored with their sharing, so two samples writing
      # into their shared last block take a copy-on-write block (planned as fresh
      # allocations those copies went uncounted, and the step ran out on device).
      step_need = self.need(group, self.chunks_for(group, resident=True))
      if (self.slots_left() < group.slots_needed or need + step_need > self.free
          or need > self.swap_room):
        return
      self.give_slots(group)
      b.swapped_in.append(group)
      self.free -= need + step_need
      self.swap_room -= need
      self.take(group, self.chunks_for(group, resident=True))

  def admit_waiting(self) -> None:
    """Waiting groups in key order, strictly: the head that does not fit stops it."""
    s, b = self.sched, self.batch
    lookups = s.lookup_budget
    for group in s.waiting:
      if self.budget <= 0 or self.slots_left() < group.slots_needed:
        return
      self.give_slots(group)   # taken back below if the group does not fit
      # Admitted only when the whole group fits, and its blocks are held against
      # later admissions in this step though its prefill spans steps (vLLM allocates
      # a prompt's blocks at admission). Counting the leader alone let a preempted
      # n = 4 group back in on its prompt's blocks; its samples' recompute then
      # preempted newer groups, which came back the same way (529 preemptions for
      # 45 requests in the Fig. 14 run at 8 req/s). A chunk that samples also
      # holds its decode loop's blocks, as running groups do.
      chunks = self.chunks_for(group)
      if s.prefix_caching and self.attach_ahead(group, chunks):
        chunks = []
      need = s.group_need(group) + block_needs.lookahead_need(
          group, chunks, s.block_size, s.lookahead)
      n = lookup_len(group) if s.prefix_caching else 0
      if need > self.free or n > lookups:
        self.taken.difference_update(b.group_slots.pop(group))
        for q in group.seqs:
          del b.slot_of[q]
        return
      if s.prefix_caching:
        # Attach and prefill in the same step: the chunk is planned from 0 and the step
        # skips its hit tokens (`prefix_cache.step.skip_hits`), so a miss costs no step.
        # A chunk cut short by the budget may lie wholly inside the hit: it then
        # computes nothing, and the sequence resumes after the hit. Attached ahead
        # (no chunk), it runs from the hit the step reports, in the next step.
        lookups -= n
        b.attaches.append(group.leader)
        b.attach_lens.append(n)
      b.admitted.append(group)
      self.take(group, chunks)
      self.free -= need

  def attach_ahead(self, group: Group, chunks: List[Chunk]) -> bool:
    """Attach `group`'s leader alone this step: lookups mostly hit (`prefix_hit_ema`),
    and the tokens its chunk would skip (the hit the recent fraction predicts, whole
    blocks) would put the step on a larger token bucket. On one shape for every mixed
    step (unbucketed) they cost nothing, and attaching ahead would only delay the
    prompt by a step."""
    s = self.sched
    if not (chunks and s.attach_ahead):
      return False
    n, bs = chunks[0].num_tokens, s.block_size
    skipped = min(int(s.prefix_hit_ema * lookup_len(group)) // bs * bs, n - 1)
    used = s.max_num_batched_tokens - self.budget
    bucket = s.token_bucket or (lambda t: t)
    return bucket(used + n) > bucket(used + n - skipped)


def plan(sched, num_free_blocks: Optional[int] = None, sole_blocks=None) -> Batch:
  """Plans one step from the device's counts of the last step (default `sched.counts`).

  num_free_blocks: blocks the next reservation may take (free + evictable).
  sole_blocks: i32[max_seqs] or None, blocks referenced by that slot alone
    (`StepOutputs.sole_blocks`). The step frees before it reserves, so these
    blocks of the slots freed in this step count for its reservations; None
    counts none (every shortage then preempts one group and waits a step).
  """
  if num_free_blocks is None:
    num_free_blocks, sole_blocks = sched.counts.available, sched.counts.sole_blocks
  batch = carried(sched)
  taken = sched.busy_slots()
  p = _Plan(sched, batch, sched.max_num_batched_tokens, num_free_blocks, num_free_blocks,
            sole_blocks, taken)
  p.free += p.sole_of(batch.frees)
  p.serve_running()
  # Swapped groups come back only when nothing was preempted, nor right after a failed
  # step (its victim was preempted outside any plan): that plan serves the running
  # groups alone, so whatever the planning missed, the retry fits.
  if not (batch.preempted or sched.after_failed_step):
    p.swap_in()
    p.admit_waiting()
  return batch


def may_draft(sched, group: Group, seq: Sequence) -> int:
  """Drafts `seq` may take in the next step before the token budget (0: none): k cut to
  what the request may still generate (the step emits one token past the accepted
  drafts). 0 for beams, requests that report logprobs, a sequence that is not decoding
  on device, one backing off (`Sequence.spec_retry_at`), or every sequence while the
  engine does (`Scheduler.spec_retry_step`)."""
  spec, sp = sched.speculative, group.params
  if (spec is None or group.is_beam or sp.logprobs or group.prompt_scores is not None
      or seq.num_generated < seq.spec_retry_at   # this sequence backs off after misses
      or sched.stats["steps"] < sched.spec_retry_step):   # ... or the engine does
    return 0
  return max(0, min(spec.num_speculative_tokens, sp.max_tokens - seq.num_generated - 1))
