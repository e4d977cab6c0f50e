"""The TPU kernel's work lists (pallas_kernels/tpu/work.py) against a plain-Python model.

For random ragged batches (empty sequences, dead sequences past num_seqs, chunks that
straddle query blocks, windows): every live query row belongs to exactly one pair, a pair
never crosses a query block or a sequence, each program's pairs are its block's, the K/V
tile range covers exactly the keys the pair's rows can see, and the prefetch chain visits
the pairs with work in order. No kernel runs: milliseconds per case.
"""

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels.tpu import work as W


def model_pairs(cu, kv_lens, num_seqs, *, tq, tk, span, window):
  """[(block, seq, row0, nrows, pos0, kv_end, lo, hi)] by walking the rows one by one."""
  out = []
  total = cu[num_seqs]
  for t in range(total):
    s = max(i for i in range(num_seqs) if cu[i] <= t < cu[i + 1])
    blk = t // tq
    pos = kv_lens[s] - (cu[s + 1] - cu[s]) + (t - cu[s])
    if out and out[-1][0] == blk and out[-1][1] == s:
      b, s_, r0, n, p0, *_ = out[-1]
      out[-1] = [b, s_, r0, n + 1, p0]
    else:
      out.append([blk, s, t - blk * tq, 1, pos])
  pairs = []
  for blk, s, r0, n, p0 in out:
    end = max(0, min(kv_lens[s], p0 + n, span))
    lo = max(p0 - window + 1, 0) // tk if window else 0
    hi = -(-end // tk)
    pairs.append((blk, s, r0, n, p0, end, min(lo, hi), hi))
  return pairs


@pytest.mark.parametrize("seed", range(12))
def test_ragged_work_matches_model(seed):
  rng = np.random.default_rng(seed)
  max_seqs = 8                          # fixed shapes: the eager ops compile once
  num_seqs = int(rng.integers(0, max_seqs + 1))
  q_lens = rng.integers(0, 11, max_seqs) * (rng.random(max_seqs) < 0.8)
  kv_lens = q_lens + rng.integers(0, 60, max_seqs)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  tq, tk, bs = int(rng.choice([1, 4, 8])), int(rng.choice([16, 32])), 16
  pages_per_seq = int(rng.integers(1, 6))
  window = int(rng.choice([0, 5, 17]))
  num_tokens = 96
  wl = W.ragged_work(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), num_seqs,
                     num_tokens=num_tokens, q_per_tile=tq, kv_per_tile=tk, block_size=bs,
                     pages_per_seq=pages_per_seq, sliding_window=window or None)
  want = model_pairs(cu, kv_lens, num_seqs, tq=tq, tk=tk, span=pages_per_seq * bs,
                     window=window)
  meta = np.asarray(wl.meta).reshape(W.NUM_FIELDS, wl.num_pairs)
  prog = np.asarray(wl.prog_pairs)
  assert prog[-1] == len(want) and wl.num_pairs >= len(want)
  got = []
  for blk in range(num_tokens // tq):
    for p in range(prog[blk], prog[blk + 1]):
      f = meta[:, p]
      got.append((blk, f[W.SEQ], f[W.ROW0], f[W.NROWS], f[W.POS0], f[W.KV_END],
                  f[W.KV_LO], f[W.KV_HI]))
  assert got == [tuple(int(x) for x in w) for w in want]
  chain, first = np.asarray(wl.chain[:-1]), int(wl.chain[-1])
  with_work = [p for p, w in enumerate(want) if w[7] > w[6]]
  walk, p = [], first
  while p < wl.num_pairs:
    walk.append(p)
    p = int(chain[p])
  assert walk == with_work


def test_decode_work_one_pair_per_sequence():
  lengths = jnp.asarray([0, 1, 16, 17, 100, 5, 0, 0], jnp.int32)
  wl = W.decode_work(lengths, seqs_per_tile=4, kv_per_tile=16, block_size=16,
                     pages_per_seq=4, sliding_window=8)
  meta = np.asarray(wl.meta).reshape(W.NUM_FIELDS, wl.num_pairs)
  np.testing.assert_array_equal(wl.prog_pairs, [0, 4, 8])
  np.testing.assert_array_equal(meta[W.SEQ], np.arange(8))
  np.testing.assert_array_equal(meta[W.KV_END], [0, 1, 16, 17, 64, 5, 0, 0])
  np.testing.assert_array_equal(meta[W.KV_HI], [0, 1, 1, 2, 4, 1, 0, 0])
  # Window 8: the query at position 99 sees keys 92..99, all past the 64 the table spans:
  # no tile at all (lo == hi), so the chain skips it.
  np.testing.assert_array_equal(meta[W.KV_LO], [0, 0, 0, 0, 4, 0, 0, 0])
  assert list(np.asarray(wl.chain)) == [1, 2, 3, 5, 5, 8, 8, 8, 1]
