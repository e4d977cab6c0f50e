"""The prefix cache's block hash: a chained 64-bit hash (two u32 lanes) of a block's
parent hash and its `block_size` token ids, the same arithmetic traced (jnp, inside the
step) and on the host (numpy, the host tier's lookups).

The hash only finds candidates: `core.lookup` also compares stored token ids, depth and
parent, so a collision never shares wrong K/V.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_SEEDS = (0x9E3779B9, 0x7F4A7C15)
_MULS = (0x85EBCA6B, 0xC2B2AE35)


def _fmix32(h, xp=jnp):
  """MurmurHash3's 32-bit finalizer (a bijection with full avalanche)."""
  h = h ^ (h >> 16)
  h = h * xp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * xp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def chain_hash(parent_hash, tokens, hash_mode: str = "chained", xp=jnp):
  """u32[..., 2]: hash of a block given its parent's hash u32[..., 2] and ids i32[..., bs].

  Each lane sums position-tagged, avalanche-mixed token terms (order
  sensitive, vectorized over the block) and folds in both parent lanes. `xp`: jnp
  (traced, the default) or numpy (the host tier's lookups: `host_chain_hashes`), the
  same arithmetic (u32, wrapping).
  """
  if hash_mode == "constant":
    return xp.zeros(xp.broadcast_shapes(parent_hash.shape[:-1], tokens.shape[:-1]) + (2,),
                    xp.uint32)
  u32 = xp.uint32
  t = tokens.astype(u32)
  pos = xp.arange(tokens.shape[-1], dtype=u32) + u32(1)
  p0, p1 = parent_hash[..., 0], parent_hash[..., 1]
  lanes = []
  for lane in range(2):
    terms = _fmix32(t * u32(_MULS[lane]) + pos * u32(_SEEDS[1 - lane]) + u32(_SEEDS[lane]), xp)
    body = xp.sum(terms, axis=-1, dtype=u32)
    parent = _fmix32((p0 if lane == 0 else p1) ^ _fmix32((p1 if lane == 0 else p0)
                                                         + u32(_SEEDS[lane]), xp), xp)
    lanes.append(_fmix32(body ^ parent ^ u32((tokens.shape[-1] * 0x27D4EB2F) & 0xFFFFFFFF), xp))
  return xp.stack(lanes, axis=-1)


def host_chain_hashes(tokens, num_blocks: int, block_size: int, root) -> np.ndarray:
  """u32[num_blocks, 2], on the host (numpy): the chained hashes of the first
  `num_blocks` full blocks of `tokens` from the salt root `root` (u32[2]), as the device
  computes them (`chain_hash`)."""
  out = np.zeros((num_blocks, 2), np.uint32)
  h = np.asarray(root, np.uint32).reshape(1, 2)
  tok = np.asarray(tokens[:num_blocks * block_size], np.int32).reshape(num_blocks, block_size)
  with np.errstate(over="ignore"):
    for j in range(num_blocks):
      h = chain_hash(h, tok[j:j + 1], xp=np)
      out[j] = h[0]
  return out
