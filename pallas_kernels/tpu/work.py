"""Work lists for the TPU paged-attention kernel: which query rows meet which K/V tiles.

The kernel (attention_kernel.py) walks a list of *pairs*. A pair is a run of query rows
that lie in ONE query block and belong to ONE sequence; it owns a range of K/V tiles
(`kv_per_tile` tokens each) of that sequence. Pairs are ordered by query block, and each
grid program (one query block) handles the pairs in `prog_pairs[g] : prog_pairs[g + 1]`.
Everything here is a few small XLA ops on [num_pairs]-sized vectors, computed before the
kernel starts; the kernel reads them as scalar-prefetch operands in SMEM.

  meta  i32[NUM_FIELDS * num_pairs]  field f of pair p at meta[f * num_pairs + p]:
    SEQ     sequence id (row of the block table)
    ROW0    first query row of the pair, relative to its query block (ragged only)
    NROWS   query rows in the pair (ragged only; decode pairs hold one query)
    POS0    position of the pair's first query token
    KV_END  keys the pair can see: min(kv_len, last position + 1, pages_per_seq * bs);
            pages at or past it are neither fetched nor read
    KV_LO   first K/V tile (sliding window: tiles wholly before the window are skipped)
    KV_HI   one past the last K/V tile; KV_LO == KV_HI means no K/V work (zeros out)
  prog_pairs  i32[num_programs + 1]
  chain       i32[num_pairs + 1]: chain[p] = next pair after p with K/V work (num_pairs
              when none); chain[num_pairs] = the first such pair. The kernel prefetches
              along this chain, across program boundaries, so the DMA engine never idles
              between sequences.

Causal skipping comes for free: a prefill chunk's pair ends at its last row's position,
so K/V tiles past it are never fetched.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SEQ, ROW0, NROWS, POS0, KV_END, KV_LO, KV_HI = range(7)
NUM_FIELDS = 7


@dataclasses.dataclass(frozen=True)
class WorkList:
  """Scalar-prefetch operands of one kernel call (see the module docstring).

  Attributes:
    meta: i32[NUM_FIELDS * num_pairs].
    prog_pairs: i32[num_programs + 1], pair range of each grid program.
    chain: i32[num_pairs + 1], prefetch chain.
    num_pairs: static capacity of the pair list.
  """
  meta: jax.Array
  prog_pairs: jax.Array
  chain: jax.Array
  num_pairs: int


def _cdiv(a, b):
  return (a + b - 1) // b


def _kv_range(pos0, last_pos, kv_len, *, kv_per_tile, max_keys, sliding_window):
  """(kv_end, kv_lo, kv_hi) of query positions pos0..last_pos over kv_len keys."""
  kv_end = jnp.clip(jnp.minimum(kv_len, last_pos + 1), 0, max_keys)
  lo = jnp.zeros_like(kv_end)
  if sliding_window is not None:
    lo = jnp.maximum(pos0 - sliding_window + 1, 0) // kv_per_tile
  hi = _cdiv(kv_end, kv_per_tile)
  lo = jnp.minimum(lo, hi)
  return kv_end, lo, hi


def _chain(kv_lo, kv_hi, valid):
  """chain[p]: next pair after p with work; chain[-1]: the first one (n when none)."""
  n = kv_lo.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  with_work = jnp.where(valid & (kv_hi > kv_lo), idx, n)
  suffix_min = jax.lax.cummin(with_work, reverse=True)          # first work pair >= p
  after = jnp.concatenate([suffix_min[1:], jnp.full((1,), n, jnp.int32)])
  return jnp.concatenate([after, suffix_min[:1]]).astype(jnp.int32)


def _pack(fields, prog_pairs, valid, num_pairs) -> WorkList:
  fields = [jnp.where(valid, f, 0).astype(jnp.int32) for f in fields]
  chain = _chain(fields[KV_LO], fields[KV_HI], valid)
  return WorkList(jnp.concatenate(fields), prog_pairs.astype(jnp.int32), chain, num_pairs)


def decode_work(lengths, *, seqs_per_tile, kv_per_tile, block_size, pages_per_seq,
                sliding_window=None) -> WorkList:
  """One pair per sequence: the query at position lengths[b] - 1.

  Args:
    lengths: i32[Bp] (Bp a multiple of seqs_per_tile; padding rows hold 0).
  """
  num_seqs = lengths.shape[0]
  lengths = lengths.astype(jnp.int32)
  pos0 = lengths - 1
  kv_end, lo, hi = _kv_range(pos0, pos0, lengths, kv_per_tile=kv_per_tile,
                             max_keys=pages_per_seq * block_size,
                             sliding_window=sliding_window)
  seq = jnp.arange(num_seqs, dtype=jnp.int32)
  ones = jnp.ones_like(seq)
  fields = [seq, jnp.zeros_like(seq), ones, pos0, kv_end, lo, hi]
  starts = jnp.arange(0, num_seqs + 1, seqs_per_tile, dtype=jnp.int32)
  return _pack(fields, starts, jnp.ones_like(seq, bool), num_seqs)


def ragged_work(cu_q_lens, kv_lens, num_seqs, *, num_tokens, q_per_tile, kv_per_tile,
                block_size, pages_per_seq, sliding_window=None) -> WorkList:
  """Pairs of a ragged batch of `num_tokens` (padded, a multiple of q_per_tile) rows.

  A pair starts at every query-block start and every live sequence's first row (both
  below the batch's total query count), so no pair crosses a block or a sequence; there
  are at most num_blocks + S of them. Sequences with no queries get no pair. Rows past
  the total belong to no pair (the kernel leaves them zero).
  """
  max_seqs = kv_lens.shape[0]
  num_blocks = num_tokens // q_per_tile
  cap = num_blocks + max_seqs
  big = jnp.int32(2**30)
  cu = cu_q_lens.astype(jnp.int32)
  n = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, max_seqs)
  live = jnp.arange(max_seqs, dtype=jnp.int32) < n
  total = jnp.clip(cu[n], 0, num_tokens)
  seq_starts = jnp.where(live & (cu[1:] > cu[:-1]) & (cu[:-1] < total), cu[:-1], big)
  block_starts = jnp.arange(num_blocks, dtype=jnp.int32) * q_per_tile
  block_starts = jnp.where(block_starts < total, block_starts, big)
  starts = jnp.sort(jnp.concatenate([seq_starts, block_starts]))
  dup = jnp.concatenate([jnp.zeros((1,), bool), starts[1:] == starts[:-1]])
  starts = jnp.sort(jnp.where(dup, big, starts))
  valid = starts < big
  block = jnp.where(valid, starts // q_per_tile, num_blocks)
  nxt = jnp.concatenate([starts[1:], jnp.full((1,), big, jnp.int32)])
  ends = jnp.minimum(jnp.minimum(nxt, total), (block + 1) * q_per_tile)
  # Sequence of each start: live sequences that end at or before it (empty ones included).
  seq_ends = jnp.where(live, cu[1:], big)
  seq = jnp.searchsorted(seq_ends, starts, side="right").astype(jnp.int32)
  seq = jnp.clip(seq, 0, max_seqs - 1)
  q_start = cu[seq]
  q_len = cu[seq + 1] - q_start
  kv_len = kv_lens.astype(jnp.int32)[seq]
  pos0 = kv_len - q_len + (starts - q_start)
  nrows = ends - starts
  kv_end, lo, hi = _kv_range(pos0, pos0 + nrows - 1, kv_len, kv_per_tile=kv_per_tile,
                             max_keys=pages_per_seq * block_size,
                             sliding_window=sliding_window)
  row0 = starts - block * q_per_tile
  fields = [seq, row0, nrows, pos0, kv_end, lo, hi]
  prog_pairs = jnp.searchsorted(block, jnp.arange(num_blocks + 1, dtype=jnp.int32),
                                side="left")
  return _pack(fields, prog_pairs, valid, cap)
