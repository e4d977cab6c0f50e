"""Beam search on the host: one selection per step per group (`select`), applied to the
group's records by `advance`, which `Scheduler.update` calls.

Spec (shared with the reference beam search in tests/engine_test.py):
  * every live beam offers its `2 * beam_width` most likely next tokens,
    scored by cumulative log-probability (no length penalty);
  * candidates are visited best first (ties: lower beam index, then better
    rank); a candidate ending in a stop id becomes a finished hypothesis, any
    other becomes a live beam, until `beam_width` live beams are chosen;
  * when the live beams reach `max_tokens` generated tokens they all finish;
    the search also ends once `beam_width` hypotheses have finished;
  * the result is the `n` best finished hypotheses by score.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, List, Sequence as Seq, Tuple

import numpy as np

from paged_jax.engine.sequence import Group, Sequence


def select(cum_logprobs: Seq[float], topk_logprobs: np.ndarray, topk_ids: np.ndarray,
           beam_width: int, stop_token_ids: Seq[int]):
  """One selection step.

  Args:
    cum_logprobs: [B] score of each live beam.
    topk_logprobs: f32[B, >= 2W] next-token log-probs, descending per row.
    topk_ids: i32[B, >= 2W] their token ids.
    beam_width: W.
    stop_token_ids: ids that finish a hypothesis.

  Returns:
    (live, finished): lists of (parent_beam, token, score); len(live) <= W.
  """
  width = 2 * beam_width
  cands: List[Tuple[float, int, int, int]] = []
  for b, cum in enumerate(cum_logprobs):
    for r in range(width):
      cands.append((float(cum) + float(topk_logprobs[b, r]), b, r, int(topk_ids[b, r])))
  cands.sort(key=lambda c: (-c[0], c[1], c[2]))
  stops = set(int(t) for t in stop_token_ids)
  live, finished = [], []
  for score, b, _, tok in cands:
    if tok in stops:
      finished.append((b, tok, score))
    else:
      live.append((b, tok, score))
      if len(live) == beam_width:
        break
  return live, finished


@dataclasses.dataclass
class BeamStep:
  """One selection applied to a group (`advance`): what the scheduler must carry out.

  Attributes:
    dropped: live beams no candidate continues (their slots are freed).
    forks: (parent, new beam) pairs: the new beam takes a spare slot of the group and
      shares its parent's blocks from the next step (a device fork).
    done: the search is over (every live beam reached max_tokens, or beam_width
      hypotheses finished): the group finishes.
  """
  dropped: List[Sequence]
  forks: List[Tuple[Sequence, Sequence]]
  done: bool


def advance(group: Group, new_seq_id: Callable[[], int], block_size: int) -> BeamStep:
  """Selects the next beams of `group` from every live beam's candidates (`topk`, set by
  the step) and applies it to the group's records: finished hypotheses join
  `group.finished`; each chosen continuation appends its token to its parent (the
  first) or to a new beam (further ones, `new_seq_id()` ids). Beams finishing at
  max_tokens are marked when `done`."""
  sp, live = group.params, list(group.seqs)
  topv = np.stack([q.topk[0] for q in live])
  topi = np.stack([q.topk[1] for q in live])
  chosen, ended = select([q.cum_logprob for q in live], topv, topi, sp.beam_width,
                         sp.stop_token_ids)
  for b, tok, score in ended:
    group.finished.append(Sequence(seq_id=new_seq_id(), index=0, sample_seed=0,
                                   tokens=live[b].tokens + [tok], prompt_len=live[b].prompt_len,
                                   cum_logprob=score, finish_reason="stop"))
  kids = collections.defaultdict(list)
  for b, tok, score in chosen:
    kids[b].append((tok, score))
  kept = {live[b].slot for b in kids}
  spare = [s for s in group.slots if s not in kept]
  step = BeamStep(dropped=[], forks=[], done=False)
  new_live = []
  for b, parent in enumerate(live):
    parent.topk = None
    if not kids[b]:
      step.dropped.append(parent)
      continue
    base = list(parent.tokens)
    for i, (tok, score) in enumerate(kids[b]):
      if i == 0:
        target = parent
      else:
        target = Sequence(seq_id=new_seq_id(), index=0, sample_seed=0, tokens=list(base),
                          prompt_len=parent.prompt_len, num_computed=parent.num_computed,
                          slot=spare.pop(0))
        shared = parent.num_computed % block_size != 0
        # A parent still sharing its last block keeps that set's id: one block.
        sid = parent.share_id if parent.last_block_shared else parent.seq_id
        target.last_block_shared = parent.last_block_shared = shared
        target.share_id = parent.share_id = sid
        step.forks.append((parent, target))
      target.tokens.append(tok)
      target.cum_logprob = score
      new_live.append(target)
  group.seqs = new_live
  step.done = (bool(new_live) and new_live[0].num_generated >= sp.max_tokens) or (
      len(group.finished) >= sp.beam_width) or not new_live
  if step.done:
    for q in new_live:
      if q.num_generated >= sp.max_tokens:
        q.finish_reason = "length"
        group.finished.append(q)
  return step
