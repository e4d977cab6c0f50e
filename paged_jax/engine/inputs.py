"""A scheduler `Batch` as the fixed-shape `StepInputs` of the jitted step (host numpy).

Shapes: T tokens (the smallest token bucket >= the batch's tokens), S = max_seqs
slots / rows / attach lanes, LK packed prompt tokens for prefix-cache lookups.
"""

from __future__ import annotations

from typing import Dict, Sequence as Seq

import jax
import numpy as np

from paged_jax.engine.params import MAX_STOP_IDS
from paged_jax.engine.scheduler import Batch, Group, Scheduler, Sequence
from paged_jax.engine.step import StepInputs


def empty_inputs(num_tokens: int, max_seqs: int, lookup_len: int) -> Dict[str, np.ndarray]:
  """Numpy arrays of a step that does nothing (every entry padding)."""
  s = max_seqs
  i32 = lambda n, v=0: np.full((n,), v, np.int32)
  return dict(tokens=i32(num_tokens), positions=i32(num_tokens), token_row=i32(num_tokens, -1),
              row_slot=i32(s, -1), row_q_len=i32(s), free_slots=i32(s, -1), fork_src=i32(s, -1),
              fork_dst=i32(s, -1), alloc_tokens=i32(s), append_tokens=i32(s),
              sample_row=i32(s, -1), post_fork_src=i32(s, -1),
              temperature=np.zeros((s,), np.float32), top_k=i32(s),
              top_p=np.ones((s,), np.float32), seed=i32(s), sample_index=i32(s),
              remaining=i32(s, 1), stop_ids=np.full((s, MAX_STOP_IDS), -1, np.int32),
              multi_step=np.zeros((s,), np.bool_), attach_slot=i32(s, -1), attach_len=i32(s),
              attach_start=i32(s), attach_tokens=i32(lookup_len))


def input_shapes(num_tokens: int, max_seqs: int, lookup_len: int) -> StepInputs:
  """`jax.ShapeDtypeStruct`s of the step's inputs (for lowering without arrays)."""
  a = empty_inputs(num_tokens, max_seqs, lookup_len)
  return StepInputs(**{k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in a.items()})


def build_inputs(batch: Batch, running: Seq[Group], *, buckets: Seq[int], max_seqs: int,
                 lookup_len: int, vocab_size: int) -> StepInputs:
  """Fills the step's arrays from the batch (chunks, frees, forks, attaches)."""
  t_max = next(b for b in buckets if b >= batch.num_tokens)
  a = empty_inputs(t_max, max_seqs, lookup_len)

  def sampling_row(seq: Sequence, group: Group, row: int):
    sp, slot = group.params, seq.slot
    a["sample_row"][slot] = row
    a["temperature"][slot] = sp.temperature
    a["top_k"][slot] = min(sp.top_k, vocab_size)   # validated >= -1; a cut >= vocab is none
    a["top_p"][slot] = sp.top_p
    a["seed"][slot] = seq.sample_seed
    a["sample_index"][slot] = seq.num_generated
    a["remaining"][slot] = sp.max_tokens - seq.num_generated
    a["stop_ids"][slot, :len(sp.stop_token_ids)] = sp.stop_token_ids
    a["multi_step"][slot] = sp.beam_width == 1

  owner = {id(q): g for g in running for q in g.seqs}
  t, leader_row = 0, {}
  for r, ch in enumerate(batch.chunks):
    seq, n, nc = ch.seq, ch.num_tokens, ch.seq.num_computed
    a["tokens"][t:t + n] = seq.tokens[nc:nc + n]
    a["positions"][t:t + n] = np.arange(nc, nc + n)
    a["token_row"][t:t + n] = r
    a["row_slot"][r], a["row_q_len"][r] = seq.slot, n
    (a["alloc_tokens"] if ch.allocate else a["append_tokens"])[seq.slot] = n
    leader_row[id(seq)] = r
    if ch.samples:
      sampling_row(seq, owner[id(seq)], r)
    t += n
  for leader, child in batch.post_forks:
    a["post_fork_src"][child.slot] = leader.slot
    if len(child.tokens) == child.prompt_len:
      sampling_row(child, owner[id(child)], leader_row[id(leader)])
  a["free_slots"][:len(batch.frees)] = batch.frees
  for i, (parent, child) in enumerate(batch.forks):
    a["fork_src"][i], a["fork_dst"][i] = parent.slot, child.slot
  start = 0
  for i, seq in enumerate(batch.attaches):
    n = Scheduler.lookup_len(owner[id(seq)])
    a["attach_slot"][i], a["attach_len"][i], a["attach_start"][i] = seq.slot, n, start
    a["attach_tokens"][start:start + n] = seq.tokens[:n]
    start += n
  return StepInputs(**a)

