"""Tuning knobs of the TPU paged-attention kernels: one frozen dataclass, defaults, VMEM.

    tune = resolve(kind="ragged", q=..., pages=..., pages_per_seq=..., kv_per_tile=512)

Knobs (all optional keyword arguments of the public entries):
  kv_per_tile     K/V tokens per tile (a multiple of block_size): one double-buffered DMA
                  batch, one online-softmax step. Default 512 tokens (at least one page,
                  at most the block table's span).
  q_per_tile      ragged: query tokens per block (a grid program); its rows x heads-per-
                  KV-head make the MXU's M dimension. Default 128 / (q heads per KV head),
                  at least 8 and at most the padded token count.
  seqs_per_tile   decode: sequences per grid program (per-program overhead is paid once
                  for all of them). Default 8.
  heads_per_tile  KV heads per DMA and per program (divides num_kv_heads). Default: all,
                  shrunk while the VMEM estimate exceeds VMEM_BUDGET_BYTES.
  vmem_limit_bytes  Mosaic's scoped VMEM limit; default None (the chip's default scope,
                  16 MiB on v5e, 32 MiB on v6e), raised to fit the estimate when needed.

VMEM is counted the way Mosaic allocates it: every buffer's two minor dimensions padded
to the native tile (8 x 128 for 32-bit, 16 x 128 for 16-bit, 32 x 128 for 8-bit).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

VMEM_BUDGET_BYTES = 12 * 2**20   # under v5e's 16 MiB default scoped limit, with headroom
DEFAULT_KV_TOKENS = 512
DEFAULT_Q_ROWS = 128
DEFAULT_SEQS_PER_TILE = 8


@dataclasses.dataclass(frozen=True)
class TpuTuning:
  """Resolved knobs of one call (hashable: part of the jit cache key).

  Attributes:
    kv_per_tile: K/V tokens per tile (multiple of block_size).
    q_per_tile: query tokens per ragged block (1 for decode).
    seqs_per_tile: sequences per decode program (1 for ragged).
    heads_per_tile: KV heads per program.
    vmem_limit_bytes: Mosaic's scoped VMEM limit, or None for the chip's default.
  """
  kv_per_tile: int
  q_per_tile: int
  seqs_per_tile: int
  heads_per_tile: int
  vmem_limit_bytes: Optional[int] = None


def _pad(x: int, m: int) -> int:
  return -(-x // m) * m


def _tile_bytes(shape, dtype) -> int:
  """Bytes of a VMEM buffer: the two minor dims padded to Mosaic's native tile."""
  itemsize = jnp.dtype(dtype).itemsize
  sublanes = 8 * max(1, 4 // itemsize)
  *lead, rows, cols = (1,) * max(0, 2 - len(shape)) + tuple(shape)
  n = 1
  for d in lead:
    n *= d
  return n * _pad(rows, sublanes) * _pad(cols, 128) * itemsize


def vmem_bytes(*, kind: str, tune: TpuTuning, group: int, head_dim: int, block_size: int,
               q_dtype, page_dtype, quantized: bool) -> int:
  """VMEM the kernel's buffers take (q / out blocks double-buffered, K/V double-buffered).

  Mosaic adds internal scratch for the score tile and relayouts on top (compiled figures:
  experiments/tpu_compile_report.py).
  """
  ht, tk = tune.heads_per_tile, tune.kv_per_tile
  if kind == "decode":
    q_block = (tune.seqs_per_tile, ht, group, head_dim)
    rows = group
  else:
    rows = tune.q_per_tile * group
    q_block = (1, ht, rows, head_dim)
  total = 2 * 2 * _tile_bytes(q_block, q_dtype)                        # q and out
  total += 2 * 2 * _tile_bytes((ht, tk // block_size, block_size, head_dim), page_dtype)
  if quantized:
    total += 2 * 2 * _tile_bytes((ht, tk // block_size, tk), jnp.float32)
  total += 2 * _tile_bytes((ht, rows, 128), jnp.float32)               # m, l
  total += _tile_bytes((ht, rows, head_dim), jnp.float32)              # acc
  total += 2 * _tile_bytes((rows, tk), jnp.float32)                    # scores, probs
  return total


def resolve(*, kind: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
            block_size: int, pages_per_seq: int, num_rows: int, q_dtype, page_dtype,
            quantized: bool, kv_per_tile=None, q_per_tile=None, seqs_per_tile=None,
            heads_per_tile=None, vmem_limit_bytes=None) -> TpuTuning:
  """Fills the unset knobs with defaults and checks the set ones (ValueError)."""
  group = num_q_heads // num_kv_heads
  span = pages_per_seq * block_size
  if kv_per_tile is None:     # a power of two (block sizes are), at most 512, >= one page
    kv_per_tile = max(block_size, min(DEFAULT_KV_TOKENS, 1 << max(0, span - 1).bit_length()))
  if (kv_per_tile < block_size or kv_per_tile % block_size
      or (kv_per_tile % 128 and 128 % kv_per_tile)):
    raise ValueError(f"kv_per_tile={kv_per_tile} must be a multiple of block_size="
                     f"{block_size} that divides 128 or is a multiple of 128")
  if kind == "decode":
    q_per_tile = 1
    seqs_per_tile = DEFAULT_SEQS_PER_TILE if seqs_per_tile is None else seqs_per_tile
    if seqs_per_tile < 1:
      raise ValueError(f"seqs_per_tile={seqs_per_tile} must be >= 1")
  else:
    seqs_per_tile = 1
    if q_per_tile is None:
      q_per_tile = min(max(8, DEFAULT_Q_ROWS // group), _pad(max(num_rows, 1), 8))
    if q_per_tile < 1:
      raise ValueError(f"q_per_tile={q_per_tile} must be >= 1")
  if heads_per_tile is not None and (heads_per_tile < 1 or num_kv_heads % heads_per_tile):
    raise ValueError(f"heads_per_tile={heads_per_tile} must divide "
                     f"num_kv_heads={num_kv_heads}")
  if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
    raise ValueError(f"vmem_limit_bytes={vmem_limit_bytes} must be positive")

  def build(ht):
    return TpuTuning(kv_per_tile, q_per_tile, seqs_per_tile, ht, vmem_limit_bytes)

  def need(ht):
    return vmem_bytes(kind=kind, tune=build(ht), group=group, head_dim=head_dim,
                      block_size=block_size, q_dtype=q_dtype, page_dtype=page_dtype,
                      quantized=quantized)

  if heads_per_tile is None:
    heads_per_tile = num_kv_heads
    while heads_per_tile > 1 and need(heads_per_tile) > VMEM_BUDGET_BYTES:
      heads_per_tile = max(d for d in range(1, heads_per_tile) if num_kv_heads % d == 0)
  tune = build(heads_per_tile)
  if vmem_limit_bytes is None and need(heads_per_tile) > VMEM_BUDGET_BYTES:
    tune = dataclasses.replace(tune, vmem_limit_bytes=_pad(need(heads_per_tile) * 5 // 4,
                                                           2**20))
  return tune


def resolve_call(kind: str, q, k_pages, block_tables, k_scales, **knobs) -> TpuTuning:
  """`resolve` with the shapes read from an entry's checked arguments: q [rows, Hq, D],
  k_pages [Hkv, NB, bs, D], block_tables i32[rows, P]; quantized when k_scales is given."""
  num_kv_heads, _, block_size, head_dim = k_pages.shape
  return resolve(kind=kind, num_q_heads=q.shape[1], num_kv_heads=num_kv_heads,
                 head_dim=head_dim, block_size=block_size, pages_per_seq=block_tables.shape[1],
                 num_rows=q.shape[0], q_dtype=q.dtype, page_dtype=k_pages.dtype,
                 quantized=k_scales is not None, **knobs)
