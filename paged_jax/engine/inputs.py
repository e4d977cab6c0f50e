"""A scheduler `Batch` (the plan) as the fixed-shape `StepInputs` of the jitted step
(host numpy), on the shape bucket (`buckets.py`) that holds it.

Shapes: T tokens and R rows (the bucket's), S = max_seqs slots / attach lanes, LK packed
prompt tokens for prefix-cache lookups; the static block-table width W (columns attention
reads) rides along as a jit static argument.
"""

from __future__ import annotations

from typing import Sequence as Seq

import jax
import numpy as np

from paged_jax.config import CacheConfig
from paged_jax.engine.buckets import StepBuckets
from paged_jax.engine.sequence import Batch, Group, Sequence
from paged_jax.engine.state import StepInputs, empty_inputs
from paged_jax.prefix_cache import salt_key


def lookup_len(cache_config: CacheConfig, max_num_batched_tokens: int) -> int:
  """LK: prompt tokens looked up in the prefix cache per step (1 without caching)."""
  if not cache_config.enable_prefix_caching:
    return 1
  return max(max_num_batched_tokens, cache_config.max_seq_len)


def input_shapes(num_tokens: int, max_seqs: int, lookup_len: int) -> StepInputs:
  """`jax.ShapeDtypeStruct`s of the step's inputs (for lowering without arrays)."""
  a = empty_inputs(num_tokens, max_seqs, lookup_len)
  return StepInputs(**{k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in a.items()})


def build_inputs(batch: Batch, running: Seq[Group], *, buckets: StepBuckets, max_seqs: int,
                 lookup_len: int, vocab_size: int, idle_all_greedy: bool = True):
  """Fills the step's arrays from the batch (chunks, frees, forks, attaches).

  running: the groups the step runs (the scheduler's running ones the plan did not
  preempt, and those it admits or swaps in).
  Returns (StepInputs, Bucket); pass `bucket.step_kw` to the step (`width=`,
  `decode_only=`, `all_greedy=`, `prefix_light=`: with prefix caching, a step that
  admits, frees, forks and swaps nothing skips that prefix work; `prefix_admit_only=`: one
  that admits but frees, forks and swaps nothing skips the first release and fork
  copies). all_greedy: every running request has temperature 0; `idle_all_greedy` when
  none runs (a frees-only step samples nothing: the engine passes its previous step's,
  so no new variant compiles).
  """
  chunks = batch.chunks
  max_len = max((ch.end + len(ch.draft) for ch in chunks), default=0)
  # Rows also hold the sampled slots (n > 1 children sample from their leader's row)
  # and the beam forks: the fork lanes are R wide (a forked beam is nearly always a row).
  num_sampled = sum(ch.samples for ch in chunks) + len(batch.post_forks)
  # Decided over every running request, not only this step's sampled rows: the
  # multi-step decode loop samples the others too.
  all_greedy = (all(g.params.temperature == 0 for g in running) if running
                else bool(idle_all_greedy))
  # With prefix caching: a step that frees, forks and swaps nothing leaves out the first
  # release and the fork copies (`prefix_admit_only`), and the lookup too when it admits
  # nothing either (`prefix_light`); buckets.pick keeps them only with caching.
  quiet = not (batch.frees or batch.forks or batch.post_forks or batch.swapped_in
               or batch.swap_out)
  owner = {q: g for g in running for q in g.seqs}
  # The logprobs variant: a running request reports alternatives (the decode loop samples
  # every running one), or a chunk scores prompt tokens.
  scored = [ch for ch in chunks if owner[ch.seq].prompt_scores is not None
            and ch.start < ch.seq.prompt_len - 1]
  logprobs = bool(scored) or any(g.params.logprobs for g in running)
  spec = any(ch.draft for ch in chunks)
  bucket = buckets.pick(batch.num_tokens, max(len(chunks), num_sampled, len(batch.forks)),
                        max_len, all(ch.num_scheduled == 1 for ch in chunks), all_greedy,
                        quiet and not batch.attaches, quiet and bool(batch.attaches),
                        logprobs, spec)
  a = empty_inputs(bucket.tokens, max_seqs, lookup_len, num_rows=bucket.rows)

  def sampling_row(seq: Sequence, group: Group, row: int):
    sp, slot = group.params, batch.slot(seq)
    a["sample_row"][slot] = row
    a["temperature"][slot] = sp.temperature
    a["top_k"][slot] = min(sp.top_k, vocab_size)   # validated >= -1; a cut >= vocab is none
    a["top_p"][slot] = sp.top_p
    a["seed"][slot] = seq.sample_seed
    a["sample_index"][slot] = seq.num_generated
    a["remaining"][slot] = sp.max_tokens - seq.num_generated
    a["stop_ids"][slot, :len(sp.stop_token_ids)] = sp.stop_token_ids
    a["multi_step"][slot] = sp.beam_width == 1

  t, leader_row, scored = 0, {}, {id(ch) for ch in scored}
  for r, ch in enumerate(chunks):
    seq, n = ch.seq, ch.num_scheduled
    a["tokens"][t:t + n] = seq.tokens[ch.start:ch.end] + list(ch.draft)
    a["positions"][t:t + n] = np.arange(ch.start, ch.start + n)
    a["token_row"][t:t + n] = r
    a["spec_len"][ch.slot] = len(ch.draft)
    if id(ch) in scored:   # position p scores prompt token p + 1
      stop = min(ch.end, seq.prompt_len - 1)
      a["target_tokens"][t:t + stop - ch.start] = seq.tokens[ch.start + 1:stop + 1]
    a["row_slot"][r], a["row_q_len"][r] = ch.slot, n
    (a["alloc_tokens"] if ch.allocate else a["append_tokens"])[ch.slot] = n
    leader_row[seq] = r
    if ch.samples:
      sampling_row(seq, owner[seq], r)
    t += n
  for i, (leader, child) in enumerate(batch.post_forks):
    a["post_fork_src"][i], a["post_fork_dst"][i] = batch.slot(leader), batch.slot(child)
    if len(child.tokens) == child.prompt_len:
      sampling_row(child, owner[child], leader_row[leader])
  a["free_slots"][:len(batch.frees)] = batch.frees
  for i, (parent, child) in enumerate(batch.forks):
    a["fork_src"][i], a["fork_dst"][i] = parent.slot, child.slot
  start = 0
  for i, (seq, n) in enumerate(zip(batch.attaches, batch.attach_lens)):
    a["attach_slot"][i], a["attach_len"][i], a["attach_start"][i] = batch.slot(seq), n, start
    a["attach_tokens"][start:start + n] = seq.tokens[:n]
    a["attach_root"][i], a["attach_tag"][i] = salt_key(owner[seq].params.cache_salt)
    start += n
  # The row bucket must give every sampled slot a lane (the step samples R lanes).
  assert np.sum(a["sample_row"] >= 0) <= bucket.rows, (np.sum(a["sample_row"] >= 0), bucket)
  assert not all_greedy or not np.any(a["temperature"] > 0), "a hot row in a greedy step"
  return StepInputs(**a), bucket
