"""Cache salts: per-request namespaces of the prefix cache (`SamplingParams(cache_salt=...)`).

A request's chain of block hashes starts from its salt's root hash, and its first
block records the salt's tag (`core.PrefixCacheState.block_parent_gen` at depth 0),
which lookups compare exactly: requests with different salts never share a block, so
one tenant cannot learn by timing what another tenant's prompt began with (the reason
vLLM added `cache_salt`). Requests without a salt share the unsalted namespace.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Optional, Tuple

import numpy as np

from paged_jax.prefix_cache.core import ROOT_HASH


@functools.lru_cache(maxsize=4096)
def salt_key(salt: Optional[str]) -> Tuple[Tuple[int, int], int]:
  """((root hash lanes u32, u32), tag i32) of the chain a request salted `salt` starts.

  None gives (`ROOT_HASH`, 0). A salt's root and tag are a personalised BLAKE2b digest
  of its UTF-8 bytes (a tag is never 0, the unsalted tag).
  """
  if salt is None:
    return ROOT_HASH, 0
  d = hashlib.blake2b(salt.encode("utf-8"), digest_size=12, person=b"paged_jax.salt").digest()
  w = np.frombuffer(d, dtype="<u4")
  tag = int(w[2].view(np.int32)) or 1
  return (int(w[0]), int(w[1])), tag
