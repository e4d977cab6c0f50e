"""Prefix caching around the engine step: the device work before and after it.

`engine.step` (one jit) frees, forks, reserves, runs the model and samples. With
prefix caching, two small jitted functions bracket it, both pure and with no
host sync:

  before(cache, blocks, inputs, num_decode_steps)
      frees the slots the step would free (their cached blocks' LRU time is
      now, they join the eviction ring; the step's own free becomes a no-op) and evicts least-recently-used cache-only blocks until
      the step's worst-case block need fits on the free stack;
  after(cache, blocks, history, inputs, outputs)
      records every token whose K/V the step computed in `history` (i32[S,
      max_seq_len], the ids of each slot's computed tokens), copies history
      rows and registration chains along the step's forks, then registers
      every block that became full (`prefix_cache.register`).

Admission (`prefix_cache.attach`) runs before the step that prefills the rest.
Reading `history` instead of host lists keeps registration on device even for
blocks filled inside the multi-step decode loop.
"""

from __future__ import annotations

from typing import Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax import prefix_cache as pc

_I32 = jnp.int32


@flax.struct.dataclass
class PrefixStepState:
  """Device state of prefix caching in the engine (donated through every call).

  Attributes:
    cache: the PrefixCacheState.
    history: i32[max_seqs, max_seq_len], token id at each computed position of
      each slot (stale past the slot's length).
  """
  cache: pc.PrefixCacheState
  history: jax.Array


def init(cache_config, **cache_kwargs) -> PrefixStepState:
  """Empty cache and history for `cache_config` (kwargs go to `prefix_cache.init`)."""
  return PrefixStepState(
      cache=pc.init(cache_config, **cache_kwargs),
      history=jnp.zeros((cache_config.max_seqs, cache_config.max_seq_len), _I32))


def max_new_blocks(num_batched_tokens: int, max_seqs: int, block_size: int,
                   num_decode_steps: int) -> int:
  """Static bound on blocks one step can pop: chunks + a copy per slot + decode loop."""
  cd = lambda a: -(-a // block_size)
  return cd(num_batched_tokens) + 2 * max_seqs + max_seqs * cd(max(num_decode_steps - 1, 0))


def step_block_need(blocks: bm.BlockState, inputs, num_decode_steps: int):
  """i32[]: upper bound on the blocks the step pops (allocations, appends,
  copy-on-write, decode-loop growth), from the pre-step state."""
  bs = blocks.block_size
  cd = lambda a: (a + bs - 1) // bs
  lens = blocks.seq_lens
  alloc = jnp.where(inputs.alloc_tokens > 0, cd(inputs.alloc_tokens), 0)
  n = jnp.maximum(inputs.append_tokens, 0)
  grow = jnp.where(n > 0, cd(lens + n) - cd(lens) + (lens % bs != 0), 0)
  loop = jnp.where(inputs.multi_step & (inputs.sample_row >= 0),
                   cd(jnp.asarray(num_decode_steps - 1, _I32)) + 1, 0) if num_decode_steps > 1 else 0
  return jnp.sum(alloc + grow + loop).astype(_I32)


def before(ps: PrefixStepState, blocks: bm.BlockState, inputs, *, num_decode_steps: int,
           max_evict: int) -> Tuple[PrefixStepState, bm.BlockState]:
  """Frees `inputs.free_slots` (release + block_manager.free), then evicts for the
  step's block need. The step's own free of those slots is then a no-op (the
  caller passes `free_slots` = -1): blocks a freed slot shared with the cache
  must be cache-only before eviction looks at them."""
  cache, blocks, _ = pc.free(ps.cache, blocks, inputs.free_slots)
  need = step_block_need(blocks, inputs, num_decode_steps)
  cache, blocks, _ = pc.ensure_free(cache, blocks, need, max_evict=max_evict)
  return ps.replace(cache=cache), blocks


def _copy_rows(ps: PrefixStepState, src, dst) -> PrefixStepState:
  """History rows and chains src -> dst (i32[n], < 0 padding)."""
  s_max = ps.history.shape[0]
  ok = (src >= 0) & (dst >= 0)
  row = jnp.where(ok, dst, s_max)
  hist = ps.history.at[row].set(ps.history[jnp.clip(src, 0, s_max - 1)], mode="drop")
  cache = pc.fork_chain(ps.cache, jnp.where(ok, src, -1), jnp.where(ok, dst, -1))
  return ps.replace(history=hist, cache=cache)


def after(ps: PrefixStepState, blocks: bm.BlockState, inputs, outputs, *,
          max_items: int) -> Tuple[PrefixStepState, bm.BlockState, jax.Array]:
  """Records the step's tokens and registers the blocks it filled.

  Args:
    blocks: the BlockState the step returned.
    inputs: the step's StepInputs; outputs: its StepOutputs (`ok` False: the
      step changed nothing, and neither does this).
    max_items: static bound on blocks registered per call (`max_new_blocks`).
  Returns:
    (ps, blocks, available i32[]: free blocks plus evictable cached blocks).
  """
  # A failed step changed nothing: mask every write (no lax.cond returning the
  # states, which XLA:CPU would copy even when donated).
  ok = outputs.ok
  s_max, max_len = ps.history.shape
  bs = blocks.block_size
  slots = lax.iota(_I32, s_max)
  # Beam forks happened before the chunks: the child starts as its parent.
  ps = _copy_rows(ps, jnp.where(ok, inputs.fork_src, -1), inputs.fork_dst)
  # This step's chunk tokens at their positions.
  tr = inputs.token_row
  tslot = jnp.where(tr >= 0, inputs.row_slot[jnp.clip(tr, 0, s_max - 1)], -1)
  ok_t = ok & (tslot >= 0) & (inputs.positions >= 0) & (inputs.positions < max_len)
  hist = ps.history.at[jnp.where(ok_t, tslot, s_max), inputs.positions].set(
      inputs.tokens, mode="drop")
  ps = ps.replace(history=hist)
  # Parallel-sampling children share the leader's prompt after the prefill.
  post = jnp.where(ok, inputs.post_fork_src, -1)
  ps = _copy_rows(ps, post, jnp.where(post >= 0, slots, -1))
  # Decode-loop tokens: outputs.tokens[k, s] sits at position L1 + k, where L1
  # is the slot's length after the first forward; it was computed iff
  # valid[k + 1, s].
  k_steps = outputs.tokens.shape[0]
  if k_steps > 1:
    computed = outputs.valid[1:] & ok                                # [K-1, S]
    l1 = blocks.seq_lens - jnp.sum(computed.astype(_I32), axis=0)
    pos = l1[None, :] + lax.iota(_I32, k_steps - 1)[:, None]
    rows = jnp.where(computed, slots[None, :], s_max)
    ps = ps.replace(history=ps.history.at[rows, pos].set(outputs.tokens[:-1], mode="drop"))
  # Register every newly full block, slot by slot, in order.
  cache = ps.cache
  start = cache.chain_len
  full = blocks.seq_lens // bs
  todo = jnp.where(blocks.active & cache.chain_ok, jnp.maximum(full - start, 0), 0)
  offs = jnp.cumsum(todo) - todo
  total = jnp.where(ok, jnp.minimum(jnp.sum(todo), max_items), 0)
  i = lax.iota(_I32, max_items)
  owner = jnp.clip(jnp.searchsorted(offs + todo, i, side="right").astype(_I32), 0, s_max - 1)
  j = start[owner] + (i - offs[owner])
  valid = i < total
  item_slot = jnp.where(valid, owner, -1)
  item_block = jnp.where(valid, j, -1)
  tok_pos = jnp.clip(j, 0, max_len // bs - 1)[:, None] * bs + lax.iota(_I32, bs)[None, :]
  item_tokens = ps.history[owner[:, None], tok_pos]
  cache, blocks = pc.register(cache, blocks, item_slot, item_block, item_tokens, total)
  ps = ps.replace(cache=cache)
  available = blocks.num_free + pc.num_evictable(ps.cache, blocks)
  return ps, blocks, available
