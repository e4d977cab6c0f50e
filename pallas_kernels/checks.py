"""Shape, dtype and argument checks shared by every attention backend, run before anything
is traced or dispatched.

    shapes = check_decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    shapes = check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                          k_scales, v_scales)
    sem = check_semantics(sm_scale, soft_cap, sliding_window, head_dim=shapes.head_dim)

Every backend (reference, xla, cpu, each Pallas family) calls these first, so a bad call
fails the same way on all of them: a one-line ValueError naming the argument, its shape
(or dtype) and the expected one, e.g.

    block_tables has shape (3, 4); expected [batch=2, pages_per_seq] (q has shape (2, 8, 64))

The shape and dtype assertions are chex's (`chex.assert_shape`, `chex.assert_type`), their
AssertionError turned into that ValueError. What only one backend refuses (a head_dim
Triton cannot tile, float32 on Mosaic GPU) is checked in that backend's op file, after
these. Knob checks (`check_int`, `check_choice`) serve the ops' tuning configs.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import chex
import jax.numpy as jnp
import numpy as np

from pallas_kernels import scale_rows

# A dimension of an expected shape: (label, size) with size None for "any".
Dim = Tuple[str, Optional[int]]


class AttentionShapes(NamedTuple):
  """Static sizes of one attention call, read from its (already checked) arguments.

  Attributes:
    rows: rows of q: the batch B (decode) or the new tokens T (ragged).
    num_q_heads, num_kv_heads, head_dim: Hq, Hkv (divides Hq), D.
    num_blocks, block_size: NB pages of bs tokens in the pool.
    num_seqs: S, rows of the block table (B for decode).
    pages_per_seq: P, columns of the block table.
    q_dtype, page_dtype: numpy dtypes of q and of the pages.
    quantized: per-token k_scales / v_scales are given.
  """
  rows: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  num_blocks: int
  block_size: int
  num_seqs: int
  pages_per_seq: int
  q_dtype: np.dtype
  page_dtype: np.dtype
  quantized: bool

  @property
  def group(self) -> int:
    """Query heads per KV head."""
    return self.num_q_heads // self.num_kv_heads


class Semantics(NamedTuple):
  """The resolved semantic arguments: sm_scale (1/sqrt(D) when None), soft_cap, window."""
  sm_scale: float
  soft_cap: Optional[float]
  sliding_window: Optional[int]


def _show(dims: Sequence[Dim]) -> str:
  return "[" + ", ".join(label if size is None else f"{label}={size}"
                         for label, size in dims) + "]"


def expect_shape(name: str, x, dims: Sequence[Dim], context: str = "") -> None:
  """chex.assert_shape(x, dims) as a one-line ValueError naming `name`."""
  try:
    chex.assert_shape(x, tuple(size for _, size in dims))
  except AssertionError:
    raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {_show(dims)}"
                     f"{f' ({context})' if context else ''}") from None


def _expect_array(name: str, x) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array (jax.Array, np.ndarray or ShapeDtypeStruct), "
                    f"got {type(x).__name__}")


def _dtype_name(x) -> str:
  return jnp.dtype(x.dtype).name


def _expect_kind(name: str, x, kind, what: str) -> None:
  """chex.assert_type(x, kind) as a one-line ValueError (kind: float or int)."""
  try:
    chex.assert_type(x, kind)
  except AssertionError:
    raise ValueError(f"{name} has dtype {_dtype_name(x)} (shape {tuple(x.shape)}); "
                     f"expected {what}") from None


def _check_pool(q, k_pages, v_pages, k_scales, v_scales, q_dims: Sequence[str]):
  """q, the pages and the scales; returns (Hq, D, Hkv, NB, bs)."""
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    _expect_array(name, x)
  expect_shape("q", q, [(d, None) for d in q_dims])
  _, num_q_heads, head_dim = q.shape
  q_ctx = f"q has shape {tuple(q.shape)}"
  expect_shape("k_pages", k_pages, [("num_kv_heads", None), ("num_blocks", None),
                                    ("block_size", None), ("head_dim", head_dim)], q_ctx)
  num_kv_heads, num_blocks, block_size, _ = k_pages.shape
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(f"k_pages has shape {tuple(k_pages.shape)}; expected num_kv_heads "
                     f"(dim 0) >= 1 dividing num_q_heads={num_q_heads} ({q_ctx})")
  expect_shape("v_pages", v_pages, list(zip(
      ("num_kv_heads", "num_blocks", "block_size", "head_dim"), k_pages.shape)),
               "k_pages' shape")
  _expect_kind("q", q, float, "a floating dtype")
  page_dtype = jnp.dtype(k_pages.dtype)
  if not (jnp.issubdtype(page_dtype, jnp.floating) or page_dtype == jnp.int8):
    raise ValueError(f"k_pages has dtype {page_dtype.name}; expected a floating dtype or "
                     f"int8")
  if jnp.dtype(v_pages.dtype) != page_dtype:
    raise ValueError(f"v_pages has dtype {_dtype_name(v_pages)}; expected k_pages' dtype "
                     f"{page_dtype.name}")
  if (k_scales is None) != (v_scales is None):
    given = "k_scales" if k_scales is not None else "v_scales"
    raise ValueError(f"{given} is given without its pair; expected both k_scales and "
                     f"v_scales f32{list(k_pages.shape[:3])}, or neither")
  for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
    if s is not None:
      _expect_array(name, s)
      if not scale_rows.is_rows(s, num_blocks, block_size):   # rows: the TPU kernels' form
        expect_shape(name, s, [("num_kv_heads", num_kv_heads), ("num_blocks", num_blocks),
                               ("block_size", block_size)],
                     "k_pages' first three dims (or scale rows "
                     f"{list(scale_rows.rows_shape(num_kv_heads, num_blocks, block_size))})")
      elif s.shape[0] != num_kv_heads:
        raise ValueError(f"{name} has shape {tuple(s.shape)}; expected num_kv_heads="
                         f"{num_kv_heads} scale rows")
      _expect_kind(name, s, float, "a floating dtype (float32)")
  return num_q_heads, head_dim, num_kv_heads, num_blocks, block_size


def _check_indices(name: str, x, dims: Sequence[Dim], context: str) -> None:
  _expect_array(name, x)
  expect_shape(name, x, dims, context)
  _expect_kind(name, x, int, "an integer dtype (int32)")


def check_decode(q, k_pages, v_pages, block_tables, lengths, k_scales=None,
                 v_scales=None) -> AttentionShapes:
  """Checks a decode call: q [B, Hq, D], k/v_pages [Hkv, NB, bs, D] (Hkv divides Hq),
  block_tables int[B, P >= 1], lengths int[B], k/v_scales float[Hkv, NB, bs] (or the same
  as scale rows f32[Hkv, ceil(NB * bs / 128), 128], pallas_kernels/scale_rows.py) or None."""
  num_q_heads, head_dim, num_kv_heads, num_blocks, block_size = _check_pool(
      q, k_pages, v_pages, k_scales, v_scales, ("batch", "num_q_heads", "head_dim"))
  batch = q.shape[0]
  ctx = f"q has shape {tuple(q.shape)}"
  _check_indices("block_tables", block_tables, [("batch", batch), ("pages_per_seq", None)],
                 ctx)
  if block_tables.shape[1] < 1:
    raise ValueError(f"block_tables has shape {tuple(block_tables.shape)}; expected "
                     f"pages_per_seq >= 1")
  _check_indices("lengths", lengths, [("batch", batch)], ctx)
  return AttentionShapes(batch, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                         batch, block_tables.shape[1], jnp.dtype(q.dtype),
                         jnp.dtype(k_pages.dtype), k_scales is not None)


def check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                 k_scales=None, v_scales=None) -> AttentionShapes:
  """Checks a ragged call: q [T, Hq, D], pages and scales as `check_decode`, block_tables
  int[S >= 1, P >= 1], kv_lens int[S], cu_q_lens int[S + 1], num_seqs an int in [0, S] or
  an integer scalar array."""
  num_q_heads, head_dim, num_kv_heads, num_blocks, block_size = _check_pool(
      q, k_pages, v_pages, k_scales, v_scales, ("num_tokens", "num_q_heads", "head_dim"))
  _check_indices("block_tables", block_tables, [("num_seqs", None), ("pages_per_seq", None)],
                 "one row per sequence")
  num_seqs_max, pages_per_seq = block_tables.shape
  if num_seqs_max < 1 or pages_per_seq < 1:
    raise ValueError(f"block_tables has shape {tuple(block_tables.shape)}; expected "
                     f"[num_seqs >= 1, pages_per_seq >= 1]")
  ctx = f"block_tables has shape {tuple(block_tables.shape)}"
  _check_indices("kv_lens", kv_lens, [("num_seqs", num_seqs_max)], ctx)
  _check_indices("cu_q_lens", cu_q_lens, [("num_seqs+1", num_seqs_max + 1)], ctx)
  if isinstance(num_seqs, (int, np.integer)) and not isinstance(num_seqs, bool):
    if not 0 <= num_seqs <= num_seqs_max:
      raise ValueError(f"num_seqs must be in [0, {num_seqs_max}] (rows of block_tables), "
                       f"got {num_seqs}")
  elif not (hasattr(num_seqs, "shape") and tuple(num_seqs.shape) in ((), (1,))
            and jnp.issubdtype(num_seqs.dtype, jnp.integer)):
    shape = getattr(num_seqs, "shape", None)
    raise ValueError(f"num_seqs has shape {shape} ({type(num_seqs).__name__}); expected an "
                     f"int or an integer scalar array of shape ()")
  return AttentionShapes(q.shape[0], num_q_heads, num_kv_heads, head_dim, num_blocks,
                         block_size, num_seqs_max, pages_per_seq, jnp.dtype(q.dtype),
                         jnp.dtype(k_pages.dtype), k_scales is not None)


def _positive(name: str, value) -> Optional[float]:
  if value is None:
    return None
  try:
    out = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}") from None
  if not (math.isfinite(out) and out > 0):
    raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
  return out


def check_semantics(sm_scale, soft_cap, sliding_window, *, head_dim: int) -> Semantics:
  """sm_scale and soft_cap finite and > 0 (or None), sliding_window an int >= 1 (or
  None); the static values every backend computes with."""
  scale = _positive("sm_scale", sm_scale)
  window = sliding_window
  if window is not None:
    ok = not isinstance(window, bool) and isinstance(window, (int, float, np.integer))
    if not ok or int(window) != window or window < 1:
      raise ValueError(f"sliding_window must be an int >= 1 or None, got {window!r}")
    window = int(window)
  return Semantics(1.0 / math.sqrt(head_dim) if scale is None else scale,
                   _positive("soft_cap", soft_cap), window)


def check_int(name: str, value, lo: int, hi: Optional[int] = None, *, pow2: bool = False,
              why: Optional[str] = None) -> int:
  """A tuning knob: an int in [lo, hi] (a power of two if `pow2`); one-line ValueError
  naming the knob, its allowed range and, when given, the reason for the bound."""
  ok = (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        and lo <= value and (hi is None or value <= hi))
  if ok and pow2:
    ok = value & (value - 1) == 0
  if not ok:
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    kind = "a power of two in " if pow2 else ("an int in " if hi is not None else "an int ")
    raise ValueError(f"{name} must be {kind}{rng}{f' ({why})' if why else ''}, got {value!r}")
  return int(value)


def check_choice(name: str, value, allowed: Sequence) -> None:
  """One-line ValueError unless `value` is one of `allowed`."""
  if isinstance(value, bool) or value not in tuple(allowed):
    raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
