"""Beam search on the host: one selection per step per group (`select`), turned into
writes to the group's records by `advance`, which `Scheduler.update` calls.

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

from paged_jax.engine.sequence import Group, SeqState, Sequence


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


def advance(group: Group, new_seq_id: Callable[[], int], block_size: int, ch) -> BeamStep:
  """Selects the next beams of `group` from every live beam's candidates (`topk`, set by
  this update) and writes the result through `ch` (`commit.Changes`, read back with
  `ch.get`): finished hypotheses join the group's finished; each chosen continuation
  appends its token to its parent (the first) or to a new beam (further ones, new
  `Sequence`s with `new_seq_id()` ids, FORKING until the next step forks them). Beams
  finishing at max_tokens are marked when `done`."""
  sp, live = group.params, list(ch.get(group, "seqs"))
  tops = [ch.get(q, "topk") for q in live]
  chosen, ended = select([q.cum_logprob for q in live], np.stack([t[0] for t in tops]),
                         np.stack([t[1] for t in tops]), sp.beam_width, sp.stop_token_ids)
  finished = list(ch.get(group, "finished"))
  for b, tok, score in ended:
    finished.append(Sequence(seq_id=new_seq_id(), index=0, sample_seed=0,
                             tokens=live[b].tokens + [tok], prompt_len=live[b].prompt_len,
                             cum_logprob=score, finish_reason="stop",
                             state=SeqState.FINISHED))
  kids = collections.defaultdict(list)
  for b, tok, score in chosen:
    kids[b].append((tok, score))
  kept = {ch.get(live[b], "slot") for b in kids}
  spare = [s for s in ch.get(group, "slots") if s not in kept]
  step = BeamStep(dropped=[], forks=[], done=False)
  new_live = []   # (sequence, its generated tokens after this selection)
  for b, parent in enumerate(live):
    ch.set(parent, topk=None)
    if not kids[b]:
      step.dropped.append(parent)
      continue
    computed = ch.get(parent, "num_computed")
    share = ch.get(parent, "share_id")
    for i, (tok, score) in enumerate(kids[b]):
      if i == 0:
        target = parent
        ch.extend(parent.tokens, [tok])
        ch.set(parent, cum_logprob=score)
      else:
        # A parent still sharing its last block keeps that set's id: one block.
        sid = (share if share >= 0 else parent.seq_id) if computed % block_size else -1
        target = Sequence(seq_id=new_seq_id(), index=0, sample_seed=0,
                          tokens=parent.tokens + [tok], prompt_len=parent.prompt_len,
                          num_computed=computed, slot=spare.pop(0), state=SeqState.FORKING,
                          share_id=sid, cum_logprob=score)
        ch.set(parent, share_id=sid)
        step.forks.append((parent, target))
      new_live.append((target, parent.num_generated + 1))
  step.done = (bool(new_live) and new_live[0][1] >= sp.max_tokens) or (
      len(finished) >= sp.beam_width) or not new_live
  if step.done:
    for q, generated in new_live:
      if generated >= sp.max_tokens:
        ch.set(q, finish_reason="length")
        finished.append(q)
  ch.set(group, seqs=[q for q, _ in new_live], finished=finished)
  return step
