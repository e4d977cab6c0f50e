"""Automatic prefix caching as pure, jittable ops over `BlockState`.

A *full* block of a sequence is registered under a chained 64-bit hash (two
u32 lanes) of its parent block's hash and its own `block_size` token ids. A
later request walks its prompt block by block from the root; block j is a hit
only when a cached block has the same hash AND the same stored token ids AND
the same depth j AND its recorded parent is exactly the block hit at j - 1 in
that block's current generation. So a hash collision can never share wrong
K/V (the hash only finds candidates), and a stale child of an evicted and
reused parent is never reachable (the parent's generation moved on).

Cache salt (`SamplingParams(cache_salt=...)`, vLLM's per-tenant isolation): a
salted request's chain starts from the salt's root hash instead of `ROOT_HASH`
(`salt.salt_key`), and its depth-0 blocks record the salt's tag where other blocks
record their parent's generation, so blocks of requests with different salts
never match, even under a hash collision (the tag is compared exactly).

Reference counting: the cache holds ONE reference on every cached block, on
top of the block-table references. A cached block no sequence uses therefore
has `ref_count == 1` (the paper's "ref count 0, content kept") and is never on
the free stack: `block_manager.free` needs no change. When an allocation finds
too few free blocks, `ensure_free` evicts cache-only blocks, least recently
used first and, among blocks last used at the same time, the deepest (a
sequence's tail) first, pushing them on the free stack. Never-cached free
blocks are thus used before any cached one. The LRU order is kept by a ring of
released blocks (`prefix_cache_evict`), so eviction is amortized O(1) per
evicted block, never a scan of the pool.

Lookup: an open-addressing table `table i32[H]` (H = power of two >= 2 *
num_blocks) maps a hash to block ids; a block is searched in the window of
`max_probe` slots starting at `hash & (H - 1)`, so one looked-up block costs
O(max_probe * block_size), independent of num_blocks. Insertion takes the
window's first empty slot; a full window leaves the block uncached (a miss
later, never a wrong hit).

Per-slot registration chain: `chain_*[slot]` remember the canonical cached
block for the slot's last registered logical block. When a slot's newly full
block duplicates an already cached one (two requests computed the same prefix
at once), the cached one becomes the chain's parent and the duplicate stays
private (freed normally), so the children still register.

Ops (all return new states; jit them with both states donated). Each first checks its
arguments' shapes and dtypes with chex (`state.check_states`: at trace time under jit);
`init` is in `state`, release .. reset in `evict`:
  init(cache_config, ...)                      -> PrefixCacheState
  lookup(cache, tokens, length)                -> (num_hit_blocks i32[], block_ids i32[P])
  attach(cache, blocks, slot, tokens, length)  -> (cache, blocks, hit_tokens, status)
      = attach_reads (-> AttachWrites, hit_tokens, status) + attach_write
  register(cache, blocks, item_slot, item_block, item_tokens, num_items) -> (cache, blocks)
  fork_chain(cache, src_slot, dst_slot)        -> cache
  release(cache, blocks, slot_mask)            -> (cache, blocks)  LRU time now, onto the ring
  free(cache, blocks, slots)                   -> (cache, blocks, status)  release + bm.free
  ensure_free(cache, blocks, num_needed, max_evict=...) -> (cache, blocks, num_evicted)
  reset(cache, blocks)                         -> (cache, blocks)
(the counters num_cached_blocks, num_evictable, hit_rate are in `state`)
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax.config import INVALID, OK, TOO_LONG
from paged_jax.prefix_cache import state as st
# Re-exported: callers read `core.chain_hash` / `core.host_chain_hashes` as before.
from paged_jax.prefix_cache.hashing import chain_hash, host_chain_hashes  # noqa: F401
from paged_jax.prefix_cache.state import ROOT_HASH, PrefixCacheState, check_states

_I32, _U32 = jnp.int32, jnp.uint32
def _window(cache: PrefixCacheState, h):
  """i32[max_probe]: table slots searched for hash `h` (u32[2])."""
  start = (h[0] & _U32(cache.table_size - 1)).astype(_I32)
  return (start + lax.iota(_I32, cache.max_probe)) & (cache.table_size - 1)


def _probe(cache: PrefixCacheState, h, tokens, depth, parent, parent_gen):
  """The cached block equal to (h, tokens, depth, parent, parent_gen), or -1."""
  cand = cache.table[_window(cache, h)]
  m = cache.block_meta[jnp.clip(cand, 0, cache.num_blocks - 1)]    # [max_probe, K]
  match = ((cand >= 0) & (m[:, st.CACHED] != 0)
           & jnp.all(m[:, st.HASH:st.HASH + 2] == st.as_i32(h), axis=-1)
           & (m[:, st.DEPTH] == depth)
           & (m[:, st.PARENT] == parent) & (m[:, st.PARENT_GEN] == parent_gen)
           & jnp.all(m[:, st.TOKENS:] == tokens[None, :], axis=-1))
  return jnp.where(jnp.any(match), cand[jnp.argmax(match)], -1)


# ---- lookup / attach -----------------------------------------------------------------

def lookup(cache: PrefixCacheState, tokens, length, root=None, tag=0):
  """Longest cached prefix of a prompt, in whole blocks; changes nothing.

  Args:
    tokens: i32[L] prompt ids (padded; entries past `length` ignored).
    length: i32[] prompt length. At most `(length - 1) // block_size` blocks
      can hit, so at least the last prompt token is recomputed (its logits
      are needed) and it lands in a fresh, uncached block.
    root, tag: u32[2] / i32[], the request's salt (`salt.salt_key`; default unsalted).
  Returns:
    (num_hit_blocks i32[], block_ids i32[L // block_size], -1 past the hits,
    hashes u32[L // block_size, 2] of the hit blocks).
  Cost: one window probe per hit block plus one for the first miss.
  """
  check_states(cache)
  tokens = bm.int_arg(tokens, "tokens")
  chex.assert_rank(tokens, 1, custom_message="tokens")
  length = bm.int_arg(length, "length", max_rank=0)
  bs = cache.block_size
  n_max_static = tokens.shape[0] // bs
  blocks_tok = tokens[:n_max_static * bs].reshape(n_max_static, bs)
  limit = jnp.clip((length - 1) // bs, 0, n_max_static)

  def cond(c):
    j, _, _, _, _, go = c
    return go & (j < limit)

  def body(c):
    j, parent, pgen, h_par, ids, _ = c
    tok = blocks_tok[j]
    h = chain_hash(h_par, tok, cache.hash_mode)
    hit = _probe(cache, h, tok, j, parent, pgen)
    ok = hit >= 0
    hc = jnp.clip(hit, 0, cache.num_blocks - 1)
    ids = ids.at[j].set(hit)
    return (j + ok.astype(_I32), jnp.where(ok, hit, parent),
            jnp.where(ok, cache.block_meta[hc, st.GEN], pgen), jnp.where(ok, h, h_par), ids, ok)

  root = jnp.asarray(ROOT_HASH if root is None else root, _U32)
  init_c = (jnp.zeros((), _I32), jnp.full((), -1, _I32), jnp.asarray(tag, _I32), root,
            jnp.full((n_max_static,), -1, _I32), jnp.ones((), jnp.bool_))
  n_hit, _, _, _, ids, _ = lax.while_loop(cond, body, init_c)
  ids = jnp.where(lax.iota(_I32, n_max_static) < n_hit, ids, -1)
  return n_hit, ids


def attach(cache: PrefixCacheState, blocks: bm.BlockState, slot, tokens, length, root=None,
           tag=0):
  """Activates inactive `slot` holding its prompt's longest cached prefix.

  The hit blocks join the slot's table (ref_count += 1 each), `seq_lens[slot]
  = hits * block_size`; the caller then appends (prefills) the rest. With no
  hit the slot is active and empty. The slot's registration chain starts after
  the hits.

  Args:
    slot: i32[] in [0, max_seqs), inactive.
    tokens: i32[L] prompt ids (L >= length, static); length: i32[] in [1, max_seq_len].
    root, tag: u32[2] / i32[], the request's salt (`salt.salt_key`; default unsalted): its
      chain starts there, so it hits only blocks registered under the same salt.
  Returns:
    (cache, blocks, hit_tokens i32[], status i32[]): INVALID (slot out of range
    or active, length < 1 or > L), TOO_LONG (length > max_seq_len); on failure
    both states are returned unchanged.
  """
  writes, hit_tokens, status = attach_reads(cache, blocks, slot, tokens, length, root, tag)
  cache, blocks = attach_write(cache, blocks, writes)
  return cache, blocks, hit_tokens, status


def attach_reads(cache: PrefixCacheState, blocks: bm.BlockState, slot, tokens, length,
                 root=None, tag=0, hit_rule=None):
  """`attach`'s lookup, without writing: (AttachWrites, hit_tokens i32[], status i32[]);
  `attach_write` applies the writes. A loop over prompts applies one prompt's writes at the
  start of the next iteration (`prefix_cache.step.attach`), so XLA updates the states in
  place instead of copying them each iteration. `hit_rule` (n_hit i32[], ids i32[P]) ->
  i32[] <= n_hit: the hit another KV group can serve (`prefix_cache.sliding.hit_rule`)."""
  check_states(cache, blocks)
  slot = bm.int_arg(slot, "slot", max_rank=0)
  tokens = bm.int_arg(tokens, "tokens")
  chex.assert_rank(tokens, 1, custom_message="tokens")
  length = bm.int_arg(length, "length", max_rank=0)
  bs, s_max, p = cache.block_size, blocks.max_seqs, blocks.max_blocks_per_seq
  sc = jnp.clip(slot, 0, s_max - 1)
  bad = (slot < 0) | (slot >= s_max) | blocks.active[sc] | (length < 1) | (
      length > tokens.shape[0])
  too_long = ~bad & (length > blocks.max_seq_len)
  ok = ~bad & ~too_long
  status = jnp.where(bad, INVALID, jnp.where(too_long, TOO_LONG, OK)).astype(_I32)
  root = jnp.asarray(ROOT_HASH if root is None else root, _U32)
  tag = jnp.asarray(tag, _I32)
  n_hit, ids = lookup(cache, tokens, jnp.where(ok, length, 0), root, tag)
  n_hit = jnp.minimum(n_hit, p)
  ids = ids[:p] if ids.shape[0] >= p else jnp.pad(ids, (0, p - ids.shape[0]), constant_values=-1)
  n_hit = n_hit if hit_rule is None else hit_rule(n_hit, ids)
  ids = jnp.where(lax.iota(_I32, p) < n_hit, ids, -1)
  nb = blocks.num_blocks
  keys = jnp.where(ids >= 0, ids, nb)
  row = jnp.where(ok, sc, s_max)
  last = jnp.where(n_hit > 0, ids[jnp.maximum(n_hit - 1, 0)], -1)
  lc = jnp.clip(last, 0, nb - 1)
  queried = jnp.where(ok, jnp.clip((length - 1) // bs, 0, p), 0)
  last_meta = cache.block_meta[lc]
  h_last = jnp.where(n_hit > 0, last_meta[st.HASH:st.HASH + 2], st.as_i32(root))
  chain_row = jnp.concatenate([                       # the `chain` columns, in order
      jnp.stack([last, jnp.where(n_hit > 0, last_meta[st.GEN], tag)]), h_last,
      jnp.stack([n_hit, jnp.ones((), _I32)])])
  writes = AttachWrites(keys=keys, row=row, ids=ids, chain_row=chain_row, stamp=cache.clock,
                        ok=ok.astype(_I32), n_hit=n_hit, queried=queried)
  return writes, jnp.where(ok, n_hit * bs, 0), status


class AttachWrites(NamedTuple):
  """What one `attach` writes, computed from the states before it (`attach_write` applies
  it): `keys` i32[P] hit blocks (num_blocks pads), `row` the slot (max_seqs: none),
  `ids` i32[P] its block-table row, `chain_row` i32[6], `stamp` the hits' LAST_USED,
  `ok` / `n_hit` / `queried` i32[] the clock, hit and query counter increments."""
  keys: jax.Array
  row: jax.Array
  ids: jax.Array
  chain_row: jax.Array
  stamp: jax.Array
  ok: jax.Array
  n_hit: jax.Array
  queried: jax.Array

  @classmethod
  def idle(cls, cache: PrefixCacheState, blocks: bm.BlockState) -> "AttachWrites":
    """Writes nothing (every index out of range, increments 0)."""
    z = jnp.zeros((), _I32)
    p = blocks.max_blocks_per_seq
    return cls(keys=jnp.full((p,), blocks.num_blocks, _I32), row=jnp.full((), blocks.max_seqs,
               _I32), ids=jnp.full((p,), -1, _I32), chain_row=cache.chain[0], stamp=z, ok=z,
               n_hit=z, queried=z)


def attach_write(cache: PrefixCacheState, blocks: bm.BlockState, w: AttachWrites):
  """Applies `w` (from `attach`'s reads) to both states: the hit blocks gain a reference
  and their LAST_USED, the slot its table row, length, chain and activity."""
  bs = cache.block_size
  blocks = blocks.replace(
      ref_count=blocks.ref_count.at[w.keys].add(1, mode="drop"),
      block_tables=blocks.block_tables.at[w.row].set(w.ids, mode="drop"),
      seq_lens=blocks.seq_lens.at[w.row].set(w.n_hit * bs, mode="drop"),
      active=blocks.active.at[w.row].set(True, mode="drop"))
  cache = cache.replace(
      block_meta=cache.block_meta.at[w.keys, st.LAST_USED].set(w.stamp, mode="drop"),
      chain=cache.chain.at[w.row].set(w.chain_row, mode="drop"),
      clock=cache.clock + w.ok,
      hit_blocks=cache.hit_blocks + w.n_hit,
      query_blocks=cache.query_blocks + w.queried)
  return cache, blocks


# ---- register ------------------------------------------------------------------------

def register(cache: PrefixCacheState, blocks: bm.BlockState, item_slot, item_block,
             item_tokens, num_items):
  """Registers newly full blocks, item by item in order.

  Item i says: logical block `item_block[i]` of slot `item_slot[i]` is full
  and holds ids `item_tokens[i]`. It is taken only if it continues the slot's
  chain (`item_block == chain_len[slot]`, chain intact), the slot is active
  and holds that block completely (`seq_lens // block_size` > item_block), and
  the block is not cached yet. An equal cached block (same content and parent)
  becomes the chain's next link instead (no duplicate entry). A full probe
  window, a block already cached elsewhere or a stale parent ends the slot's
  chain (its later blocks stay private: misses, never wrong hits).

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
  bs, s_max, nb, p = cache.block_size, blocks.max_seqs, blocks.num_blocks, blocks.max_blocks_per_seq
  num_items = jnp.minimum(num_items, item_slot.shape[0])

  # Software-pipelined: iteration i first applies item i - 1's row writes, then reads
  # and computes item i's. Each array then gets one in-place row update per iteration,
  # ordered before every read of the iteration; writing at the end instead (reads of
  # `block_meta` feeding the `chain` write and back) made XLA:CPU copy `block_meta` and
  # `chain` twice per item. An idle write puts a row's own value back.
  def rows(c, b, i):
    """Item i's writes: (row index, new row) for block_meta, table, chain, ref_count."""
    s, j, tok = item_slot[i], item_block[i], item_tokens[i]
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
    meta_row = jnp.concatenate([h32, jnp.stack([parent, pgen, gen, j, c.clock, 1, pos]),
                                ch[st.C_HASH:st.C_HASH + 2], tok])
    # The link's generation (an inserted block's is `gen`; `same` is not written).
    new_gen = jnp.where(insert, gen, c.block_meta[jnp.clip(same, 0, nb - 1), st.GEN])
    chain_row = jnp.concatenate([
        jnp.stack([jnp.where(linked, link, parent), jnp.where(linked, new_gen, pgen)]),
        jnp.where(linked, h32, ch[st.C_HASH:st.C_HASH + 2]),
        jnp.stack([ch[st.C_LEN] + linked.astype(_I32), linked.astype(_I32)])])
    return ((oc, jnp.where(insert, meta_row, om)), (pos, jnp.where(insert, own, c.table[pos])),
            (sc, jnp.where(go, chain_row, ch)), (oc, b.ref_count[oc] + insert.astype(_I32)))

  def write(c, b, w):
    (mi, mr), (ti, tr), (ci, cr), (ri, rr) = w
    c = c.replace(block_meta=st.put_row(c.block_meta, mi, mr), table=st.put_row(c.table, ti, tr),
                  chain=st.put_row(c.chain, ci, cr))
    return c, b.replace(ref_count=st.put_row(b.ref_count, ri, rr))

  def body(i, carry):
    c, b, w = carry
    c, b = write(c, b, w)
    return c, b, rows(c, b, i)

  zero = jnp.zeros((), _I32)
  idle = ((zero, cache.block_meta[0]), (zero, cache.table[0]), (zero, cache.chain[0]),
          (zero, blocks.ref_count[0]))
  # The items' own blocks and their generations before: a block was inserted (stored)
  # iff its generation moved (only an insertion bumps it), each block at most once.
  used = lax.iota(_I32, item_slot.shape[0]) < num_items
  own = jnp.where(used & (item_slot >= 0) & (item_block >= 0), blocks.block_tables[
      jnp.clip(item_slot, 0, s_max - 1), jnp.clip(item_block, 0, p - 1)], -1)
  gen_before = cache.block_meta[jnp.clip(own, 0, nb - 1), st.GEN]
  cache, blocks, last = lax.fori_loop(0, num_items, body, (cache, blocks, idle))
  cache, blocks = write(cache, blocks, last)
  stored = (own >= 0) & (cache.block_meta[jnp.clip(own, 0, nb - 1), st.GEN] != gen_before)
  # Two items naming one block (slots sharing it) log it once, at its first item: a sort
  # of the R items (not a scatter over the pool: this runs every step).
  key = jnp.where(stored, own, nb)
  pos = lax.iota(_I32, own.shape[0])
  s_key, s_pos = lax.sort((key, pos), num_keys=2)
  later = jnp.concatenate([jnp.zeros((1,), jnp.bool_), s_key[1:] == s_key[:-1]])
  stored = stored & ~jnp.zeros_like(stored).at[s_pos].set(later)
  cache = st.log_events(cache, st.EV_STORED, own, stored)
  return cache.replace(clock=cache.clock + 1), blocks


def fork_chain(cache: PrefixCacheState, src_slot, dst_slot):
  """Copies the registration chain of `src_slot` to `dst_slot` (i32[] or i32[n]; < 0 pad).

  Call after `block_manager.fork` (or a post-prefill fork) so the child can
  register the blocks it fills next.
  """
  check_states(cache)
  s_max = cache.chain_len.shape[0]
  src, dst = jnp.broadcast_arrays(bm.int_arg(src_slot, "src_slot"),
                                  bm.int_arg(dst_slot, "dst_slot"))
  src, dst = src.reshape(-1), dst.reshape(-1)
  ok = (src >= 0) & (src < s_max) & (dst >= 0) & (dst < s_max)
  sc = jnp.clip(src, 0, s_max - 1)
  row = jnp.where(ok, dst, s_max)
  return cache.replace(chain=cache.chain.at[row].set(cache.chain[sc], mode="drop"))
