"""A step's outputs applied to the host's sequences: append sampled tokens,
finish on stop id / max_tokens, beam selection, and the `RequestOutput`s.

Runs only once the step's outputs are on the host (numpy). The engine snapshots
the scheduler first (`snapshot.Snapshot`) so an exception here undoes every
change and the same outputs can be applied again.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Dict, List

import numpy as np

from paged_jax.engine import beam as beam_lib
from paged_jax.engine.params import RequestOutput
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.sequence import Batch, Group, Sequence


def request_output(group: Group, seqs: List[Sequence]) -> RequestOutput:
  """The output of `group` from its (finished or, on abort, live) sequences."""
  return RequestOutput(
      request_id=group.request_id, prompt_token_ids=group.prompt,
      outputs=[q.tokens[q.prompt_len:] for q in seqs],
      finish_reasons=[q.finish_reason for q in seqs],
      cumulative_logprobs=[q.cum_logprob for q in seqs] if group.is_beam else None,
      num_preemptions=group.num_preemptions)


class ResultApplier:
  """Applies StepOutputs to the scheduler's groups (the engine owns one)."""

  def __init__(self, scheduler: Scheduler, groups: Dict[Any, Group], stats: collections.Counter,
               block_size: int):
    self.scheduler, self.groups, self.stats, self.block_size = (scheduler, groups, stats,
                                                                block_size)
    self.seq_ids = itertools.count(1 << 40)   # beam hypotheses made here

  def apply(self, batch: Batch, out) -> List[RequestOutput]:
    """Tokens of a successful step (`out` as numpy); returns finished requests."""
    finished: List[RequestOutput] = []
    owner = {id(q): g for g in self.scheduler.running for q in g.seqs}
    sampled = [ch.seq for ch in batch.chunks if ch.samples]
    for ch in batch.chunks:
      ch.seq.num_computed += ch.num_tokens
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
        if tok in group.params.stop_token_ids:
          self._finish_seq(group, seq, "stop", finished)
          break
        if seq.num_generated >= group.params.max_tokens:
          self._finish_seq(group, seq, "length", finished)
          break
    for group in beam_groups:
      if all(q.topk is not None for q in group.seqs):
        self._beam_step(group, finished)
    return finished

  def _finish_seq(self, group: Group, seq: Sequence, reason: str, finished: list) -> None:
    seq.finish_reason = reason
    group.seqs.remove(seq)
    group.finished.append(seq)
    self.scheduler.free_seq(seq)
    if not group.seqs:
      self.finish_group(group, finished)

  def finish_group(self, group: Group, finished: list) -> None:
    self.scheduler.finish_group(group)
    del self.groups[group.request_id]
    if group.is_beam:
      best = sorted(group.finished, key=lambda q: -q.cum_logprob)[:group.params.n]
    else:
      best = sorted(group.finished, key=lambda q: q.index)
    finished.append(request_output(group, best))

  def _beam_step(self, group: Group, finished: list) -> None:
    """Selects the next beams; forks parents chosen more than once, frees dropped ones."""
    sp, live = group.params, list(group.seqs)
    topv = np.stack([q.topk[0] for q in live])
    topi = np.stack([q.topk[1] for q in live])
    chosen, ended = beam_lib.select([q.cum_logprob for q in live], topv, topi,
                                    sp.beam_width, sp.stop_token_ids)
    for b, tok, score in ended:
      group.finished.append(Sequence(seq_id=next(self.seq_ids), index=0, sample_seed=0,
                                     tokens=live[b].tokens + [tok], prompt_len=live[b].prompt_len,
                                     cum_logprob=score, finish_reason="stop"))
    kids = collections.defaultdict(list)
    for b, tok, score in chosen:
      kids[b].append((tok, score))
    kept = {live[b].slot for b in kids}
    spare = [s for s in group.slots if s not in kept]
    new_live = []
    for b, parent in enumerate(live):
      parent.topk = None
      if not kids[b]:
        self.scheduler.free_seq(parent)
        continue
      base = list(parent.tokens)
      for i, (tok, score) in enumerate(kids[b]):
        if i == 0:
          target = parent
        else:
          target = Sequence(seq_id=next(self.seq_ids), index=0, sample_seed=0,
                            tokens=list(base), prompt_len=parent.prompt_len,
                            num_computed=parent.num_computed, slot=spare.pop(0))
          shared = parent.num_computed % self.block_size != 0
          # A parent still sharing its last block keeps that set's id: one block.
          sid = parent.share_id if parent.last_block_shared else parent.seq_id
          target.last_block_shared = parent.last_block_shared = shared
          target.share_id = parent.share_id = sid
          self.scheduler.pending_forks.append((parent, target))
        target.tokens.append(tok)
        target.cum_logprob = score
        new_live.append(target)
    group.seqs = new_live
    self.stats["generated_tokens"] += len(new_live)
    done = (new_live and new_live[0].num_generated >= sp.max_tokens) or (
        len(group.finished) >= sp.beam_width)
    if done or not new_live:
      for q in list(group.seqs):
        if q.num_generated >= sp.max_tokens:
          q.finish_reason = "length"
          group.finished.append(q)
      self.finish_group(group, finished)
