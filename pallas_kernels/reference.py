"""Plain-jnp paged attention: the oracle every Pallas kernel is tested against.

Layout (see paged_jax/kv_cache.py):
  k_pages, v_pages: [num_kv_heads, num_blocks, block_size, head_dim]
  k_scales, v_scales: f32[num_kv_heads, num_blocks, block_size] (int8 / fp8 pages only)
  block_tables: i32[num_seqs, pages_per_seq]; token at position p of sequence s lives in
    page block_tables[s, p // block_size] at offset p % block_size.

Semantics shared by every function here and by the kernels:
  * sm_scale None -> 1/sqrt(head_dim); logits = sm_scale * q.k.
  * soft_cap c: logits = c * tanh(logits / c), applied after sm_scale.
  * query head h reads KV head h // (num_q_heads // num_kv_heads) (GQA; MQA when 1 KV head).
  * a query at position p sees keys at positions j with j <= p, j < kv_len and, with a
    sliding window W, j > p - W.
  * a query that sees no key (length 0, padding) returns zeros.
  * block-table entries past a sequence's length may hold anything (-1, garbage): the
    indices are clamped into range and the keys they bring are masked out of both the
    logits and the values, so stale pages (even NaN-filled) never reach the output.
  * accumulation in float32; the result has q.dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import checks


def _check_heads(num_q_heads: int, num_kv_heads: int) -> int:
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_q_heads={num_q_heads}")
  return num_q_heads // num_kv_heads


def scaled_logits(logits, sm_scale, soft_cap):
  """f32 logits -> sm_scale, then optional tanh soft cap."""
  logits = logits * sm_scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  return logits


def masked_softmax_weights(logits, visible):
  """Softmax over the last axis restricted to `visible`; all-invisible rows give zeros."""
  logits = jnp.where(visible, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  return weights / jnp.where(denom > 0, denom, 1.0)


def gather_pages(pages, block_tables, scales=None):
  """Contiguous f32 copy of each sequence's pages (reference path only).

  Args:
    pages: [Hkv, NB, bs, D] any dtype.
    block_tables: i32[S, P]; out-of-range entries are clamped (their tokens must be masked).
    scales: f32[Hkv, NB, bs] or None.
  Returns:
    f32[S, Hkv, P * bs, D].
  """
  num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  num_seqs, pages_per_seq = block_tables.shape
  idx = jnp.clip(block_tables.astype(jnp.int32), 0, num_blocks - 1)
  out = pages[:, idx].astype(jnp.float32)  # [Hkv, S, P, bs, D]
  if scales is not None:
    out = out * scales[:, idx].astype(jnp.float32)[..., None]
  out = out.reshape(num_kv_heads, num_seqs, pages_per_seq * block_size, head_dim)
  return jnp.swapaxes(out, 0, 1)


def _attend(q, k, v, q_pos, kv_len, sm_scale, soft_cap, sliding_window):
  """Attention of a few query rows of ONE sequence over its contiguous f32 K/V.

  q: [N, Hq, D]; k, v: f32[Hkv, L, D]; q_pos: i32[N] (-1 = padding row); kv_len: i32[].
  Returns f32[N, Hq, D].
  """
  n, num_q_heads, head_dim = q.shape
  num_kv_heads, max_len, _ = k.shape
  group = num_q_heads // num_kv_heads
  qg = q.astype(jnp.float32).reshape(n, num_kv_heads, group, head_dim)
  logits = jnp.einsum("nhgd,hld->nhgl", qg, k, precision=jax.lax.Precision.HIGHEST)
  logits = scaled_logits(logits, sm_scale, soft_cap)
  key_pos = jnp.arange(max_len, dtype=jnp.int32)[None, :]
  qp = q_pos[:, None]
  visible = (key_pos < kv_len) & (key_pos <= qp) & (qp >= 0)
  if sliding_window is not None:
    visible &= key_pos > qp - sliding_window
  weights = masked_softmax_weights(logits, visible[:, None, None, :])
  # Zero invisible values: 0 * NaN from a stale page would otherwise poison the sum.
  key_ok = (key_pos[0] < kv_len)[None, :, None]
  v = jnp.where(key_ok, v, 0.0)
  out = jnp.einsum("nhgl,hld->nhgd", weights, v, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(n, num_q_heads, head_dim)


def _resolve_scale(sm_scale, head_dim):
  return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                              soft_cap=None, sliding_window=None, k_scales=None,
                              v_scales=None):
  """Decode attention: one query per sequence at position lengths[b] - 1.

  Args:
    q: [B, Hq, D].
    k_pages, v_pages: [Hkv, NB, bs, D].
    block_tables: i32[B, P].
    lengths: i32[B], tokens of each sequence in the cache (including the current one).
  Returns:
    [B, Hq, D] in q.dtype.
  Raises:
    ValueError naming a bad argument (`checks.check_decode`), before any tracing.
  """
  checks.check_decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
  checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=q.shape[-1])
  k = gather_pages(k_pages, block_tables, k_scales)  # [B, Hkv, L, D]
  v = gather_pages(v_pages, block_tables, v_scales)
  return contiguous_decode_attention(q, k, v, lengths, sm_scale=sm_scale, soft_cap=soft_cap,
                                     sliding_window=sliding_window)


def contiguous_decode_attention(q, k, v, lengths, *, sm_scale=None, soft_cap=None,
                                sliding_window=None):
  """Decode attention over a contiguous head-major cache (the paged path minus the gather).

  Args:
    q: [B, Hq, D]; k, v: [B, Hkv, L, D] (any float dtype; computed in f32);
    lengths: i32[B], the query sits at position lengths[b] - 1.
  Returns:
    [B, Hq, D] in q.dtype.
  """
  _check_heads(q.shape[1], k.shape[1])
  scale = _resolve_scale(sm_scale, q.shape[-1])
  lengths = lengths.astype(jnp.int32)

  def one(q_b, k_b, v_b, len_b):
    return _attend(q_b[None], k_b.astype(jnp.float32), v_b.astype(jnp.float32),
                   (len_b - 1)[None], len_b, scale, soft_cap, sliding_window)[0]

  return jax.vmap(one)(q, k, v, lengths).astype(q.dtype)


def ragged_token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens):
  """Sequence id and position of every query row of a ragged batch.

  Args:
    cu_q_lens: i32[S + 1] cumulative query counts; kv_lens: i32[S]; num_seqs: i32[].
    num_tokens: T (static).
  Returns:
    (seq_ids i32[T] clamped into [0, S), positions i32[T] with -1 on padding rows).
  """
  num_seqs_max = kv_lens.shape[0]
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  live = jnp.arange(num_seqs_max, dtype=jnp.int32) < num_seqs
  ends = cu_q_lens[1:].astype(jnp.int32)
  seq_ids = jnp.sum(live[None, :] & (ends[None, :] <= t[:, None]), axis=1).astype(jnp.int32)
  seq_ids = jnp.minimum(seq_ids, num_seqs_max - 1)
  total = cu_q_lens[jnp.clip(num_seqs, 0, num_seqs_max)]
  starts = cu_q_lens[seq_ids]
  q_lens = cu_q_lens[seq_ids + 1] - starts
  positions = kv_lens[seq_ids] - q_lens + (t - starts)
  valid = (t < total) & (positions >= 0)
  return seq_ids, jnp.where(valid, positions, -1).astype(jnp.int32)


def ragged_paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                                     num_seqs, *, sm_scale=None, soft_cap=None,
                                     sliding_window=None, k_scales=None, v_scales=None,
                                     rows_per_step=16):
  """Mixed prefill + decode attention over a ragged batch of new queries.

  Sequence i's new queries are q[cu_q_lens[i]:cu_q_lens[i+1]] at positions
  kv_lens[i] - q_len_i ... kv_lens[i] - 1 (their K/V are already in the pages); causal.
  Rows at or past cu_q_lens[num_seqs] are padding and return zeros.

  Args:
    q: [T, Hq, D]; k_pages, v_pages: [Hkv, NB, bs, D]; block_tables: i32[S, P];
    kv_lens: i32[S]; cu_q_lens: i32[S + 1]; num_seqs: i32[] (<= S).
    rows_per_step: query rows handled per loop step (bounds memory at
      rows_per_step * Hkv * P * bs * D floats).
  Returns:
    [T, Hq, D] in q.dtype.
  Raises:
    ValueError naming a bad argument (`checks.check_ragged`), before any tracing.
  """
  checks.check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                      k_scales, v_scales)
  scale = checks.check_semantics(sm_scale, soft_cap, sliding_window,
                                 head_dim=q.shape[-1]).sm_scale
  k = gather_pages(k_pages, block_tables, k_scales)  # [S, Hkv, L, D]
  v = gather_pages(v_pages, block_tables, v_scales)
  kv_lens = kv_lens.astype(jnp.int32)
  seq_ids, positions = ragged_token_layout(cu_q_lens.astype(jnp.int32), kv_lens,
                                           jnp.asarray(num_seqs, jnp.int32), q.shape[0])

  def one_row(args):
    q_t, s, p = args
    return _attend(q_t[None], k[s], v[s], p[None], kv_lens[s], scale, soft_cap,
                   sliding_window)[0]

  out = jax.lax.map(one_row, (q, seq_ids, positions),
                    batch_size=max(1, min(rows_per_step, q.shape[0])))
  return out.astype(q.dtype)


def dense_attention(q, k, v, q_positions, kv_lens, *, sm_scale=None, soft_cap=None,
                    sliding_window=None):
  """Attention over a contiguous (unpaged) cache: the baseline the paged paths must match.

  Args:
    q: [B, Tq, Hq, D].
    k, v: [B, L, Hkv, D]; key j of sequence b sits at position j.
    q_positions: i32[B, Tq] position of each query (-1 = padding row -> zeros).
    kv_lens: i32[B] valid keys per sequence.
  Returns:
    [B, Tq, Hq, D] in q.dtype.
  """
  num_q_heads, head_dim = q.shape[2], q.shape[3]
  group = _check_heads(num_q_heads, k.shape[2])
  scale = _resolve_scale(sm_scale, head_dim)
  # Broadcast KV heads to query heads (a different route than the grouped einsum above).
  kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
  vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf,
                      precision=jax.lax.Precision.HIGHEST)
  logits = scaled_logits(logits, scale, soft_cap)
  key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, None, :]
  qp = q_positions.astype(jnp.int32)[:, None, :, None]
  visible = (key_pos < kv_lens[:, None, None, None]) & (key_pos <= qp) & (qp >= 0)
  if sliding_window is not None:
    visible &= key_pos > qp - sliding_window
  weights = masked_softmax_weights(logits, visible)
  key_ok = jnp.arange(k.shape[1])[None, :, None, None] < kv_lens[:, None, None, None]
  vf = jnp.where(key_ok, vf, 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, vf, precision=jax.lax.Precision.HIGHEST)
  return out.astype(q.dtype)
