"""Beam-search selection on the host (one decision per step per group).

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

from typing import List, Sequence as Seq, Tuple

import numpy as np


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
