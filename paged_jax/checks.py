"""Host-side integer checks and block arithmetic, the floor under `paged_jax.config`.

`check_int` is the one validator behind every one-line argument error of the library
(it names the argument and the allowed range); `cdiv` counts blocks; `consumed` tells
whether a donating call that failed took its arguments. This module imports nothing
from paged_jax; `config` re-exports `cdiv`, `check_block_size` and `check_int`, where
callers import them.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np


def cdiv(a, b):
  """Ceiling of a / b for ints or int arrays (b > 0): blocks needed for `a` tokens of `b`
  tokens per block."""
  return -(-a // b)


def check_int(name: str, value: Any, lo: int, hi: Optional[int] = None) -> None:
  """The one host-side int validator: TypeError unless `value` is an int (not a bool),
  ValueError naming `name` and the range unless lo <= value (<= hi)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
  if value < lo or (hi is not None and value > hi):
    rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise ValueError(f"{name} must be {rng}, got {value}")


def check_block_size(block_size: Any) -> None:
  """ValueError unless `block_size` is a power of two in [1, 1024] (tokens per KV block)."""
  check_int("block_size", block_size, 1, 1024)
  if block_size & (block_size - 1):
    raise ValueError(f"block_size must be a power of two in [1, 1024], got {block_size}")


def consumed(tree) -> bool:
  """Whether a donating call that raised had already taken (deleted) an array of `tree`:
  then the caller's copy is gone and must be rebuilt, or the caller cannot go on."""
  return any(getattr(x, "is_deleted", lambda: False)()
             for x in jax.tree_util.tree_leaves(tree))
