"""One entry point for paged attention, dispatching to a backend.

Backends:
  "reference"         plain jnp (pallas_kernels/reference.py), the oracle; any platform.
  "xla"               plain jnp laid out for XLA:CPU (pallas_kernels/xla_attention.py):
                      the same results, K/V gathered once per sequence or query tile.
  "cpu"               XLA:CPU custom calls, the block-table walk fused into an online
                      softmax (pallas_kernels/cpu_attention.py, C++ built on first use):
                      f32 q and pages; anything else, or no compiler, runs "xla".
  "pallas"            the Pallas Triton GPU kernels (pallas_kernels/*.py).
  "pallas_interpret"  the same kernels run by the Pallas interpreter (CPU tests).
  "auto"              "pallas" when jax.default_backend() == "gpu", else "cpu" (or "xla"
                      where the custom calls cannot be built).
  "pallas:triton", "pallas:mosaic_gpu", "pallas_interpret:triton",
  "pallas_interpret:mosaic_gpu"
                      the Pallas backends with the GPU kernel family forced; plain "pallas"
                      lets pallas_kernels choose (Mosaic GPU on sm_90 where supported, else
                      Triton; the choice is logged, see pallas_kernels/backends.py).

The engine builds one `AttentionMetadata` per step (fixed shapes, so the jitted step
traces once) and the model calls `attention_from_metadata` with it per layer. A step whose
metadata says `decode_only=True` (static: every live sequence has exactly one new token)
runs the decode kernel (`paged_attention`) instead of the ragged one.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

BACKENDS = ("auto", "reference", "xla", "cpu", "pallas", "pallas_interpret", "pallas:triton",
            "pallas:mosaic_gpu", "pallas_interpret:triton", "pallas_interpret:mosaic_gpu")


def _gpu_backend(backend: str):
  """"pallas_interpret:mosaic_gpu" -> (interpret, {"gpu_backend": "mosaic_gpu"})."""
  kind, _, gpu = backend.partition(":")
  return kind == "pallas_interpret", ({"gpu_backend": gpu} if gpu else {})


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


def resolve_backend(backend: str) -> str:
  """Maps "auto" to a concrete backend; raises ValueError on an unknown name."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "auto":
    if jax.default_backend() == "gpu":
      return "pallas"
    from pallas_kernels.cpu import custom_calls as cpu_attention  # pylint: disable=g-import-not-at-top
    return "cpu" if cpu_attention.unavailable_reason() is None else "xla"
  return backend


def _cpu_path_module(backend: str):
  """The module behind a CPU backend, "xla" or "cpu" (same signatures)."""
  if backend == "cpu":
    from pallas_kernels.cpu import custom_calls as cpu_attention  # pylint: disable=g-import-not-at-top
    return cpu_attention
  from pallas_kernels.cpu import xla_attention  # pylint: disable=g-import-not-at-top
  return xla_attention


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
  if backend in ("xla", "cpu"):
    return _cpu_path_module(backend).decode_attention(q, k_pages, v_pages, block_tables,
                                                       lengths, **_reference_kwargs(kw))
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  # The package binds the name to the kernel function (not the submodule of that name).
  interpret, gpu = _gpu_backend(backend)
  return pallas_kernels.paged_attention(q, k_pages, v_pages, block_tables, lengths,
                                        interpret=interpret, **gpu, **kw)


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
  if backend in ("xla", "cpu"):
    return _cpu_path_module(backend).ragged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
        **_reference_kwargs(kw))
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  kernel = getattr(pallas_kernels, "ragged_paged_attention", None)
  if kernel is None:
    raise NotImplementedError(
        "backend='pallas' for ragged attention needs pallas_kernels/ragged_paged_attention.py")
  interpret, gpu = _gpu_backend(backend)
  return kernel(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                interpret=interpret, **gpu, **kw)


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
  """Attention for a step described by `meta`: q [T, Hq, D] -> [T, Hq, D].

  `ragged_paged_attention` (any mix of prefill and decode rows), or, when
  `meta.decode_only`, `decode_from_metadata` (the decode kernel).
  """
  if meta.decode_only:
    return decode_from_metadata(q, k_pages, v_pages, meta, backend=backend, **kw)
  return ragged_paged_attention(q, k_pages, v_pages, meta.block_tables, meta.kv_lens,
                                meta.cu_q_lens, jnp.asarray(meta.num_seqs, jnp.int32),
                                backend=backend, **kw)


# Knobs of the ragged kernel only: a decode-only step drops them (the decode kernel has its
# own defaults), so one set of model kwargs serves both paths.
_RAGGED_ONLY_KWARGS = ("q_per_tile", "short_q_per_tile", "kv_per_tile", "kv_splits")


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
