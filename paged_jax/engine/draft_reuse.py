"""The draft model's K/V of prefix-cache hits: which blocks' draft K/V are whole, so that a
new sequence's draft catch-up (`draft_model.DraftModel`) skips its hit prefix.

The draft's pages sit on group 0's block ids. A prefix hit gives a sequence blocks whose
TARGET K/V are whole; their DRAFT K/V are whole only if some sequence caught the draft up
over the whole block while holding it, and nothing wrote the block's draft K/V since.
`valid_gen` (i32[NB], -1 none) records, per block, the prefix-cache generation
(`PrefixCacheState.block_gen`) at which a catch-up made its draft K/V whole
(`mark_whole`), and a block is reusable while it is registered at that generation
(`reusable`). Sound because:

  * a (block, generation) is one registration: its tokens are fixed; any later
    registration of the block bumps the generation (`prefix_cache.core.register`), a
    host-tier promotion included (target K/V only: its draft K/V are stale), and
    `prefix_cache.reset` keeps counting;
  * the draft's pages are written only by `draft_model.make_propose`: the catch-up writes
    a sequence's own tokens' K/V into its own blocks (a registered block gets the values
    it has), and the scratch K/V of the last token and the drafts go to the sequence's
    partial last block (never registered: not full) or to blocks free in the real state,
    which are never registered either (a cached block holds the cache's reference);
  * a block is marked only under the target's length (registered, whole) and under the
    positions whose draft K/V the sequence's record (`DraftModel.computed`) holds;
  * when a failed dispatch takes the donated pages, `valid_gen` is emptied with them.

Preemption by recompute frees a sequence's blocks (registered ones stay cached): on
readmission its hits are reusable too. Outputs never depend on this (they are the
target's); a wrong mark would only lower acceptance, which the self-draft tests pin at 1.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax.prefix_cache import state as pst

_I32 = jnp.int32


def _registered_under(bt, block_meta, num_blocks: int, block_size: int, end):
  """(block ids i32[R, P] clipped, bool[R, P]): the rows' blocks `bt` that are registered
  in the prefix cache and wholly under `end` (i32[R] positions)."""
  blk = jnp.clip(bt, 0, num_blocks - 1)
  return blk, ((bt >= 0) & (block_meta[blk, pst.CACHED] != 0)
               & ((lax.iota(_I32, bt.shape[1])[None, :] + 1) * block_size <= end[:, None]))


def mark_whole(valid_gen, block_meta, blocks: bm.BlockState, rs, end):
  """`valid_gen` with each row's registered blocks wholly under `end` (i32[R], the
  positions its draft K/V now hold) and under its target length (`blocks.seq_lens`) set
  to their generation (in `propose`, after the catch-up)."""
  nb = valid_gen.shape[0]
  blk, whole = _registered_under(blocks.block_tables[rs], block_meta, nb, blocks.block_size,
                                 jnp.minimum(end, blocks.seq_lens[rs]))
  return valid_gen.at[jnp.where(whole, blk, nb)].set(block_meta[blk, pst.GEN], mode="drop")


@functools.partial(jax.jit, static_argnames=("block_size",))
def reusable(valid_gen, block_meta, block_tables, row_slot, limit, *, block_size: int):
  """i32[R]: tokens of each row's leading blocks (slot `row_slot`, -1 none; at most
  `limit` tokens) registered at the generation `valid_gen` holds (`mark_whole`)."""
  blk, ok = _registered_under(block_tables[jnp.clip(row_slot, 0, block_tables.shape[0] - 1)],
                              block_meta, valid_gen.shape[0], block_size,
                              jnp.where(row_slot >= 0, limit, 0))
  ok &= block_meta[blk, pst.GEN] == valid_gen[blk]
  return jnp.sum(jnp.cumprod(ok.astype(_I32), axis=1), axis=1) * block_size
