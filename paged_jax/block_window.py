"""Hybrid KV for sliding-window layers: blocks that slid out of every live query's window
go back to the pool, as a pure op over a `BlockState` (inside the engine's one jit).

With hybrid KV (`CacheConfig.sliding_layers`) the sliding-window layers keep their K/V in
a pool of their own with its own `BlockState`: same slots, same logical blocks (position
p lives in logical block p // block_size), the same allocate / append / fork / free as the
main pool, plus `release_out_of_window` at the end of every step. A sequence holding L
tokens next queries at positions >= L, and a query at p sees keys at j > p - W (W the
window), so logical blocks k < (L - W + 1) // block_size can never be read again: their
entries become -1 and one reference each is dropped (a block forked to several slots
returns to the free stack when its last holder lets go). The last, partially filled block
is always kept (it holds position L - 1), so copy-on-write keeps working unchanged.

What this gives (vLLM v1's hybrid KV-cache manager does the same for its sliding-window
group): a sequence's sliding layers hold at most `pool_sizing.sliding_blocks_per_seq(W, bs,
tokens_per_step)` blocks however long it grows, against cdiv(L, bs) per full layer.
Attention reads a released entry as block 0 (`attention_tables`): those keys are out of
every window, so the kernels give them weight exactly 0 and the result is bit-identical.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_manager as bm

_I32 = jnp.int32


def first_visible_block(seq_lens: jax.Array, block_size: int, sliding_window: int):
  """i32[S]: first logical block a sequence of `seq_lens` tokens can still read (its next
  query is at position seq_lens or later, and sees keys > position - sliding_window)."""
  return jnp.maximum(seq_lens - sliding_window + 1, 0) // block_size


def release_out_of_window(state: bm.BlockState, sliding_window: int) -> bm.BlockState:
  """Releases, for every active slot, the blocks before `first_visible_block`.

  Args:
    state: the sliding pool's allocator.
    sliding_window: W >= 1 tokens (static).
  Returns:
    The state with those table entries set to -1, their references dropped and blocks
    whose last reference went pushed on the free stack. seq_lens / active unchanged.
  Cost: O(max_seqs * max_blocks_per_seq), no sort (`block_manager.release_references`).
  """
  table = state.block_tables
  keep_from = jnp.where(state.active,
                        first_visible_block(state.seq_lens, state.block_size, sliding_window), 0)
  col = lax.iota(_I32, table.shape[1])[None, :]
  drop = (col < keep_from[:, None]) & (table >= 0)
  state = bm.release_references(state, jnp.where(drop, table, -1).reshape(-1))
  return state.replace(block_tables=jnp.where(drop, -1, table))


def held_blocks(state: bm.BlockState) -> jax.Array:
  """i32[S]: blocks each slot's table holds (released and unused entries are -1)."""
  return jnp.sum((state.block_tables >= 0).astype(_I32), axis=1)


def attention_tables(tables: jax.Array) -> jax.Array:
  """Block tables for the kernels: released entries (-1) read block 0, a real block whose
  keys the window masks (weight 0), so no kernel ever sees an out-of-range id."""
  return jnp.maximum(tables, 0)
