"""A scheduler `Batch` as the fixed-shape `StepInputs` of the jitted step (host numpy),
and the shape buckets the step runs on.

Shapes: T tokens and R rows (the smallest buckets >= what is live), S = max_seqs
slots / attach lanes, LK packed prompt tokens for prefix-cache lookups; the static
block-table width W (columns attention reads) rides along as a jit static argument.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, NamedTuple, Optional, Sequence as Seq, Tuple

import jax
import numpy as np

from paged_jax.engine.params import MAX_STOP_IDS
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.sequence import Batch, Group, Sequence
from paged_jax.engine.step import StepInputs


def _geometric(largest: int, smallest: int, factor: int, *,
               halfway_from: Optional[int] = None) -> Tuple[int, ...]:
  """smallest, smallest * factor, ... below `largest`, then `largest` itself; with
  `halfway_from` (factor 2) also each v * 1.5 from v = halfway_from up (8, 16, 24, 32, 48)."""
  out, v = [], smallest
  while v < largest:
    out.append(v)
    if halfway_from is not None and v >= halfway_from and v * 3 // 2 < largest:
      out.append(v * 3 // 2)
    v *= factor
  return tuple(out) + (largest,)


class Bucket(NamedTuple):
  """One compiled shape of the step (each distinct Bucket traces and compiles once).

  Attributes:
    tokens: T, new tokens the step computes (padded; = rows when decode_only).
    rows: R, attention rows and sampling lanes (chunks, sampled slots, forks).
    width: W, block-table columns attention reads (the step's static `width=`).
    decode_only: every row has one new token: the decode kernel runs.
    all_greedy: every running request is greedy: sampling is an argmax.
  """
  tokens: int
  rows: int
  width: int
  decode_only: bool
  all_greedy: bool = False


@dataclasses.dataclass(frozen=True)
class StepBuckets:
  """The shape buckets of the step, chosen per step from what is live.

  Like the few batch sizes a serving engine captures: tokens T (a step's new
  tokens), rows R (attention rows = chunks, and sampled slots), widths W
  (block-table columns attention reads: the longest live sequence after the step,
  decode loop included). Each (T, R, W, decode_only) compiles once; a decode-only
  step (every row one new token) runs the decode kernel with T = R.
  `enabled=False` pins every step to the largest bucket (T = budget, R = S,
  W = max_blocks_per_seq, ragged attention): the unbucketed step.
  """
  tokens: Tuple[int, ...]
  rows: Tuple[int, ...]
  widths: Tuple[int, ...]
  block_size: int
  decode_steps: int
  enabled: bool = True

  @classmethod
  def make(cls, *, max_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
           block_size: int, decode_steps: int, enabled: bool = True) -> "StepBuckets":
    if not enabled:
      return cls((max_num_batched_tokens,), (max_seqs,), (max_blocks_per_seq,), block_size,
                 decode_steps, enabled=False)
    # Tokens by 4x (a prefill chunk's cost is mostly the model's matmuls, and a
    # busy engine fills its budget); rows by 2x to 16, then 1.5x / 2x alternately (8, 16, 24,
    # 32, 48, ...: every decode step's matmuls, attention and sampling scale with R, and
    # with 2x steps a 36-42-row decode ran at R = 64, a third of it padding:
    # experiments.hf_peer_bench at 25M params); widths by 2x (attention only). The
    # smallest buckets keep small engines (tests) at one or two shapes each.
    return cls(_geometric(max_num_batched_tokens, min(16, max_num_batched_tokens), 4),
               _geometric(max_seqs, min(8, max_seqs), 2, halfway_from=16),
               _geometric(max_blocks_per_seq, min(4, max_blocks_per_seq), 2),
               block_size, decode_steps)

  @property
  def max_variants(self) -> int:
    """Upper bound on distinct compiled steps: mixed (T, R, W) + decode-only (R, W),
    each with sampling or all-greedy."""
    return (len(self.tokens) + self.enabled) * len(self.rows) * len(self.widths) * 2

  def pick(self, num_tokens: int, num_rows: int, max_len: int, decode_only: bool,
           all_greedy: bool = False) -> Bucket:
    """The Bucket for a step with `num_tokens` new tokens, `num_rows` rows / sampled
    slots, and `max_len` tokens in its longest row after the step."""
    up = lambda sizes, n: next((b for b in sizes if b >= n), sizes[-1])
    rows = up(self.rows, num_rows)
    if self.decode_steps > 1:
      max_len += self.decode_steps - 1          # the decode loop's tokens
    width = up(self.widths, -(-max(max_len, 1) // self.block_size))
    decode_only = decode_only and self.enabled
    tokens = rows if decode_only else up(self.tokens, num_tokens)
    return Bucket(tokens, rows, width, decode_only, bool(all_greedy))


def empty_inputs(num_tokens: int, max_seqs: int, lookup_len: int,
                 num_rows: int = None) -> Dict[str, np.ndarray]:
  """Numpy arrays of a step that does nothing (every entry padding); R = num_rows
  (default max_seqs)."""
  s = max_seqs
  r = max_seqs if num_rows is None else num_rows
  i32 = lambda n, v=0: np.full((n,), v, np.int32)
  return dict(tokens=i32(num_tokens), positions=i32(num_tokens), token_row=i32(num_tokens, -1),
              row_slot=i32(r, -1), row_q_len=i32(r), free_slots=i32(s, -1), fork_src=i32(r, -1),
              fork_dst=i32(r, -1), alloc_tokens=i32(s), append_tokens=i32(s),
              sample_row=i32(s, -1), post_fork_src=i32(r, -1), post_fork_dst=i32(r, -1),
              temperature=np.zeros((s,), np.float32), top_k=i32(s),
              top_p=np.ones((s,), np.float32), seed=i32(s), sample_index=i32(s),
              remaining=i32(s, 1), stop_ids=np.full((s, MAX_STOP_IDS), -1, np.int32),
              multi_step=np.zeros((s,), np.bool_), attach_slot=i32(s, -1), attach_len=i32(s),
              attach_start=i32(s), attach_tokens=i32(lookup_len))


def input_shapes(num_tokens: int, max_seqs: int, lookup_len: int) -> StepInputs:
  """`jax.ShapeDtypeStruct`s of the step's inputs (for lowering without arrays)."""
  a = empty_inputs(num_tokens, max_seqs, lookup_len)
  return StepInputs(**{k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in a.items()})


def build_inputs(batch: Batch, running: Seq[Group], *, buckets: StepBuckets, max_seqs: int,
                 lookup_len: int, vocab_size: int, idle_all_greedy: bool = True):
  """Fills the step's arrays from the batch (chunks, frees, forks, attaches).

  Returns (StepInputs, Bucket); pass its last three fields to the step as `width=`,
  `decode_only=`, `all_greedy=`. all_greedy: every running
  request has temperature 0; `idle_all_greedy` when none runs (a frees-only step
  samples nothing: the engine passes its previous step's, so no new variant compiles).
  """
  chunks = batch.chunks
  max_len = max((ch.seq.num_computed + ch.num_tokens for ch in chunks), default=0)
  # Rows also hold the sampled slots (n > 1 children sample from their leader's row)
  # and the beam forks: the fork lanes are R wide (a forked beam is nearly always a row).
  num_sampled = sum(ch.samples for ch in chunks) + len(batch.post_forks)
  # Decided over every running request, not only this step's sampled rows: the
  # multi-step decode loop samples the others too.
  all_greedy = (all(g.params.temperature == 0 for g in running) if running
                else bool(idle_all_greedy))
  bucket = buckets.pick(batch.num_tokens, max(len(chunks), num_sampled, len(batch.forks)),
                        max_len, all(ch.num_tokens == 1 for ch in chunks), all_greedy)
  a = empty_inputs(bucket.tokens, max_seqs, lookup_len, num_rows=bucket.rows)

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
  for i, (leader, child) in enumerate(batch.post_forks):
    a["post_fork_src"][i], a["post_fork_dst"][i] = leader.slot, child.slot
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
  # The row bucket must give every sampled slot a lane (the step samples R lanes).
  assert np.sum(a["sample_row"] >= 0) <= bucket.rows, (np.sum(a["sample_row"] >= 0), bucket)
  assert not all_greedy or not np.any(a["temperature"] > 0), "a hot row in a greedy step"
  return StepInputs(**a), bucket

