"""Small helpers every backend shares: integer arithmetic, the masked-logit value, the
split-K merge, the jax version and the cost every attention kernel declares.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Finite "minus infinity" for masked logits: exp(MASK_VALUE - m) underflows to exactly 0
# for any real m, while MASK_VALUE - MASK_VALUE stays 0 (never NaN).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def next_pow2(x: int) -> int:
  """The smallest power of two >= x (1 for x <= 1)."""
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  """ceil(a / b) for Python ints."""
  return -(-a // b)


def jax_version() -> Tuple[int, ...]:
  """(major, minor, patch) of the installed jax."""
  return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def combine_splits(o, lse):
  """Merges split-K partials, each normalized by its own softmax sum.

  o: f32[..., splits, G, D]; lse: f32[..., splits, G] (natural log-sum-exp, -inf for a
  split that saw no key) -> f32[..., G, D] (zeros where no split saw a key).
  """
  lse_max = jnp.max(lse, axis=-2, keepdims=True)
  lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  w = jnp.exp(lse - lse_max)                      # 0 for empty splits (lse = -inf)
  denom = jnp.sum(w, axis=-2)
  out = jnp.sum(w[..., None] * o, axis=-3)
  return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def attention_cost(*, q_tokens: int, num_q_heads: int, kv_len: int, kv_reads: int,
                   num_kv_heads: int, head_dim: int, page_dtype, q_dtype, out_dtype=None,
                   quantized: bool = False, soft_cap=None, extra_bytes: int = 0
                   ) -> "pl.CostEstimate":
  """The `pl.CostEstimate` a paged attention kernel declares, from its static shapes.

  Shapes are static, lengths are not: every query row is charged the most keys it can see,
  so this is the kernel's upper bound (a decode step at full context meets it; a causal
  prefill does about half of it; sliding windows are not subtracted).

  Args:
    q_tokens: query tokens the kernel computes, padding included (decode: batch; ragged:
      query tiles x tokens per tile).
    num_q_heads: query rows per token as the kernel computes them (the GQA group padded to
      the kernel's row block, x KV heads).
    kv_len: keys one query row sees at most (pages_per_seq x block_size).
    kv_reads: K (and V) tokens the whole grid reads per KV head (each program its
      sequence's pages: programs per KV head x kv_len).
    num_kv_heads, head_dim: the pool's [Hkv, NB, bs, D] dims.
    page_dtype, q_dtype, out_dtype: element types (out_dtype None: q_dtype).
    quantized: int8 / fp8 pages, each token's K and V with an f32 scale per head.
    soft_cap: logit soft cap (a tanh per logit) or None.
    extra_bytes: other HBM traffic (split-K partials, block tables), bytes.
  Returns:
    pl.CostEstimate: flops = 4 q_tokens kv_len head_dim num_q_heads (QK^T and PV, a
    multiply-add = 2 flops); transcendentals = one exp per logit (two with soft_cap);
    bytes_accessed = K and V pages read + q read + out written + extra_bytes.
  """
  rows = int(q_tokens) * int(num_q_heads)
  logits = rows * int(kv_len)
  page_token = int(head_dim) * jnp.dtype(page_dtype).itemsize + (4 if quantized else 0)
  kv_bytes = 2 * int(kv_reads) * int(num_kv_heads) * page_token
  out_dtype = q_dtype if out_dtype is None else out_dtype
  q_out = rows * int(head_dim) * (jnp.dtype(q_dtype).itemsize + jnp.dtype(out_dtype).itemsize)
  return pl.CostEstimate(flops=4 * logits * int(head_dim),
                         transcendentals=logits * (1 if soft_cap is None else 2),
                         bytes_accessed=kv_bytes + q_out + int(extra_bytes))


def copy_cost(nbytes_read: int, nbytes_written: int, flops: int = 0) -> "pl.CostEstimate":
  """The `pl.CostEstimate` of a kernel that moves bytes (a K/V write, a probe): no
  transcendentals, `flops` (default none), bytes read + written."""
  return pl.CostEstimate(flops=int(flops), transcendentals=0,
                         bytes_accessed=int(nbytes_read) + int(nbytes_written))


def declared_cost(closed_jaxpr) -> dict:
  """The costs the Pallas kernels of a traced program declare, summed.

  closed_jaxpr: `jax.make_jaxpr(f)(*args)` (or a Jaxpr). Every equation carrying a
  `cost_estimate` param (pallas_call, and the mesh kernels of jax 0.11) counts; nested
  jaxprs are walked, a scan's body times its length, a while loop's body and each cond
  branch once (their trip counts / branch are not static). Returns {"flops",
  "transcendentals", "bytes_accessed", "kernels": calls counted, "undeclared": kernels
  without an estimate}.
  """
  out = dict(flops=0, transcendentals=0, bytes_accessed=0, kernels=0, undeclared=0)
  _walk(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), 1, out)
  return out


def _walk(jaxpr, times: int, out: dict) -> None:
  for eqn in jaxpr.eqns:
    if "cost_estimate" in eqn.params:
      cost = eqn.params["cost_estimate"]
      if cost is None:
        out["undeclared"] += times
      else:
        out["kernels"] += times
        for k in ("flops", "transcendentals", "bytes_accessed"):
          out[k] += times * int(getattr(cost, k))
      continue
    inner = times * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else times
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          _walk(sub, inner, out)
