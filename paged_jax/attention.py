"""One entry point for paged attention, dispatching to a backend.

Backends:
  "reference"         plain jnp (pallas_kernels/reference.py); any platform.
  "pallas"            the Pallas Triton GPU kernels (pallas_kernels/*.py).
  "pallas_interpret"  the same kernels run by the Pallas interpreter (CPU tests).
  "auto"              "pallas" when jax.default_backend() == "gpu", else "reference".

The engine builds one `AttentionMetadata` per step (fixed shapes, so the jitted step
traces once) and the model calls `ragged_paged_attention` with it per layer.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

BACKENDS = ("auto", "reference", "pallas", "pallas_interpret")


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
  """
  slot_mapping: jax.Array
  block_tables: jax.Array
  kv_lens: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array
  logits_indices: jax.Array


def resolve_backend(backend: str) -> str:
  """Maps "auto" to a concrete backend; raises ValueError on an unknown name."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "reference"
  return backend


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, backend: str = "auto",
                    **kw):
  """Decode attention, one query per sequence: q [B, Hq, D] -> [B, Hq, D].

  k_pages/v_pages [Hkv, NB, bs, D], block_tables i32[B, P], lengths i32[B]. Keyword
  arguments (sm_scale, soft_cap, sliding_window, k_scales, v_scales and, for the Pallas
  backends, tuning knobs) pass through; see pallas_kernels/reference.py for semantics.
  """
  backend = resolve_backend(backend)
  if backend == "reference":
    from pallas_kernels import reference  # pylint: disable=g-import-not-at-top
    kw = _reference_kwargs(kw)
    return reference.paged_attention_reference(q, k_pages, v_pages, block_tables, lengths,
                                               **kw)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  # The package binds the name to the kernel function (not the submodule of that name).
  return pallas_kernels.paged_attention(q, k_pages, v_pages, block_tables, lengths,
                                        interpret=(backend == "pallas_interpret"), **kw)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, backend: str = "auto", **kw):
  """Mixed prefill + decode attention: q [T, Hq, D] -> [T, Hq, D].

  Sequence i's new queries are q[cu_q_lens[i]:cu_q_lens[i+1]] at positions
  kv_lens[i] - q_len_i .. kv_lens[i] - 1, causal; padding rows return zeros.
  """
  backend = resolve_backend(backend)
  if backend == "reference":
    from pallas_kernels import reference  # pylint: disable=g-import-not-at-top
    kw = _reference_kwargs(kw)
    return reference.ragged_paged_attention_reference(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, **kw)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  kernel = getattr(pallas_kernels, "ragged_paged_attention", None)
  if kernel is None:
    raise NotImplementedError(
        "backend='pallas' for ragged attention needs pallas_kernels/ragged_paged_attention.py")
  return kernel(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                interpret=(backend == "pallas_interpret"), **kw)


_REFERENCE_KWARGS = ("sm_scale", "soft_cap", "sliding_window", "k_scales", "v_scales")
# Tuning knobs of the Pallas kernels (decode, ragged): meaningless to the reference.
_TUNING_KWARGS = ("num_splits", "tile_tokens", "num_warps", "num_stages", "q_per_tile",
                  "kv_per_tile", "kv_splits")


def _reference_kwargs(kw):
  """Keeps the semantic arguments, drops kernel tuning knobs, rejects anything else (so a
  misspelled argument fails on CPU too, not only on the GPU backend)."""
  unknown = sorted(set(kw) - set(_REFERENCE_KWARGS) - set(_TUNING_KWARGS))
  if unknown:
    raise TypeError(f"unexpected attention arguments {unknown}; semantic arguments are "
                    f"{_REFERENCE_KWARGS}, tuning knobs {_TUNING_KWARGS}")
  return {k: v for k, v in kw.items() if k in _REFERENCE_KWARGS}


def attention_from_metadata(q, k_pages, v_pages, meta: AttentionMetadata, *,
                            backend: str = "auto", **kw):
  """`ragged_paged_attention` with its sequence description taken from `meta`."""
  return ragged_paged_attention(q, k_pages, v_pages, meta.block_tables, meta.kv_lens,
                                meta.cu_q_lens, jnp.asarray(meta.num_seqs, jnp.int32),
                                backend=backend, **kw)
