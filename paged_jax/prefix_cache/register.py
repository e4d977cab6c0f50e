"""Registration of newly full blocks in the prefix cache (see the package docstring).

  register(cache, blocks, item_slot, item_block, item_tokens, num_items) -> (cache, blocks)
      item by item, in order (a loop: one iteration per item);
  register_runs(cache, blocks, first, count, history) -> (cache, blocks)
      each slot's run of blocks, depth by depth (all slots' first new block, then their
      second, ...): the slots of one depth whose lookups cannot meet (disjoint probe
      windows, distinct own blocks) register at once in a few scatters; the others one
      by one after them, in slot order. What the engine step calls.

A slot's next block is taken only if it continues the slot's chain (`block == chain_len`,
chain intact), the slot is active and holds that block completely, and the block is not
cached yet. An equal cached block (same content and parent) becomes the chain's next link
instead (no duplicate entry). A full probe window, a block already cached elsewhere or a
stale parent ends the slot's chain (its later blocks stay private: misses, never wrong
hits).
"""

from __future__ import annotations

import chex
import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax.prefix_cache import state as st
from paged_jax.prefix_cache.core import _probe, _window, chain_hash
from paged_jax.prefix_cache.state import PrefixCacheState, check_states

_I32 = jnp.int32


def _reads(c: PrefixCacheState, b: bm.BlockState, s, j, tok):
  """One item's lookups (slot `s`, logical block `j`, ids `tok` i32[bs]) on the states.

  Returns (go, insert, window start i32[], own block i32[], writes): `writes` are
  (row index, new row) for block_meta, table, chain and ref_count; each new row is the
  old one where nothing is to be written (go / insert False)."""
  bs, s_max = c.block_size, b.max_seqs
  nb, p = b.num_blocks, b.max_blocks_per_seq
  sc, jc = jnp.clip(s, 0, s_max - 1), jnp.clip(j, 0, p - 1)
  ch = c.chain[sc]                                   # the slot's chain row [6]
  parent, pgen = ch[st.C_BLOCK], ch[st.C_GEN]
  pm = c.block_meta[jnp.clip(parent, 0, nb - 1)]
  parent_live = (parent < 0) | ((pm[st.CACHED] != 0) & (pm[st.GEN] == pgen))
  go = ((s >= 0) & (s < s_max) & b.active[sc] & (ch[st.C_OK] != 0) & (j == ch[st.C_LEN])
        & (j < p) & (j < b.seq_lens[sc] // bs) & parent_live)
  h = chain_hash(st.as_u32(ch[st.C_HASH:st.C_HASH + 2]), tok, c.hash_mode)
  same = _probe(c, h, tok, j, parent, pgen)
  own = b.block_tables[sc, jc]
  oc = jnp.clip(own, 0, nb - 1)
  om = c.block_meta[oc]
  win = _window(c, h)
  empty = c.table[win] < 0
  pos = win[jnp.argmax(empty)]
  insert = go & (same < 0) & (own >= 0) & (om[st.CACHED] == 0) & jnp.any(empty)
  link = jnp.where(same >= 0, same, own)
  linked = go & ((same >= 0) | insert)
  gen = om[st.GEN] + 1
  h32 = st.as_i32(h)
  # The whole row of the inserted block, in `block_meta`'s column order.
  meta_row = jnp.concatenate([h32, jnp.stack([parent, pgen, gen, j, c.clock, 1, pos]), tok])
  # The link's generation (an inserted block's is `gen`; `same` is not written).
  new_gen = jnp.where(insert, gen, c.block_meta[jnp.clip(same, 0, nb - 1), st.GEN])
  chain_row = jnp.concatenate([
      jnp.stack([jnp.where(linked, link, parent), jnp.where(linked, new_gen, pgen)]),
      jnp.where(linked, h32, ch[st.C_HASH:st.C_HASH + 2]),
      jnp.stack([ch[st.C_LEN] + linked.astype(_I32), linked.astype(_I32)])])
  writes = ((oc, jnp.where(insert, meta_row, om)), (pos, jnp.where(insert, own, c.table[pos])),
            (sc, jnp.where(go, chain_row, ch)), (oc, b.ref_count[oc] + insert.astype(_I32)))
  return go, insert, win[0], own, writes


def _write(c: PrefixCacheState, b: bm.BlockState, w):
  (mi, mr), (ti, tr), (ci, cr), (ri, rr) = w
  c = c.replace(block_meta=st.put_row(c.block_meta, mi, mr), table=st.put_row(c.table, ti, tr),
                chain=st.put_row(c.chain, ci, cr))
  return c, b.replace(ref_count=st.put_row(b.ref_count, ri, rr))


def _one_by_one(cache: PrefixCacheState, blocks: bm.BlockState, item_slot, item_block,
                item_tokens, num_items):
  """Items [0, num_items) in order; no clock tick.

  Software-pipelined: iteration i first applies item i - 1's row writes, then reads and
  computes item i's. Each array then gets one in-place row update per iteration,
  ordered before every read of the iteration; writing at the end instead (reads of
  `block_meta` feeding the `chain` write and back) made XLA:CPU copy `block_meta` and
  `chain` twice per item. An idle write puts a row's own value back."""
  def body(i, carry):
    c, b, w = carry
    c, b = _write(c, b, w)
    return c, b, _reads(c, b, item_slot[i], item_block[i], item_tokens[i])[-1]

  zero = jnp.zeros((), _I32)
  idle = ((zero, cache.block_meta[0]), (zero, cache.table[0]), (zero, cache.chain[0]),
          (zero, blocks.ref_count[0]))
  cache, blocks, last = lax.fori_loop(0, num_items, body, (cache, blocks, idle))
  return _write(cache, blocks, last)


def register(cache: PrefixCacheState, blocks: bm.BlockState, item_slot, item_block,
             item_tokens, num_items):
  """Registers newly full blocks, item by item in order (see the module docstring).

  Item i says: logical block `item_block[i]` of slot `item_slot[i]` is full and holds
  ids `item_tokens[i]`.

  Args:
    item_slot, item_block: i32[R]; item_tokens: i32[R, block_size];
    num_items: i32[], items used (the rest are padding).
  Returns:
    (cache, blocks): registered blocks gain the cache's reference.
  """
  check_states(cache, blocks)
  item_slot, item_block = bm.int_arg(item_slot, "item_slot"), bm.int_arg(item_block, "item_block")
  item_tokens = bm.int_arg(item_tokens, "item_tokens", max_rank=2)
  chex.assert_rank(item_slot, 1, custom_message="item_slot")
  chex.assert_shape(item_block, item_slot.shape, custom_message="item_block vs item_slot")
  chex.assert_shape(item_tokens, item_slot.shape + (cache.block_size,),
                    custom_message="item_tokens [R, block_size]")
  num_items = bm.int_arg(num_items, "num_items", max_rank=0)
  num_items = jnp.minimum(num_items, item_slot.shape[0])
  cache, blocks = _one_by_one(cache, blocks, item_slot, item_block, item_tokens, num_items)
  return cache.replace(clock=cache.clock + 1), blocks


def register_runs(cache: PrefixCacheState, blocks: bm.BlockState, first, count, history):
  """Registers each slot's run of newly full blocks, depth by depth.

  Slot s registers its logical blocks first[s] .. first[s] + count[s] - 1, whose ids are
  in `history[s]`. Iteration k takes every slot's k-th block. Those of them whose
  registration can meet another's (probe windows that overlap, as equal hashes always
  do, or the same own block) register one by one after the rest, in slot order; the rest
  touch disjoint rows and table slots and see nothing the others write, so they
  register at once, by one scatter per array. Same outcome as `register` of the items
  in that order (depth-major, slots ascending within a depth).

  Args:
    first, count: i32[S] (count 0: nothing for the slot).
    history: i32[S, L], the ids at each computed position of each slot (L a multiple
      of block_size covering every registered block).
  Returns:
    (cache, blocks): registered blocks gain the cache's reference; the clock ticks once.
  Cost: max(count) iterations of S-wide lookups (one for a decode step), plus one
  sequential item per slot that met another.
  """
  check_states(cache, blocks)
  first, count = bm.int_arg(first, "first"), bm.int_arg(count, "count")
  chex.assert_shape([first, count], (blocks.max_seqs,), custom_message="first / count [S]")
  bs, s_max, nb = cache.block_size, blocks.max_seqs, blocks.num_blocks
  h_size, mp = cache.table_size, cache.max_probe
  lanes = lax.iota(_I32, s_max)
  other = lanes[:, None] != lanes[None, :]
  cols = lax.iota(_I32, bs)
  last_block = history.shape[1] // bs - 1
  each = jax.vmap(_reads, in_axes=(None, None, 0, 0, 0))

  def depth(k, carry):
    c, b = carry
    j = first + k
    slot = jnp.where(count > k, lanes, -1)
    tok = history[lanes[:, None], jnp.clip(j, 0, last_block)[:, None] * bs + cols[None, :]]
    go, insert, start, own, w = each(c, b, slot, j, tok)
    d = (start[None, :] - start[:, None]) & (h_size - 1)
    meet = ((d < mp) | (d > h_size - mp) | ((own[:, None] == own[None, :]) & (own[:, None] >= 0)))
    alone = go & ~jnp.any(meet & other & go[None, :], axis=1)
    (mi, mr), (ti, tr), (ci, cr), (ri, rr) = w
    put = alone & insert
    c = c.replace(block_meta=c.block_meta.at[jnp.where(put, mi, nb)].set(mr, mode="drop"),
                  table=c.table.at[jnp.where(put, ti, h_size)].set(tr, mode="drop"),
                  chain=c.chain.at[jnp.where(alone, ci, s_max)].set(cr, mode="drop"))
    b = b.replace(ref_count=b.ref_count.at[jnp.where(put, ri, nb)].set(rr, mode="drop"))
    # A slot's `go` depends on its own chain row only: the ones that met still go.
    rest = go & ~alone
    idx = jnp.nonzero(rest, size=s_max, fill_value=0)[0]
    return _one_by_one(c, b, slot[idx], j[idx], tok[idx], jnp.sum(rest.astype(_I32)))

  cache, blocks = lax.fori_loop(0, jnp.max(count, initial=0), depth, (cache, blocks))
  return cache.replace(clock=cache.clock + 1), blocks
