"""One entry point for paged attention; the backend is chosen in ONE table
(pallas_kernels/backends.py), keyed by (implementation, kernel family, interpret).

Backends (`BACKENDS`, the spellings the engine's `attention_backend` takes):
  "reference"         plain jnp (pallas_kernels/reference.py), the oracle; any platform.
  "xla"               plain jnp laid out for XLA:CPU (pallas_kernels/cpu/xla_attention.py):
                      the same results, K/V gathered once per sequence or query tile.
  "cpu"               XLA:CPU custom calls, the block-table walk fused into an online
                      softmax (pallas_kernels/cpu/custom_calls.py, C++ built on first use):
                      f32 q and pages; anything else, or no compiler, runs "xla".
  "pallas"            the Pallas GPU kernels, family chosen per call (Mosaic GPU on sm_90
                      where supported, else Triton; the choice is logged).
  "pallas_interpret"  the same kernels run by the Pallas interpreter (CPU tests).
  "pallas:triton", "pallas:mosaic_gpu", "pallas:tpu", and their "pallas_interpret:"
                      forms: the kernel family forced (pallas_kernels/triton/,
                      mosaic_gpu/, tpu/).
  "auto"              by the device the step runs or is compiled on (the abstract mesh's
                      device, jax's default device, or `where=` in `resolve_backend`):
                      "pallas" on a GPU, "pallas:tpu" on a TPU, else "cpu" (or "xla"
                      where the custom calls cannot be built).

Every backend checks shapes and dtypes before anything is traced (one-line ValueError
naming the argument, its shape and the expected one: pallas_kernels/checks.py).

The engine builds one `AttentionMetadata` per step (fixed shapes, so the jitted step
traces once) and the model calls `attention_from_metadata` with it per layer. A step whose
metadata says `decode_only=True` (static: every live sequence has exactly one new token)
runs the decode kernel (`paged_attention`) instead of the ragged one.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from pallas_kernels import backends

BACKENDS = backends.BACKENDS


@flax.struct.dataclass
class AttentionMetadata:
  """Per-step description of a ragged batch over the paged cache.

  Attributes:
    slot_mapping: i32[T] flat cache slot (block * block_size + offset) of each new token;
      -1 marks a padding row (not written).
    block_tables: i32[S, P] physical block of each logical block; entries past a
      sequence's length may be anything.
    kv_lens: i32[S] tokens in the cache of each sequence AFTER this step's writes.
    cu_q_lens: i32[S + 1] cumulative new-query counts; sequence i owns q rows
      cu_q_lens[i] : cu_q_lens[i + 1].
    num_seqs: i32[] live sequences (rows >= num_seqs are ignored).
    logits_indices: i32[S] row of q whose logits are wanted (last new token per sequence).
    decode_only: static (not a traced field; part of the jit cache key). True promises that
      every live sequence has exactly one new query (cu_q_lens[i + 1] - cu_q_lens[i] is 1,
      or 0 for a dead row), so attention runs the decode kernel; a sequence with more
      rows would get zeros. False (default): the ragged kernel, any mix.
  """
  slot_mapping: jax.Array
  block_tables: jax.Array
  kv_lens: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array
  logits_indices: jax.Array
  decode_only: bool = flax.struct.field(pytree_node=False, default=False)


def resolve_backend(backend: str, where=None) -> str:
  """The implementation "auto" stands for on the target device (`where`: a device or
  sharding the step is compiled for; default: the abstract mesh's or jax's default
  device), as a spelling; any other spelling is returned as is. ValueError on an unknown
  name."""
  return backends.resolve_implementation(backend, where).spelling


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, backend: str = "auto",
                    **kw):
  """Decode attention, one query per sequence: q [B, Hq, D] -> [B, Hq, D].

  k_pages/v_pages [Hkv, NB, bs, D], block_tables i32[B, P], lengths i32[B]. Keyword
  arguments: sm_scale, soft_cap, sliding_window, k_scales, v_scales (semantics in
  pallas_kernels/reference.py) and tuning knobs (taken by the Pallas family they belong
  to, ignored by reference / xla / cpu; an unknown name is a TypeError everywhere).
  """
  return backends.attend("decode", backend, (q, k_pages, v_pages, block_tables, lengths), kw)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, backend: str = "auto", **kw):
  """Mixed prefill + decode attention: q [T, Hq, D] -> [T, Hq, D].

  Sequence i's new queries are q[cu_q_lens[i]:cu_q_lens[i+1]] at positions
  kv_lens[i] - q_len_i .. kv_lens[i] - 1, causal; padding rows return zeros. Keyword
  arguments as `paged_attention`.
  """
  return backends.attend("ragged", backend, (q, k_pages, v_pages, block_tables, kv_lens,
                                             cu_q_lens, num_seqs), kw)


def attention_from_metadata(q, k_pages, v_pages, meta: AttentionMetadata, *,
                            backend: str = "auto", **kw):
  """Attention for a step described by `meta`: q [T, Hq, D] -> [T, Hq, D].

  `ragged_paged_attention` (any mix of prefill and decode rows), or, when
  `meta.decode_only`, `decode_from_metadata` (the decode kernel).
  """
  if meta.decode_only:
    return decode_from_metadata(q, k_pages, v_pages, meta, backend=backend, **kw)
  return ragged_paged_attention(q, k_pages, v_pages, meta.block_tables, meta.kv_lens,
                                meta.cu_q_lens, jnp.asarray(meta.num_seqs, jnp.int32),
                                backend=backend, **kw)


# Knobs no decode kernel takes (only ragged ones): a decode-only step drops them (the
# decode kernel has its own defaults), so one set of model kwargs serves both paths.
_RAGGED_ONLY_KWARGS = tuple(sorted(set(backends.all_knobs("ragged"))
                                   - set(backends.all_knobs("decode"))))


def decode_from_metadata(q, k_pages, v_pages, meta: AttentionMetadata, *,
                         backend: str = "auto", **kw):
  """A decode-only step through the decode kernel: q [T, Hq, D] -> [T, Hq, D].

  Sequence i's one query is row cu_q_lens[i]; sequences past num_seqs, or without a new
  row, get length 0 (the kernel returns zeros, nothing is read). The [S, Hq, D] answers
  are scattered back to their rows; every other row (padding) is zero, as the ragged path
  gives. Same result as the ragged path on any batch whose live sequences have one new
  token each.
  """
  num_rows, num_seqs = q.shape[0], meta.block_tables.shape[0]
  cu = meta.cu_q_lens.astype(jnp.int32)
  seq = jnp.arange(num_seqs, dtype=jnp.int32)
  live = (seq < jnp.asarray(meta.num_seqs, jnp.int32)) & (cu[1:] - cu[:-1] == 1)
  rows = jnp.where(live, cu[:-1], num_rows)            # out of range: dropped / filled
  q_dec = q.at[rows].get(mode="fill", fill_value=0)     # [S, Hq, D]
  lengths = jnp.where(live, meta.kv_lens, 0).astype(jnp.int32)
  kw = {k: v for k, v in kw.items() if k not in _RAGGED_ONLY_KWARGS}
  out = paged_attention(q_dec, k_pages, v_pages, meta.block_tables, lengths,
                        backend=backend, **kw)
  return jnp.zeros((num_rows,) + out.shape[1:], out.dtype).at[rows].set(out, mode="drop")
