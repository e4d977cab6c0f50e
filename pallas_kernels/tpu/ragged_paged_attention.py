"""Ragged paged attention on TPU (Pallas / Mosaic): prefill chunks and decodes in one call.

Sequence i's new queries are q[cu_q_lens[i] : cu_q_lens[i + 1]] at positions
kv_lens[i] - q_len_i ... kv_lens[i] - 1 (their K/V already written into the pages);
causal. Rows at or past cu_q_lens[num_seqs] are padding and come back as zeros.
Semantics: pallas_kernels/reference.py (`ragged_paged_attention_reference`).

The token axis is cut into blocks of `q_per_tile` tokens; the wrapper lays the queries out
as [blocks, Hkv, q_per_tile * G, D] (tokens x q-heads-per-KV-head as the MXU's rows, an
XLA transpose of q, not of the pool) and work.ragged_work lists the (block, sequence)
pairs. One grid program per (head block, query block) runs its pairs one after another;
each pair reads only the K/V tiles up to its last row's position (causal skipping) and
from its first row's window start (sliding window).

  q [T, Hq, D]; k_pages, v_pages [Hkv, NB, bs, D]; block_tables i32[S, P];
  kv_lens i32[S]; cu_q_lens i32[S + 1]; num_seqs i32[] or i32[1]  ->  [T, Hq, D].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tpu import attention_kernel
from pallas_kernels.tpu import checks
from pallas_kernels.tpu import tuning
from pallas_kernels.tpu import work
from pallas_kernels.tpu.paged_attention import interpret_params


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "tune", "interpret"))
def _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, k_scales,
            v_scales, *, sm_scale, soft_cap, sliding_window, tune: tuning.TpuTuning,
            interpret):
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  pages_per_seq = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  tq = tune.q_per_tile
  nblk = -(-num_tokens // tq)
  padded = nblk * tq
  if padded != num_tokens:
    q = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
  # [T, Hq, D] -> [blocks, Hkv, tq * G, D]: a block's rows for one KV head are its tokens
  # x that head's query heads (token-major, so row r is token r // G).
  q4 = q.reshape(nblk, tq, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  q4 = q4.reshape(nblk, num_kv_heads, tq * group, head_dim)
  wl = work.ragged_work(cu_q_lens, kv_lens, num_seqs, num_tokens=padded, q_per_tile=tq,
                        kv_per_tile=tune.kv_per_tile, block_size=block_size,
                        pages_per_seq=pages_per_seq, sliding_window=sliding_window)
  out = attention_kernel.attend(
      q4, k_pages, v_pages, block_tables, wl, k_scales, v_scales, decode=False, tune=tune,
      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, row_blocks=1,
      interpret=interpret, name="tpu_ragged_paged_attention")
  out = out.reshape(nblk, num_kv_heads, tq, group, head_dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(padded, num_q_heads, head_dim)[:num_tokens]


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           k_scales=None, v_scales=None, interpret=False, kv_per_tile=None,
                           q_per_tile=None, heads_per_tile=None, vmem_limit_bytes=None):
  """Mixed prefill + decode attention over paged K/V on a TPU (or its interpreter).

  Args:
    q: [T, Hq, D] bf16 / f32; sequence i's rows are cu_q_lens[i] : cu_q_lens[i + 1].
    k_pages, v_pages: [Hkv, NB, bs, D] (bf16, f32, or int8 / fp8 with scales).
    block_tables: i32[S, P]; kv_lens: i32[S] keys per sequence, the new ones included;
    cu_q_lens: i32[S + 1] cumulative query counts; num_seqs: i32[] (or [1]) live
      sequences (<= S).
    sm_scale, soft_cap, sliding_window, k_scales, v_scales, interpret: as
      `paged_attention`.
    kv_per_tile, q_per_tile, heads_per_tile, vmem_limit_bytes: tuning knobs
      (pallas_kernels/tpu/tuning.py), resolved into a frozen `TpuTuning`.
  Returns:
    [T, Hq, D] in q.dtype (padding rows zero).
  """
  if len(getattr(kv_lens, "shape", ())) != 1:
    raise ValueError(f"kv_lens must have shape (max_seqs,), got {getattr(kv_lens, 'shape', ())}")
  max_seqs = kv_lens.shape[0]
  _, _, head_dim = checks.check_common(
      q, k_pages, v_pages, block_tables, rows_name="num_tokens", num_rows=max_seqs,
      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
      k_scales=k_scales, v_scales=v_scales)
  checks.check_vector("kv_lens", kv_lens, max_seqs)
  checks.check_vector("cu_q_lens", cu_q_lens, max_seqs + 1)
  if tuple(getattr(num_seqs, "shape", ())) not in ((), (1,)):
    raise ValueError(f"num_seqs must be a scalar or shape (1,), got {num_seqs.shape}")
  tune = tuning.resolve_call("ragged", q, k_pages, block_tables, k_scales,
                             kv_per_tile=kv_per_tile, q_per_tile=q_per_tile,
                             heads_per_tile=heads_per_tile, vmem_limit_bytes=vmem_limit_bytes)
  return _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                 jnp.asarray(num_seqs, jnp.int32).reshape(()), k_scales, v_scales,
                 **checks.kernel_semantics(head_dim, sm_scale, soft_cap, sliding_window),
                 tune=tune, interpret=interpret_params(interpret))
