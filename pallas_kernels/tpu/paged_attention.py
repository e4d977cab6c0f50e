"""Paged decode attention on TPU (Pallas / Mosaic): one query per sequence.

The decode specialisation of attention_kernel.py: the queries need no transpose
(q [B, Hq, D] is viewed as [B, Hkv, G, D], a free reshape), each pair is one sequence
whose query sits at position lengths[b] - 1 (no causal mask, no row mask), and one grid
program serves `seqs_per_tile` sequences so the per-program cost is shared.

Layout and semantics: pallas_kernels/reference.py (`paged_attention_reference`).
  q [B, Hq, D]; k_pages, v_pages [Hkv, NB, bs, D]; k_scales, v_scales f32[Hkv, NB, bs];
  block_tables i32[B, P]; lengths i32[B]  ->  [B, Hq, D]. Length 0 gives zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tpu import attention_kernel
from pallas_kernels.tpu import checks
from pallas_kernels.tpu import tuning
from pallas_kernels.tpu import work


def interpret_params(interpret):
  """False / True / a pltpu.InterpretParams -> what pallas_call takes."""
  if interpret is True:
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
    return pltpu.InterpretParams()
  return interpret


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "tune", "interpret"))
def _decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, *, sm_scale,
            soft_cap, sliding_window, tune: tuning.TpuTuning, interpret):
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  pages_per_seq = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  tb = min(tune.seqs_per_tile, batch)
  padded = -(-batch // tb) * tb
  q4 = q.reshape(batch, num_kv_heads, group, head_dim)               # free view
  lengths = lengths.astype(jnp.int32)
  if padded != batch:
    q4 = jnp.pad(q4, ((0, padded - batch), (0, 0), (0, 0), (0, 0)))
    lengths = jnp.pad(lengths, (0, padded - batch))
    block_tables = jnp.pad(block_tables, ((0, padded - batch), (0, 0)))
  wl = work.decode_work(lengths, seqs_per_tile=tb, kv_per_tile=tune.kv_per_tile,
                        block_size=block_size, pages_per_seq=pages_per_seq,
                        sliding_window=sliding_window)
  out = attention_kernel.attend(
      q4, k_pages, v_pages, block_tables, wl, k_scales, v_scales, decode=True, tune=tune,
      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, row_blocks=tb,
      interpret=interpret, name="tpu_paged_decode")
  return out[:batch].reshape(batch, num_q_heads, head_dim)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                    interpret=False, kv_per_tile=None, seqs_per_tile=None,
                    heads_per_tile=None, vmem_limit_bytes=None):
  """Decode attention over paged K/V on a TPU (or its interpreter on CPU).

  Args:
    q: [B, Hq, D] bf16 / f32, one query per sequence at position lengths[b] - 1.
    k_pages, v_pages: [Hkv, NB, bs, D] (bf16, f32, or int8 / fp8 with scales).
    block_tables: i32[B, P]; entries past a sequence's length are never read.
    lengths: i32[B] tokens in the cache, the current one included (0: zeros out).
    sm_scale: logit scale, None = 1/sqrt(D). soft_cap: c * tanh(logits / c).
    sliding_window: keys within the last W positions only.
    k_scales, v_scales: f32[Hkv, NB, bs] per-token dequantization scales.
    interpret: False (compile with Mosaic), True or a pltpu.InterpretParams (run the
      kernel in the TPU interpreter, on any backend).
    kv_per_tile, seqs_per_tile, heads_per_tile, vmem_limit_bytes: tuning knobs
      (pallas_kernels/tpu/tuning.py), resolved into a frozen `TpuTuning`.
  Returns:
    [B, Hq, D] in q.dtype.
  """
  _, _, head_dim = checks.check_common(
      q, k_pages, v_pages, block_tables, rows_name="batch", num_rows=q.shape[0],
      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
      k_scales=k_scales, v_scales=v_scales)
  checks.check_vector("lengths", lengths, q.shape[0])
  tune = tuning.resolve_call("decode", q, k_pages, block_tables, k_scales,
                             kv_per_tile=kv_per_tile, seqs_per_tile=seqs_per_tile,
                             heads_per_tile=heads_per_tile, vmem_limit_bytes=vmem_limit_bytes)
  return _decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales,
                 **checks.kernel_semantics(head_dim, sm_scale, soft_cap, sliding_window),
                 tune=tune, interpret=interpret_params(interpret))
