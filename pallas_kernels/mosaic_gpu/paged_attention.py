"""Paged decode attention as a Pallas kernel on the Mosaic GPU backend (Hopper, sm_90a).

One query token per sequence attends to that sequence's K/V pages, scattered through a
shared pool. The kernel reads `lengths[b]` and the block table as scalars from global
memory and gathers the live pages with TMA into a shared-memory ring; wgmma does QK^T and
PV; softmax is online (the pipeline: mosaic_gpu/pipeline.py). The same code runs under
GPU interpret mode on a CPU (jax >= 0.11.2).

Grid: (num_kv_heads, batch, num_splits), one warpgroup per program. One program serves all
query heads of one KV head (GQA / MQA): its query tile is the group padded to wgmma's 64
rows. Split-K ("flash-decoding"): each sequence's live tiles are divided evenly between the
`num_splits` programs of a (sequence, KV head) at run time; each split writes a normalized
partial and its log-sum-exp, and the wrapper merges them stably.

Supported (anything else: use the Triton kernel; `supported_reason` says why, and
`backends.paged_attention(gpu_backend="auto")` falls back to Triton by itself):
  * q bfloat16 or float16; pages of q's dtype, or int8 / float8_e4m3fn with f32 per-token
    k_scales / v_scales (TMA into 8-bit rings, converted per step into a q-dtype tile in
    shared memory; scales multiply logits and probabilities); no float32;
  * block_size a power of two >= 16 (smaller pages fall back to Triton: a TMA slice of
    the swizzled tile must cover whole 8-row swizzle groups and a page per copy is too
    little work below that);
  * head_dim 64, 128 or 256 (the 128-byte swizzle needs D % 64 == 0);
  * num_q_heads / num_kv_heads <= 64 (one wgmma M tile).

Layout (semantics in pallas_kernels/reference.py):
  q [B, Hq, D]; k_pages, v_pages [Hkv, NB, bs, D]; block_tables i32[B, P]; lengths i32[B]
  -> [B, Hq, D].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import common
from pallas_kernels import reference
from pallas_kernels.mosaic_gpu import pipeline as core
# Re-exported: the support checks and smem model are part of this module's surface.
from pallas_kernels.mosaic_gpu.pipeline import (  # pylint: disable=unused-import
    SM90_SHARED_MEMORY_BYTES, check_num_stages, default_num_stages,
    interpret_unavailable_reason, shared_memory_bytes, supported_reason)

_Q_ROWS = core.Q_ROWS


def default_num_splits(batch, num_kv_heads, pages_per_seq, block_size, tile_kv,
                       target_programs=264, max_splits=32) -> int:
  """Enough programs to fill 132 SMs about twice, no split shorter than two tiles."""
  max_tiles = -(-pages_per_seq * block_size // tile_kv)
  want = -(-target_programs // (batch * num_kv_heads))
  return int(max(1, min(want, max_tiles // 2, max_splits)))


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Static launch parameters of the kernel (part of its jit key).

  Attributes:
    num_splits: split-K partitions per (sequence, KV head), in [1, 256].
    tile_kv: keys per loop step, 64 or 128 (several whole pages, or one page slice).
    num_stages: depth of the shared-memory K/V ring, in [1, 8] and within sm_90's 227 KiB.
  """
  num_splits: int
  tile_kv: int
  num_stages: int

  def __post_init__(self):
    checks.check_int("num_splits", self.num_splits, 1, 256)
    core.check_tile_kv(self.tile_kv)
    checks.check_int("num_stages", self.num_stages, 1, 8)

  @classmethod
  def resolve(cls, shapes: checks.AttentionShapes, *, num_splits=None, tile_kv=64,
              num_stages=None) -> "TuningConfig":
    """The given knobs, checked, and defaults for the rest (`default_num_splits`, the
    deepest ring that fits: `pipeline.default_num_stages`)."""
    tile_kv = core.check_tile_kv(tile_kv)
    if num_splits is None:
      num_splits = default_num_splits(shapes.rows, shapes.num_kv_heads, shapes.pages_per_seq,
                                      shapes.block_size, tile_kv)
    checks.check_int("num_splits", num_splits, 1, 256)
    stages = core.check_num_stages(num_stages, shapes.head_dim, tile_kv,
                                   1 if shapes.quantized else None)
    return cls(num_splits=int(num_splits), tile_kv=tile_kv, num_stages=stages)


def _decode_kernel(
    lengths_ref,  # i32[B] (GMEM, read as scalars)
    tables_ref,   # i32[B, P] (GMEM, read as scalars)
    q_ref,        # [B, Hkv, 64, D] (GMEM) query group of each KV head, zero-padded rows
    k_ref,        # [Hkv, NB, bs, D] (GMEM)
    v_ref,        # [Hkv, NB, bs, D] (GMEM)
    ks_ref,       # f32[Hkv, NB, bs] (GMEM) per-token K scales, or None (float pages)
    vs_ref,       # f32[Hkv, NB, bs] (GMEM) per-token V scales, or None
    o_ref,        # [B, Hkv, S, 64, D] (GMEM) per-split output, normalized by its own sum
    lse_ref,      # f32[B, Hkv, S, 64] (GMEM) per-split log-sum-exp, -inf when empty
    scratch, *, sliding_window, **pipeline):
  h, b, split = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("s")
  _, num_blocks, block_size, _ = k_ref.shape
  pages_per_seq = tables_ref.shape[1]
  # Live tokens [start_tok, end_tok): the query at end_tok - 1 sees all of them.
  end_tok = jnp.clip(lengths_ref[b], 0, pages_per_seq * block_size)
  start_tok = (jnp.int32(0) if sliding_window is None
               else jnp.maximum(end_tok - sliding_window, 0))

  core.attend_pages(
      scratch, q_ref.at[b, h], k_ref, v_ref, ks_ref, vs_ref, o_ref.at[b, h, split],
      lse_ref.at[b, h, split], h=h, page_of=core.page_lookup(tables_ref, b, num_blocks),
      start_tok=start_tok, end_tok=end_tok,
      live_fn=lambda key: (key >= start_tok) & (key < end_tok), split=split, **pipeline)


@functools.partial(jax.jit, static_argnames=("sem", "cfg", "interpret"))
def _paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, *,
                     sem: checks.Semantics, cfg: TuningConfig, interpret: bool):
  num_splits, tile_kv = cfg.num_splits, cfg.tile_kv
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  dtype = q.dtype
  q4 = q.reshape(batch, num_kv_heads, group, head_dim)
  q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, _Q_ROWS - group), (0, 0)))   # [B, Hkv, 64, D]
  inputs = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32), q4, k_pages, v_pages]
  o, lse = core.launch(
      _decode_kernel, inputs, k_pages, k_scales, v_scales, sem=sem, cfg=cfg, dtype=dtype,
      out_lead=(batch, num_kv_heads, num_splits), grid=(num_kv_heads, batch, num_splits),
      grid_names=("h", "b", "s"),
      name=f"paged_decode_mgpu_bs{block_size}_tile{tile_kv}_splits{num_splits}",
      interpret=interpret)

  if num_splits == 1:
    out = o[:, :, 0].astype(jnp.float32)
  else:
    out = common.combine_splits(o.astype(jnp.float32), lse)
  return out[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(dtype)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                    interpret=False, num_splits=None, tile_kv=64, num_stages=None):
  """Decode attention over a paged KV cache on the Mosaic GPU backend (sm_90a).

  Args:
    q: [B, Hq, D] bfloat16 / float16; D in {64, 128, 256}; Hq / Hkv <= 64.
    k_pages, v_pages: [Hkv, NB, bs, D] in q's dtype, or int8 / float8_e4m3fn with scales;
      bs a power of two >= 16.
    block_tables: i32[B, P]; entries past a sequence's length are never used (clamped).
    lengths: i32[B] (query at position lengths[b] - 1); 0 gives zeros; clamped to P * bs.
    sm_scale: default 1/sqrt(D). soft_cap: c * tanh(logits / c). sliding_window: W.
    k_scales, v_scales: f32[Hkv, NB, bs] per-token scales of int8 / fp8 pages, else None.
    interpret: run under Mosaic GPU interpret mode on a CPU (jax >= 0.11.2), with race
      detection on.
    num_splits: split-K partitions per (sequence, KV head); default `default_num_splits`.
    tile_kv: keys per loop step, 64 or 128 (several whole pages, or one page slice).
    num_stages: depth of the shared-memory K/V ring (default: the deepest of 3, 2, 1 that
      fits in 227 KiB; 3 at D <= 128 with tile_kv 64).
  Returns:
    [B, Hq, D] in q's dtype, accumulated in float32.
  Raises:
    ValueError naming the argument (checks.check_decode), or what this kernel does not
    support (`supported_reason`), before any tracing.
  """
  shapes = checks.check_decode(q, k_pages, v_pages, block_tables, lengths, k_scales,
                               v_scales)
  core.check_supported("paged_attention", shapes, bool(interpret))
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=shapes.head_dim)
  cfg = TuningConfig.resolve(shapes, num_splits=num_splits, tile_kv=tile_kv,
                             num_stages=num_stages)
  return _paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales,
                          sem=sem, cfg=cfg, interpret=bool(interpret))


# The plain-jnp oracle of this op (same arguments, no tuning knobs): pallas_kernels/reference.py.
paged_attention_reference = reference.paged_attention_reference
