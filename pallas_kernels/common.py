"""Small helpers every backend shares: integer arithmetic, the masked-logit value, the
split-K merge and the jax version.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

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
