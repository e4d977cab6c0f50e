"""Host-side scheduler: waiting / running / swapped queues, FCFS, preemption.

The scheduler decides WHAT runs in a step; the jitted step (`step.py`) does the
block allocation on device. It plans from the count the previous step returned
(free + evictable blocks) and each chunk's exact block need (new blocks plus
the copy-on-write copies of a shared last block: every writer copies but the
last remaining holder). The step frees before it reserves, and the
device also reports, per slot, the blocks that slot alone references: those of
the slots freed in a step count for that step's reservations. When a running
group does not fit, the newest groups are preempted until it does, and the
step goes on with everyone older (vLLM's rule). Should a reservation still fail
on device (a status, never a spin), the engine preempts the newest group and
re-plans.

The records it plans with (Sequence, Group, Chunk, Batch) are in `sequence.py`; the
block counts it plans by are in `block_needs.py`.

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
  * swapped groups come back (oldest first) only in steps without preemption;
  * waiting groups are admitted strictly FCFS when slots, blocks for every sequence
    of the group (`group_need`: a recomputed group's samples too; plus the decode
    loop's when its chunk samples) and token budget are available; with prefix
    caching an admitted leader is first attached to its longest cached prefix (in
    the step, `Batch.attaches`) and prefills the rest from the next step on.
Groups with several sequences re-enter by prefilling the prompt once on their
leader and forking it (`post_forks`) so the prompt blocks are shared again.
"""

from __future__ import annotations

import bisect
from typing import List, Tuple

from paged_jax.engine import block_needs
from paged_jax.engine.sequence import Batch, Chunk, Group, GroupStatus, Sequence

# recompute: drop K/V, prefill again; swap: copy K/V to host and back; auto: swap
# groups of several sequences, recompute single ones (vLLM V0's default rule).
PREEMPTION_MODES = ("recompute", "swap", "auto")


class Scheduler:
  """FCFS continuous batching with chunked prefill and preemption (host Python)."""

  def __init__(self, *, block_size: int, max_seqs: int, max_num_batched_tokens: int,
               preemption_mode: str = "recompute", prefix_caching: bool = False,
               lookup_budget: int = 0, lookahead: int = 0):
    if preemption_mode not in PREEMPTION_MODES:
      raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                       f"got {preemption_mode!r}")
    self.block_size = block_size
    self.max_num_batched_tokens = max_num_batched_tokens
    self.preemption_mode = preemption_mode
    self.prefix_caching = prefix_caching
    self.lookup_budget = lookup_budget          # prompt tokens looked up per step
    self.lookahead = lookahead                  # decode-loop tokens after a sample
    self.waiting: List[Group] = []
    self.running: List[Group] = []
    self.swapped: List[Group] = []
    self.free_slots: List[int] = list(range(max_seqs))
    self.pending_frees: List[int] = []          # device frees not yet committed
    self.pending_forks: List[Tuple[Sequence, Sequence]] = []   # (parent, child) beam forks
    self.released_slots: List[int] = []        # back to the pool once frees commit
    # (group, its sequences' slots): preempted by swap, K/V not yet copied to host
    self.pending_swap_outs: List[Tuple[Group, List[int]]] = []
    self.num_preemptions = 0
    self.num_swaps = 0

  # ---- queue management --------------------------------------------------------------
  def add(self, group: Group) -> None:
    group.status = GroupStatus.WAITING
    self._insert_by_arrival(self.waiting, group)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self.swapped)

  @staticmethod
  def _insert_by_arrival(queue: List[Group], group: Group) -> None:
    keys = [g.arrival for g in queue]
    queue.insert(bisect.bisect(keys, group.arrival), group)

  def free_seq(self, seq: Sequence) -> None:
    """Queues the device free of a finished / dropped sequence's slot."""
    if seq.on_device:
      self.pending_frees.append(seq.slot)
      seq.on_device = False

  def finish_group(self, group: Group) -> None:
    """Frees every live sequence and returns the group's slots."""
    for seq in group.seqs:
      self.free_seq(seq)
    self.pending_forks = [(p, c) for p, c in self.pending_forks if c not in group.seqs]
    self._release_slots(group)
    group.status = GroupStatus.FINISHED
    if group in self.running:
      self.running.remove(group)

  def _release_slots(self, group: Group) -> None:
    self.released_slots.extend(group.slots)
    group.slots = []
    for seq in group.seqs:
      seq.slot = -1

  # ---- block needs (block_needs.py, at this scheduler's block size and lookahead) ----
  def group_need(self, group: Group) -> int:
    return block_needs.group_need(group, self.block_size)

  def chunks_need(self, group: Group, chunks: List[Chunk]) -> int:
    return block_needs.chunks_need(group, chunks, self.block_size)

  def lookahead_need(self, group: Group, chunks: List[Chunk]) -> int:
    return block_needs.lookahead_need(group, chunks, self.block_size, self.lookahead)

  # ---- preemption -----------------------------------------------------------------------
  def preempt(self, group: Group, batch: Batch) -> None:
    """Preempts a running group (its slots are freed at the start of the next step)."""
    self.running.remove(group)
    swap = self._swappable(group)
    self.pending_forks = [(p, c) for p, c in self.pending_forks if c not in group.seqs]
    group.num_preemptions += 1
    self.num_preemptions += 1
    batch.preempted.append(group)
    if swap:   # the engine copies the slots out before this step frees them
      batch.swap_out.append(group)
      self.pending_swap_outs.append((group, [q.slot for q in group.seqs]))
    for seq in group.seqs:
      seq.topk = None
      if seq.on_device:
        self.pending_frees.append(seq.slot)
        seq.on_device = False
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

  def _swappable(self, group: Group) -> bool:
    """Whether a preempted group swaps: the mode says so, and every sequence's slot
    holds exactly its computed tokens (none pending a fork or a beam selection)."""
    if self.preemption_mode == "recompute" or (
        self.preemption_mode == "auto" and len(group.seqs) == 1):
      return False
    forking = {id(c) for _, c in self.pending_forks}
    return all(q.on_device and q.num_computed > 0 and not q.pending_fork and q.topk is None
               and id(q) not in forking for q in group.seqs)

  def preempt_newest(self) -> Group:
    """After a device OUT_OF_BLOCKS: preempts the newest running group (next plan re-plans)."""
    if not self.running:
      raise RuntimeError("OUT_OF_BLOCKS with no running group to preempt")
    victim = max(self.running, key=lambda g: g.arrival)
    self.preempt(victim, Batch())
    return victim

  # ---- planning -----------------------------------------------------------------------
  def _chunks_for(self, group: Group, budget: int) -> List[Chunk]:
    """This step's chunks for a group (leader capped at the prompt while forks pend)."""
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
      forked = bool(self.pending_forks) and any(c is seq for _, c in self.pending_forks)
      chunks.append(Chunk(seq, n, samples=seq.num_computed + n == len(seq.tokens),
                          allocate=not seq.on_device and not forked))
    return chunks

  def _post_forks(self, group: Group, chunks: List[Chunk]) -> List[Tuple[Sequence, Sequence]]:
    if len(group.seqs) == 1:
      return []
    lead = [c for c in chunks if c.seq is group.leader]
    if not lead or lead[0].seq.num_computed + lead[0].num_tokens != group.leader.prompt_len:
      return []
    return [(group.leader, s) for s in group.seqs if s.pending_fork]

  def _take(self, group: Group, batch: Batch, budget: int, chunks=None) -> int:
    """Adds the group's chunks and post-forks to the batch; returns tokens used."""
    if chunks is None:
      chunks = self._chunks_for(group, budget)
    batch.chunks.extend(chunks)
    batch.post_forks.extend(self._post_forks(group, chunks))
    return sum(c.num_tokens for c in chunks)

  def _admit(self, queue: List[Group], group: Group) -> None:
    """Moves `group`, the head of `queue` (waiting or swapped), to running on fresh slots."""
    queue.pop(0)
    self._assign_slots(group)
    group.status = GroupStatus.RUNNING
    self.running.append(group)

  def _assign_slots(self, group: Group) -> None:
    group.slots = [self.free_slots.pop(0) for _ in range(group.slots_needed)]
    for seq, slot in zip(group.seqs, group.slots):
      seq.slot = slot

  @staticmethod
  def _sole(slots, sole_blocks) -> int:
    """Blocks that freeing `slots` returns for certain: the device-reported count of
    blocks each slot alone references (a lower bound when freed slots share blocks)."""
    if sole_blocks is None:
      return 0
    return int(sum(int(sole_blocks[s]) for s in slots))

  def schedule(self, num_free_blocks: int, sole_blocks=None) -> Batch:
    """Plans one step given the device's counts from the last step.

    num_free_blocks: blocks the next reservation may take (free + evictable).
    sole_blocks: i32[max_seqs] or None, blocks referenced by that slot alone
      (`StepOutputs.sole_blocks`). The step frees before it reserves, so these
      blocks of the slots freed in this step count for its reservations; None
      counts none (every shortage then preempts one group and waits a step).
    """
    batch = Batch()
    budget = self.max_num_batched_tokens
    free = num_free_blocks + self._sole(self.pending_frees, sole_blocks)
    # Swap-ins copy in before the step (and its frees): they fit the device's count.
    swap_room = num_free_blocks
    # 1. Running groups, oldest first. When one does not fit, the newest groups are
    # preempted, one at a time, until it does (vLLM's rule; their slots' sole blocks
    # come back in this step); with nothing newer left, the group itself is.
    queue = sorted(self.running, key=lambda g: g.arrival)
    i = 0
    while i < len(queue):
      group = queue[i]
      chunks = self._chunks_for(group, budget)
      need = self.chunks_need(group, chunks) + self.lookahead_need(group, chunks)
      while need > free and sole_blocks is not None and len(queue) > i + 1:
        victim = queue.pop()
        free += self._sole([q.slot for q in victim.seqs if q.on_device], sole_blocks)
        self.preempt(victim, batch)
      if need > free:
        if sole_blocks is not None or not self.pending_frees:
          self.preempt(queue[-1], batch)
        break
      budget -= self._take(group, batch, budget, chunks)
      free -= need
      i += 1
    # Beam forks decided after the last step run first (they take no block).
    batch.forks = list(self.pending_forks)
    # 2. Swapped groups come back only when nothing was preempted.
    if not batch.preempted:
      while self.swapped and budget > 0:
        group = self.swapped[0]
        if group.leader.swapped_kv is None:
          # Preempted after a failed step (`preempt_newest`): the engine copies it out
          # after this plan, before the step frees its slots. It returns from the next.
          break
        need = group.leader.swapped_kv.num_blocks   # its distinct blocks, copied once
        plan = self._chunks_for(group, budget)   # as _take will cut them once swapped in
        step_need = self.chunks_need(group, plan) + self.lookahead_need(group, plan)
        if (len(self.free_slots) < group.slots_needed or need + step_need > free
            or need > swap_room):
          break
        self._admit(self.swapped, group)
        batch.swap_in.append(group)
        for seq in group.seqs:
          seq.on_device = True   # the engine swaps in before the step, as planned here
        free -= need
        swap_room -= need
        used = self._take(group, batch, budget)
        free -= step_need
        budget -= used
    # 3. Waiting groups, strict FCFS.
    lookups = self.lookup_budget
    if not batch.preempted:
      while self.waiting and budget > 0:
        group = self.waiting[0]
        if len(self.free_slots) < group.slots_needed:
          break
        # Admitted only when the whole group fits, and its blocks are held against
        # later admissions in this step though its prefill spans steps (vLLM allocates
        # a prompt's blocks at admission). Counting the leader alone let a preempted
        # n = 4 group back in on its prompt's blocks; its samples' recompute then
        # preempted newer groups, which came back the same way (529 preemptions for
        # 45 requests in the Fig. 14 run at 8 req/s). A chunk that samples also
        # holds its decode loop's blocks, as running groups do in step 1.
        chunks = [] if self.prefix_caching else self._chunks_for(group, budget)
        need = self.group_need(group) + self.lookahead_need(group, chunks)
        if need > free:
          break
        if self.prefix_caching:
          # Attach only: the hit is known after this step; the rest prefills next.
          n = self.lookup_len(group)
          if n > lookups:
            break
          lookups -= n
          # Paced like an admission that prefills: a prompt admitted later hits
          # what earlier ones registered, instead of all missing at once.
          budget -= min(n, budget)
          batch.attaches.append(group.leader)
        else:
          budget -= self._take(group, batch, budget, chunks)
        self._admit(self.waiting, group)
        free -= need
    batch.frees = list(self.pending_frees)
    return batch

  @staticmethod
  def lookup_len(group: Group) -> int:
    """Prompt tokens a newly admitted leader looks up in the prefix cache (only the
    prompt while children wait to fork at its end)."""
    lead = group.leader
    return lead.prompt_len if any(q.pending_fork for q in group.seqs) else len(lead.tokens)

  def commit(self, batch: Batch, ok: bool = True, hit_tokens=None) -> None:
    """Records a dispatched batch's device effects. Frees, forks and prefix
    attaches always happen; chunks and post-forks only when `ok` (the step's
    reservations succeeded). `hit_tokens[slot]`: cached tokens attached."""
    for seq in batch.attaches:
      seq.on_device = True
      seq.num_computed = int(hit_tokens[seq.slot])
    self.pending_frees = []
    self.pending_forks = []
    self.free_slots.extend(self.released_slots)
    self.free_slots.sort()
    self.released_slots = []
    for _, child in batch.forks:
      child.on_device = True
    if not ok:
      return
    for chunk in batch.chunks:
      chunk.seq.on_device = True
      chunk.seq.last_block_shared = False
    for leader, child in batch.post_forks:
      child.on_device = True
      child.pending_fork = False
      child.num_computed = leader.prompt_len
      shared = leader.prompt_len % self.block_size != 0
      child.last_block_shared = shared
      leader.last_block_shared = shared
      child.share_id = leader.share_id = leader.seq_id

