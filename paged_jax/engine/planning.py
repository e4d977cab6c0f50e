"""Planning one step (`Scheduler.schedule() -> Batch`): which chunks run, who is
admitted, swapped in or preempted. `Planner` holds the policy and is mixed into
`scheduler.Scheduler`, whose state it reads and changes.

Policy (vLLM's, arXiv:2309.06180 sec. 4.5):
  * running groups are served first, oldest first; decodes take 1 token of the
    per-step token budget, prefills take what is left (chunked prefill); with
    several decode steps per sync a sampling row also reserves the blocks of the
    step's decode loop (`lookahead_need`, vLLM's lookahead slots), so the loop
    does not run out of blocks and idle;
  * when the blocks run out, the newest running groups are preempted (all their
    sequences: "all or nothing") until the group being served fits, or that
    group itself when it is the newest;
  * preempted groups are either recomputed (back to the waiting queue, their
    K/V dropped) or swapped (K/V copied to host, each block shared by the group's
    sequences once, and restored with that sharing; `preemption_mode`: "swap"
    always, "auto" only groups of several sequences, vLLM V0's default). A group
    caught mid-fork (samples not yet forked, beams with a fork or a selection
    pending) is recomputed: its device rows are not yet what its records say;
  * swapped groups come back (oldest first) only in steps without preemption, and
    not in the plan right after a step that failed on device; a swap-in is weighed
    with its first step's exact need (its restored rows append, copy-on-write too);
  * waiting groups are admitted strictly FCFS when slots, blocks for every sequence
    of the group (`group_need`: a recomputed group's samples too; plus the decode
    loop's when its chunk samples) and token budget are available; with prefix
    caching an admitted leader is attached to its longest cached prefix in the step
    that admits it (`Batch.attaches`), which also runs its first chunk (the step
    skips the chunk's hit tokens; a chunk inside the hit computes nothing), unless
    the recent lookups mostly hit and the skipped tokens would enlarge the step's
    shape: then it is attached alone and its first chunk, from its hit, runs in the
    next step (`_attach_ahead`).
Groups with several sequences re-enter by prefilling the prompt once on their
leader and forking it (`post_forks`) so the prompt blocks are shared again.
"""

from __future__ import annotations

from typing import List, Optional

from paged_jax.engine.sequence import Batch, Chunk, Group, GroupStatus


# With prefix caching, a prompt admitted while the recent lookups hit at least this
# fraction of their tokens, and whose skipped tokens would enlarge the step's token
# bucket, is attached alone and prefilled from the next step (`_attach_ahead`). Planned
# from 0 in the attaching step, its chunk would size the step's bucket by tokens the step
# skips: on the demo's 5-shot rows (90% hits) the caching engine's steps ran the
# 1,024-token bucket for ~100 tokens computed. Otherwise the chunk runs in the attaching
# step, so a miss costs no step.
ATTACH_AHEAD_HIT_FRACTION = 0.5


class Planner:
  """The planning half of `Scheduler` (its queues, slots and counts are the state)."""

  def _chunks_for(self, group: Group, budget: int, forks=(),
                  resident: bool = False) -> List[Chunk]:
    """This step's chunks for a group (leader capped at the prompt while forks pend).
    resident: plan them as if the group's rows were on device already (a swap-in
    being weighed: restored rows append, with copy-on-write of a shared last block)."""
    chunks = []
    pending = len(group.seqs) > 1 and any(s.pending_fork for s in group.seqs)
    for seq in group.seqs:
      if seq.pending_fork or seq.topk is not None or budget <= 0:
        continue
      end = len(seq.tokens)
      if pending and seq is group.leader:
        end = min(end, seq.prompt_len)
      todo = end - seq.num_computed
      if todo <= 0:
        continue
      n = min(todo, budget)
      budget -= n
      forked = any(c is seq for _, c in forks)
      chunks.append(Chunk(seq, n, samples=seq.num_computed + n == len(seq.tokens),
                          allocate=not (seq.on_device or resident) and not forked))
    return chunks

  def _take(self, group: Group, batch: Batch, chunks: List[Chunk]) -> int:
    """Adds the group's chunks and post-forks to the batch; returns tokens used."""
    batch.chunks.extend(chunks)
    lead = [c for c in chunks if c.seq is group.leader]
    if len(group.seqs) > 1 and lead and (
        lead[0].seq.num_computed + lead[0].num_tokens == group.leader.prompt_len):
      batch.post_forks.extend((group.leader, s) for s in group.seqs if s.pending_fork)
    return sum(c.num_tokens for c in chunks)

  def _admit(self, queue: List[Group], group: Group, batch: Batch) -> None:
    """Moves `group`, the head of `queue` (waiting or swapped), to running on free slots."""
    queue.pop(0)
    group.slots = self._slots_free(batch.frees)[:group.slots_needed]
    for seq, slot in zip(group.seqs, group.slots):
      seq.slot = slot
    group.status = GroupStatus.RUNNING
    self.running.append(group)

  @staticmethod
  def _sole(slots, sole_blocks) -> int:
    """Blocks that freeing `slots` returns for certain: the device-reported count of
    blocks each slot alone references (a lower bound when freed slots share blocks)."""
    if sole_blocks is None:
      return 0
    return int(sum(int(sole_blocks[s]) for s in slots))

  def schedule(self, num_free_blocks: Optional[int] = None, sole_blocks=None) -> Batch:
    """Plans one step from the device's counts of the last step (default `self.counts`).

    num_free_blocks: blocks the next reservation may take (free + evictable).
    sole_blocks: i32[max_seqs] or None, blocks referenced by that slot alone
      (`StepOutputs.sole_blocks`). The step frees before it reserves, so these
      blocks of the slots freed in this step count for its reservations; None
      counts none (every shortage then preempts one group and waits a step).
    """
    if num_free_blocks is None:
      num_free_blocks, sole_blocks = self.counts.available, self.counts.sole_blocks
    batch, self.carry = self.carry, Batch()
    budget = self.max_num_batched_tokens
    free = num_free_blocks + self._sole(batch.frees, sole_blocks)
    # Swap-ins copy in before the step (and its frees): they fit the device's count.
    swap_room = num_free_blocks
    # 1. Running groups, oldest first. When one does not fit, the newest groups are
    # preempted, one at a time, until it does (vLLM's rule; their slots' sole blocks
    # come back in this step); with nothing newer left, the group itself is.
    queue = sorted(self.running, key=lambda g: g.arrival)
    i = 0
    while i < len(queue):
      group = queue[i]
      chunks = self._chunks_for(group, budget, batch.forks)
      need = self.chunks_need(group, chunks) + self.lookahead_need(group, chunks)
      while need > free and sole_blocks is not None and len(queue) > i + 1:
        victim = queue.pop()
        free += self._sole([q.slot for q in victim.seqs if q.on_device], sole_blocks)
        self.preempt(victim, batch)
      if need > free:
        if sole_blocks is not None or not batch.frees:
          self.preempt(queue[-1], batch)
        break
      budget -= self._take(group, batch, chunks)
      free -= need
      i += 1
    # 2. Swapped groups come back only when nothing was preempted, nor right after a
    # failed step (its victim was preempted outside any plan): that plan serves the
    # running groups alone, so whatever the planning missed, the retry fits.
    hold, self.after_failed_step = bool(batch.preempted) or self.after_failed_step, False
    if not hold:
      while self.swapped and budget > 0:
        group = self.swapped[0]
        if group.leader.swapped_kv is None:
          # Preempted after a failed step (`preempt_newest`): the engine copies it out
          # after this plan, before the step frees its slots. It returns from the next.
          break
        need = group.leader.swapped_kv.num_blocks   # its distinct blocks, copied once
        # As once swapped in: rows restored with their sharing, so two samples writing
        # into their shared last block take a copy-on-write block (planned as fresh
        # allocations those copies went uncounted, and the step ran out on device).
        plan = self._chunks_for(group, budget, batch.forks, resident=True)
        step_need = self.chunks_need(group, plan) + self.lookahead_need(group, plan)
        if (len(self._slots_free(batch.frees)) < group.slots_needed
            or need + step_need > free or need > swap_room):
          break
        self._admit(self.swapped, group, batch)
        batch.swap_in.append(group)
        for seq in group.seqs:
          seq.on_device = True   # the engine swaps in before the step, as planned here
        free -= need + step_need
        swap_room -= need
        budget -= self._take(group, batch, self._chunks_for(group, budget, batch.forks))
    # 3. Waiting groups, strict FCFS.
    if not hold:
      self._admit_waiting(batch, budget, free)
    return batch

  def _admit_waiting(self, batch: Batch, budget: int, free: int) -> None:
    lookups = self.lookup_budget
    while self.waiting and budget > 0:
      group = self.waiting[0]
      if len(self._slots_free(batch.frees)) < group.slots_needed:
        break
      # Admitted only when the whole group fits, and its blocks are held against
      # later admissions in this step though its prefill spans steps (vLLM allocates
      # a prompt's blocks at admission). Counting the leader alone let a preempted
      # n = 4 group back in on its prompt's blocks; its samples' recompute then
      # preempted newer groups, which came back the same way (529 preemptions for
      # 45 requests in the Fig. 14 run at 8 req/s). A chunk that samples also
      # holds its decode loop's blocks, as running groups do in step 1.
      chunks = self._chunks_for(group, budget, batch.forks)
      ahead = self.prefix_caching and self._attach_ahead(group, chunks, budget)
      if ahead:
        chunks = []
      need = self.group_need(group) + self.lookahead_need(group, chunks)
      if need > free:
        break
      if self.prefix_caching:
        # Not ahead (`_attach_ahead`): attach and prefill in the same step. The chunk
        # is planned from 0 and the step skips its hit tokens (`prefix_cache.step.
        # skip_hits`), so a miss costs no step. A chunk cut short by the budget may lie
        # wholly inside the hit: it then computes nothing, and the sequence resumes
        # after the hit. Mostly hit, on a bucket the skip would enlarge: attach alone
        # (`ahead`), so the step's shape is not sized for tokens it skips; the chunk,
        # planned from the hit the step reports, runs in the next step.
        n = self.lookup_len(group)
        if n > lookups:
          break
        lookups -= n
        batch.attaches.append(group.leader)
        batch.attach_lens.append(n)
      budget -= self._take(group, batch, chunks)
      self._admit(self.waiting, group, batch)
      free -= need

  @property
  def attach_ahead(self) -> bool:
    """Admitted prompts may be attached alone, a step before their first chunk: the
    recent lookups hit at least ATTACH_AHEAD_HIT_FRACTION of their tokens
    (`prefix_hit_ema`)."""
    return self.prefix_hit_ema >= ATTACH_AHEAD_HIT_FRACTION

  def _attach_ahead(self, group: Group, chunks: List[Chunk], budget: int) -> bool:
    """Attach `group`'s leader alone this step: lookups mostly hit, and the tokens its
    chunk would skip (the hit the recent fraction predicts, whole blocks) would put the
    step on a larger token bucket. On one shape for every mixed step (unbucketed) they
    cost nothing, and attaching ahead would only delay the prompt by a step."""
    if not (chunks and self.attach_ahead):
      return False
    n = chunks[0].num_tokens
    bs = self.block_size
    skipped = min(int(self.prefix_hit_ema * self.lookup_len(group)) // bs * bs, n - 1)
    used = self.max_num_batched_tokens - budget
    bucket = self.token_bucket or (lambda t: t)
    return bucket(used + n) > bucket(used + n - skipped)

  @staticmethod
  def lookup_len(group: Group) -> int:
    """Prompt tokens a newly admitted leader looks up in the prefix cache (only the
    prompt while children wait to fork at its end)."""
    lead = group.leader
    return lead.prompt_len if any(q.pending_fork for q in group.seqs) else len(lead.tokens)
