"""JAX's own Pallas TPU paged-attention kernels, called on our inputs (tests and reports).

  jax_ragged(...)   jax.experimental.pallas.ops.tpu.ragged_paged_attention (mixed batch);
                    its pages are [NB, bs, 2 * Hkv, D] with K and V interleaved on the head
                    axis, so `combined_pages` copies ours into that layout (tests only).
  jax_decode(...)   jax.experimental.pallas.ops.tpu.paged_attention (decode); its pages
                    are head-major [Hkv, NB, bs, D] like ours: no conversion.
  jax_rpa_block_sizes(chip, ...)  JAX's tuned (num_kv_pages_per_block,
                    num_queries_per_block) for a chip, read without a TPU present (its own
                    lookup asks jax.devices(), the CPU here).

Neither kernel takes an `interpret` argument: run them under
`pltpu.force_tpu_interpret_mode` on CPU. JAX's RPA kernel does not run there (jax 0.10.2
and 0.11.2: the TPU interpreter cannot read through its `ref.reshape` views, the HLO
interpreter fails on its scalar-prefetch indices), so on CPU it is checked through its
module's own reference `ref_ragged_paged_attention` (`jax_ragged_reference`) and proven as
a kernel by the deviceless compile only. Semantics line up with reference.py for valid inputs (q_len <= kv_len, no
stale-page NaN): JAX's RPA takes sm_scale and a per-tensor k/v scale only, JAX's decode
kernel has no sm_scale (q is pre-scaled here) and no sliding window.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

_CHIP_NAMES = {"v5e": "TPU v5", "v6e": "TPU v6", "v5p": "TPU v5", "v4": "TPU v4"}


def combined_pages(k_pages, v_pages):
  """[Hkv, NB, bs, D] x 2 -> [NB, bs, 2 * Hkv, D], K at even heads and V at odd (a copy)."""
  kt = jnp.transpose(k_pages, (1, 2, 0, 3))
  vt = jnp.transpose(v_pages, (1, 2, 0, 3))
  nb, bs, hkv, d = kt.shape
  return jnp.stack([kt, vt], axis=3).reshape(nb, bs, 2 * hkv, d)


def jax_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *,
               sm_scale=None, soft_cap=None, sliding_window=None, num_kv_pages_per_block,
               num_queries_per_block, vmem_limit_bytes=None, kv_pages=None):
  """JAX's ragged paged attention on our layout (`kv_pages` skips the conversion)."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # pylint: disable=g-import-not-at-top
  scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
  kv = combined_pages(k_pages, v_pages) if kv_pages is None else kv_pages
  return kernel.ragged_paged_attention(
      q, kv, kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
      cu_q_lens.astype(jnp.int32), jnp.asarray(num_seqs, jnp.int32).reshape(1),
      sm_scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes)


def jax_ragged_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                         *, sm_scale=None, soft_cap=None, sliding_window=None):
  """JAX's RPA module's own plain-jnp reference (`ref_ragged_paged_attention`) on our
  layout: eager (it loops over num_seqs in Python). Padding rows are left out of its
  result, so it returns only the cu_q_lens[num_seqs] live rows."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # pylint: disable=g-import-not-at-top
  scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
  return kernel.ref_ragged_paged_attention(
      q, combined_pages(k_pages, v_pages), kv_lens.astype(jnp.int32),
      block_tables.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
      jnp.asarray(num_seqs, jnp.int32).reshape(1), sm_scale=scale, soft_cap=soft_cap,
      sliding_window=sliding_window)


def jax_decode(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None, soft_cap=None,
               pages_per_compute_block):
  """JAX's paged decode attention (same head-major pages as ours; q pre-scaled)."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pa  # pylint: disable=g-import-not-at-top
  scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
  return pa.paged_attention(qs, k_pages, v_pages, lengths.astype(jnp.int32),
                            block_tables.astype(jnp.int32), attn_logits_soft_cap=soft_cap,
                            pages_per_compute_block=pages_per_compute_block)


def jax_rpa_block_sizes(chip, q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim,
                        block_size, num_tokens, pages_per_seq):
  """JAX's tuned (num_kv_pages_per_block, num_queries_per_block) for `chip`, as its
  `get_tuned_block_sizes` would pick on that chip (its heads-per-block rule included)."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tb  # pylint: disable=g-import-not-at-top
  q_heads_blk, kv_heads_blk = kernel.get_min_heads_per_blk(
      num_q_heads, 2 * num_kv_heads, jnp.dtype(q_dtype), jnp.dtype(kv_dtype))
  key = tb.simplify_key((q_dtype, kv_dtype, q_heads_blk, kv_heads_blk // 2, head_dim,
                         block_size, num_tokens, pages_per_seq))
  bkv, bq = tb.TUNED_BLOCK_SIZES.get(_CHIP_NAMES[chip], {}).get(key, (128, 32))
  return min(pages_per_seq, bkv), min(num_tokens, bq)
