"""Swap preemption: a sequence's K/V blocks to host memory and back.

`swap_out` copies the blocks of one slot to numpy (the engine frees the slot in
its next step); `swap_in` allocates fresh blocks for a slot and scatters the
saved pages into them, in one donated jit (evicting cached blocks first with
prefix caching). Block counts are padded to powers of
two (capped at max_blocks_per_seq) so only log2(max_blocks_per_seq) shapes trace.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.engine.step import EngineState, TRACE_COUNT
from paged_jax.prefix_cache import evict

_FIELDS = ("k", "v", "k_scale", "v_scale")


@dataclasses.dataclass
class SwappedKV:
  """Host copy of one sequence's pages.

  Attributes:
    num_tokens: tokens held (the slot's seq_len).
    pages: field name -> numpy [num_layers, num_kv_heads, bucket, block_size(, head_dim)],
      the first cdiv(num_tokens, block_size) blocks valid.
  """
  num_tokens: int
  pages: dict

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.pages.values())


def _bucket(num_blocks: int, cap: int) -> int:
  return min(cap, 1 << max(0, (num_blocks - 1).bit_length()))


@jax.jit
def _gather(pages, ids):
  TRACE_COUNT["swap_out"] += 1
  return {f: getattr(pages, f)[:, :, ids] for f in _FIELDS if getattr(pages, f) is not None}


def swap_out(state: EngineState, slot: int, num_tokens: int) -> SwappedKV:
  """Copies the first cdiv(num_tokens, bs) blocks of `slot` to host memory."""
  bs = state.blocks.block_size
  nblk = -(-num_tokens // bs)
  row = np.asarray(jax.device_get(state.blocks.block_tables[slot]))
  if nblk < 1 or np.any(row[:nblk] < 0):
    raise RuntimeError(f"swap_out: slot {slot} does not hold {num_tokens} tokens")
  width = _bucket(nblk, state.blocks.max_blocks_per_seq)
  ids = np.zeros((width,), np.int32)
  ids[:nblk] = row[:nblk]
  host = jax.device_get(_gather(state.pages, jnp.asarray(ids)))
  return SwappedKV(num_tokens=num_tokens, pages={k: np.asarray(v) for k, v in host.items()})


@functools.partial(jax.jit, donate_argnums=(0,))
def _swap_in(state: EngineState, slot, num_tokens, data):
  TRACE_COUNT["swap_in"] += 1
  blocks, prefix = state.blocks, state.prefix
  if prefix is not None:   # cached blocks nobody holds make room first
    bs = blocks.block_size
    cache, blocks, _ = evict.ensure_free(prefix.cache, blocks, (num_tokens + bs - 1) // bs,
                                         max_evict=blocks.max_blocks_per_seq)
    prefix = prefix.replace(cache=cache)
  blocks, status = bm.allocate(blocks, slot, num_tokens)
  width = next(iter(data.values())).shape[2]
  bs = blocks.block_size
  ids = blocks.block_tables[slot, :width]
  valid = (jnp.arange(width) < (num_tokens + bs - 1) // bs) & (status == 0)
  ids = jnp.where(valid, ids, blocks.num_blocks)     # out of range: dropped
  pages = state.pages
  updates = {f: getattr(pages, f).at[:, :, ids].set(x.astype(getattr(pages, f).dtype),
                                                    mode="drop") for f, x in data.items()}
  return EngineState(blocks=blocks, pages=pages.replace(**updates), prefix=prefix), status


def swap_in(state: EngineState, slot: int, saved: SwappedKV):
  """Allocates `slot` and restores its pages. Returns (state, status i32[]);
  on a non-OK status the state is unchanged."""
  return _swap_in(state, jnp.asarray(slot, jnp.int32), jnp.asarray(saved.num_tokens, jnp.int32),
                  {k: jnp.asarray(v) for k, v in saved.pages.items()})
