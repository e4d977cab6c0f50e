"""Float64 NumPy oracle for paged attention, plus random poisoned paged caches.

Shared by the reference, kernel and lowering tests. The oracle walks each sequence's
block table in plain Python, builds its contiguous K/V, and runs per-head softmax
attention in float64: nothing here calls the code under test.
"""

import math

import ml_dtypes
import numpy as np


def oracle_one(q_rows, q_pos, k_seq, v_seq, kv_len, sm_scale, soft_cap, window):
  """q_rows [N, Hq, D], k_seq/v_seq [L, Hkv, D] float64 -> [N, Hq, D] float64."""
  n, num_q_heads, head_dim = q_rows.shape
  group = num_q_heads // k_seq.shape[1]
  out = np.zeros((n, num_q_heads, head_dim))
  for i in range(n):
    p = q_pos[i]
    lo = 0 if window is None else max(0, p - window + 1)
    hi = min(p + 1, kv_len)
    if p < 0 or hi <= lo:
      continue
    for h in range(num_q_heads):
      ks = k_seq[lo:hi, h // group]
      vs = v_seq[lo:hi, h // group]
      s = ks @ q_rows[i, h] * sm_scale
      if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
      w = np.exp(s - s.max())
      out[i, h] = (w / w.sum()) @ vs
  return out


def contiguous(pages, scales, table_row, length):
  """[Hkv, NB, bs, D] pages + one block-table row -> float64 [length, Hkv, D]."""
  bs = pages.shape[2]
  rows = []
  for pos in range(length):
    blk, off = table_row[pos // bs], pos % bs
    x = pages[:, blk, off].astype(np.float64)
    if scales is not None:
      x = x * scales[:, blk, off].astype(np.float64)[:, None]
    rows.append(x)
  if not rows:
    return np.zeros((0, pages.shape[0], pages.shape[3]))
  return np.stack(rows)


def make_cache(rng, *, num_kv_heads, num_blocks, block_size, head_dim, lengths, pages_per_seq,
               dtype=np.float32, quant=None):
  """Random pages, stale NaN in every unused slot, permuted tables with -1 past the length."""
  shape = (num_kv_heads, num_blocks, block_size, head_dim)
  k_scales = v_scales = None
  if quant == "int8":
    k = rng.integers(-127, 128, size=shape).astype(np.int8)
    v = rng.integers(-127, 128, size=shape).astype(np.int8)
    k_scales = rng.uniform(0.005, 0.02, size=shape[:3]).astype(np.float32)
    v_scales = rng.uniform(0.005, 0.02, size=shape[:3]).astype(np.float32)
  elif quant == "fp8":
    k = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
    v = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
    k_scales = rng.uniform(0.5, 2.0, size=shape[:3]).astype(np.float32)
    v_scales = rng.uniform(0.5, 2.0, size=shape[:3]).astype(np.float32)
  else:
    k = rng.normal(size=shape).astype(dtype)
    v = rng.normal(size=shape).astype(dtype)
  perm = rng.permutation(num_blocks)
  tables = np.full((len(lengths), pages_per_seq), -1, np.int32)
  used = np.zeros(num_blocks, bool)
  cursor = 0
  for s, length in enumerate(lengths):
    need = -(-length // block_size)
    tables[s, :need] = perm[cursor:cursor + need]
    used[perm[cursor:cursor + need]] = True
    cursor += need
    # Garbage (not only -1) in some unused table entries: must never be read.
    tail = np.arange(need, pages_per_seq)
    garbage = rng.random(tail.size) < 0.5
    tables[s, tail[garbage]] = rng.integers(0, num_blocks, size=garbage.sum())
  if np.issubdtype(k.dtype, np.floating):
    # Poison every block no live sequence owns, and the stale tail of each last block.
    k[:, ~used] = np.nan
    v[:, ~used] = np.nan
    for s, length in enumerate(lengths):
      if length % block_size:
        blk = tables[s, length // block_size]
        k[:, blk, length % block_size:] = np.nan
        v[:, blk, length % block_size:] = np.nan
  return k, v, k_scales, v_scales, tables


def rel_err(out, want):
  out = np.asarray(out, np.float64)
  return np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30)


def decode_oracle(q, k, v, ks, vs, tables, lengths, **kw):
  out = np.zeros(q.shape)
  for b, length in enumerate(lengths):
    kc = contiguous(k, ks, tables[b], length)
    vc = contiguous(v, vs, tables[b], length)
    out[b] = oracle_one(q[b:b + 1].astype(np.float64), [length - 1], kc, vc, length, **kw)[0]
  return out


def decode_case(rng, *, block_size, group, head_dim, lengths, num_kv_heads, dtype, quant,
                spare_blocks):
  """A random decode batch on a poisoned cache of `spare_blocks` more blocks than needed.

  Some table entries past each length point far outside the pool: never dereferenced.
  Returns (q, k, v, k_scales, v_scales, tables) as NumPy arrays.
  """
  pages_per_seq = max(1, -(-max(lengths) // block_size)) + int(rng.integers(0, 3))
  need = sum(-(-n // block_size) for n in lengths)
  k, v, ks, vs, tables = make_cache(rng, num_kv_heads=num_kv_heads,
                                    num_blocks=need + spare_blocks, block_size=block_size,
                                    head_dim=head_dim, lengths=lengths,
                                    pages_per_seq=pages_per_seq, dtype=dtype, quant=quant)
  for s, n in enumerate(lengths):
    tail = np.arange(-(-n // block_size), pages_per_seq)
    if tail.size:
      tables[s, rng.choice(tail)] = 10**6
  q = rng.normal(size=(len(lengths), num_kv_heads * group, head_dim)).astype(dtype)
  return q, k, v, ks, vs, tables


def check_decode_output(out, q, k, v, ks, vs, tables, lengths, kw, *, finite_msg):
  """Checks a decode kernel's output (shape, dtype, finite, zeros for length 0); returns
  (out as f32 NumPy, the float64 oracle) under the soft cap / window / sm_scale in `kw`."""
  assert out.shape == q.shape and out.dtype == q.dtype
  out = np.asarray(out.astype(np.float32))
  assert np.isfinite(out).all(), finite_msg
  for b, n in enumerate(lengths):
    if n == 0:
      assert np.all(out[b] == 0), "length 0 must give zeros"
  want = decode_oracle(q, k, v, ks, vs, tables, lengths,
                       sm_scale=kw.get("sm_scale") or 1 / math.sqrt(q.shape[-1]),
                       soft_cap=kw.get("soft_cap"), window=kw.get("sliding_window"))
  return out, want


def ragged_oracle(q, k, v, tables, kv_lens, cu, num_seqs, **kw):
  out = np.zeros(q.shape)
  for s in range(num_seqs):
    lo, hi = cu[s], cu[s + 1]
    n = hi - lo
    pos = [kv_lens[s] - n + i for i in range(n)]
    kc = contiguous(k, None, tables[s], kv_lens[s])
    vc = contiguous(v, None, tables[s], kv_lens[s])
    out[lo:hi] = oracle_one(q[lo:hi].astype(np.float64), pos, kc, vc, kv_lens[s], **kw)
  return out
