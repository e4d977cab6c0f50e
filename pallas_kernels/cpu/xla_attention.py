r"""Paged attention in plain XLA ops, shaped for the CPU: the engine's attention off-GPU.

Same contracts and semantics as `reference.py` (which stays the oracle); what differs
is how the work is laid out for XLA:CPU, where gathers of K/V, not FLOPs, set the cost:

  decode   every sequence's pages are gathered once, head-major ([Hkv, B, L, D], no
           transposing copy), and scored with one fused multiply-reduce per product.
  ragged   the reference gathers each query token's whole K/V (a 256-token prefill
           chunk reads its row's cache 256 times). Here the new tokens are cut into
           query tiles of `tile_tokens` tokens that never straddle two sequences
           (pallas_kernels/tiling.py); a tile gathers its one sequence's K/V once and
           scores all of its tokens against it.

    out = decode_attention(q, k_pages, v_pages, block_tables, lengths)          # [B, Hq, D]
    out = ragged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                           num_seqs, tile_tokens=16)                              # [T, Hq, D]

Shapes: q [B or T, Hq, D]; k_pages / v_pages [Hkv, NB, bs, D] (any dtype; f32 math;
`k_scales` / `v_scales` f32[Hkv, NB, bs] for quantized pages); block_tables i32[S, P].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import reference
from pallas_kernels import tiling

_I32 = jnp.int32


def _gather(pages, idx, scales):
  """f32[Hkv, *idx.shape[:-1], P * bs, D]: the pages of each table row, head-major."""
  num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  idx = jnp.clip(idx.astype(_I32), 0, num_blocks - 1)
  out = pages[:, idx].astype(jnp.float32)            # [Hkv, ..., P, bs, D]
  if scales is not None:
    out = out * scales[:, idx].astype(jnp.float32)[..., None]
  return out.reshape(out.shape[:-3] + (idx.shape[-1] * block_size, head_dim))


def _softmax_out(logits, visible, v, scale, soft_cap):
  """logits f32[Hkv, N, G, Q, L] (Q queries of each of N items), visible bool broadcast
  to it, v f32[Hkv, N, L, D] -> f32[Hkv, N, G, Q, D]; rows with nothing visible -> 0.
  Scaling, soft cap and the masked softmax are the reference's own."""
  logits = reference.scaled_logits(logits, scale, soft_cap)
  w = reference.masked_softmax_weights(logits, visible)
  return jnp.einsum("hngql,hnld->hngqd", w, v)


def decode_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                     soft_cap=None, sliding_window=None, k_scales=None, v_scales=None):
  """One query per sequence at position lengths[b] - 1: q [B, Hq, D] -> [B, Hq, D].
  lengths i32[B] (0: the row returns zeros)."""
  checks.check_decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=q.shape[-1])
  sliding_window = sem.sliding_window
  num_seqs, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  group = num_q_heads // num_kv_heads
  k = _gather(k_pages, block_tables, k_scales)        # [Hkv, B, L, D]
  v = _gather(v_pages, block_tables, v_scales)
  max_len = k.shape[2]
  lengths = lengths.astype(_I32)
  key = jnp.arange(max_len, dtype=_I32)[None, :]
  visible = key < lengths[:, None]                     # [B, L]
  if sliding_window is not None:
    visible &= key > (lengths - 1)[:, None] - sliding_window
  # Zero invisible values: 0 * NaN from a stale page would otherwise poison the sum.
  v = jnp.where(visible[None, :, :, None], v, 0.0)
  qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, group, head_dim)
  qg = jnp.swapaxes(qg, 0, 1)[:, :, :, None, None, :]  # [Hkv, B, G, 1, 1, D]
  logits = jnp.sum(qg * k[:, :, None, None, :, :], axis=-1)   # [Hkv, B, G, 1, L]
  out = _softmax_out(logits, visible[None, :, None, None, :], v, sem.sm_scale, sem.soft_cap)
  out = jnp.swapaxes(out[:, :, :, 0, :], 0, 1)          # [B, Hkv, G, D]
  return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def ragged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *,
                     sm_scale=None, soft_cap=None, sliding_window=None, k_scales=None,
                     v_scales=None, tile_tokens: int = 16, tiles_per_step: int = 8):
  """Mixed prefill + decode attention: q [T, Hq, D] -> [T, Hq, D] (causal; sequence i's
  new queries are q[cu_q_lens[i]:cu_q_lens[i+1]] at positions kv_lens[i] - q_len_i ..
  kv_lens[i] - 1; padding rows return zeros). `tiles_per_step` tiles share one loop
  step (bounds memory at tiles_per_step x Hkv x P x bs x D floats per K and V)."""
  checks.check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                      k_scales, v_scales)
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=q.shape[-1])
  soft_cap, sliding_window = sem.soft_cap, sem.sliding_window
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  group = num_q_heads // num_kv_heads
  tile = max(1, min(tile_tokens, num_tokens))
  kv_lens = kv_lens.astype(_I32)
  tiles = tiling.query_tiles(cu_q_lens, kv_lens, jnp.asarray(num_seqs, _I32),
                             num_tokens=num_tokens, q_per_tile=tile)
  seq, local = tiles.seq, jnp.arange(tile, dtype=_I32)[None, :]
  ok = local < tiles.num_rows[:, None]                 # [N, C] real rows of each tile
  tokens = jnp.where(ok, tiles.row_start[:, None] + local, 0)
  pos = jnp.where(ok, tiles.pos_start[:, None] + local, -1)
  scale = sem.sm_scale
  qt = q.astype(jnp.float32)[tokens]                   # [N, C, Hq, D]

  def run(args):   # one tile (lax.map vmaps it over `tiles_per_step` tiles at a time)
    q_c, seq_c, pos_c = args                           # [C, Hq, D], [], [C]
    k = _gather(k_pages, block_tables[seq_c][None], k_scales)   # [Hkv, 1, L, D]
    v = _gather(v_pages, block_tables[seq_c][None], v_scales)
    key = jnp.arange(k.shape[2], dtype=_I32)
    key_ok = key < kv_lens[seq_c]                       # [L]
    v = jnp.where(key_ok[None, None, :, None], v, 0.0)
    visible = key_ok[None, :] & (key[None, :] <= pos_c[:, None])   # [C, L]
    if sliding_window is not None:
      visible &= key[None, :] > pos_c[:, None] - sliding_window
    qg = q_c.reshape(tile, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)[:, None]
    logits = jnp.einsum("hngqd,hnld->hngql", qg, k)     # [Hkv, 1, G, C, L]
    out = _softmax_out(logits, visible[None, None, None], v, scale, soft_cap)
    return out[:, 0].transpose(2, 0, 1, 3).reshape(tile, num_q_heads, head_dim)

  per_step = max(1, min(tiles_per_step, seq.shape[0]))
  out_t = jax.lax.map(run, (qt, seq, pos), batch_size=per_step)   # [N, C, Hq, D]
  rows = jnp.where(ok, tokens, num_tokens)
  out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
  out = out.at[rows.reshape(-1)].set(out_t.reshape(-1, num_q_heads, head_dim), mode="drop")
  return out.astype(q.dtype)
