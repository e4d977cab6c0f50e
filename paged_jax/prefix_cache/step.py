"""Prefix caching inside the engine's one jitted step (`paged_jax.engine.step`).

The engine step calls, in this order, all pure and without a host sync:

  free(ps, blocks, free_slots)
      releases the freed slots' cached blocks onto the LRU ring (their last use
      is now) and frees the slots;
  attach(ps, blocks, attach_slot, attach_len, attach_tokens)
      newly admitted prompts take their longest cached prefix (hit blocks join
      their block tables); `skip_hits` then takes the hit tokens out of the
      prompts' first chunks; the hit token counts go back to the host;
  evict_for(ps, blocks, inputs, ...)
      evicts least-recently-used cache-only blocks until the step's worst-case
      block need fits on the free stack;
  after(ps, blocks, inputs, outputs)
      records every token whose K/V the step computed in `history` (i32[S,
      max_seq_len], the ids of each slot's computed tokens), copies history
      rows and registration chains along the step's forks, then registers
      every block that became full (`core.register`).

With hybrid KV the sliding-window group rides along (`ps.sliding`, `prefix_cache.sliding`):
`attach` cuts each hit to what the sliding group can serve and installs its companions,
`evict_for` makes room in the sliding pool too, `adopt` (after `after`, before the
window's release) keeps the sliding blocks of newly cached blocks, `drop_stale` (last)
releases the companions of evicted blocks.

Reading `history` instead of host lists keeps registration on device even for
blocks filled inside the multi-step decode loop.
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax
import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax.prefix_cache import core as pc
from paged_jax.prefix_cache import evict
from paged_jax.prefix_cache import sliding as sliding_cache
from paged_jax.prefix_cache import state as cache_state

_I32 = jnp.int32


@flax.struct.dataclass
class PrefixStepState:
  """Device state of prefix caching in the engine (donated through every call).

  Attributes:
    cache: the PrefixCacheState.
    history: i32[max_seqs, max_seq_len], token id at each computed position of
      each slot (stale past the slot's length).
    sliding: hybrid KV only (else None): the sliding group's `sliding_cache.Companions`.
  """
  cache: cache_state.PrefixCacheState
  history: jax.Array
  sliding: Optional[sliding_cache.Companions] = None


def init(cache_config, **cache_kwargs) -> PrefixStepState:
  """Empty cache and history for `cache_config` (kwargs go to `prefix_cache.init`), and
  with hybrid KV no companion yet."""
  c = cache_config
  return PrefixStepState(
      cache=cache_state.init(c, **cache_kwargs),
      history=jnp.zeros((c.max_seqs, c.max_seq_len), _I32),
      sliding=(sliding_cache.init(c.num_blocks, c.num_sliding_blocks, c.sliding_window)
               if c.hybrid else None))


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
  last = jnp.take_along_axis(blocks.block_tables, jnp.maximum(cd(lens) - 1, 0)[:, None], 1)[:, 0]
  shared = (lens % bs != 0) & (blocks.ref_count[jnp.clip(last, 0, blocks.num_blocks - 1)] > 1)
  grow = jnp.where(n > 0, cd(lens + n) - cd(lens) + shared.astype(_I32), 0)
  loop = jnp.where(inputs.multi_step & (inputs.sample_row >= 0),
                   cd(jnp.asarray(num_decode_steps - 1, _I32)) + 1, 0) if num_decode_steps > 1 else 0
  return jnp.sum(alloc + grow + loop).astype(_I32)


def free(ps: PrefixStepState, blocks: bm.BlockState, free_slots, num_cols: int = 0):
  """Frees `free_slots` (i32[n], -1 pad): release to the LRU ring + block_manager.free
  (`num_cols`: the slots hold blocks in their first num_cols table columns only; 0: all)."""
  cache, blocks, _ = evict.free(ps.cache, blocks, free_slots, num_cols=num_cols)
  return ps.replace(cache=cache), blocks


def attach(ps: PrefixStepState, blocks: bm.BlockState, attach_slot, attach_len,
           attach_start, attach_tokens, attach_root=None, attach_tag=None, sliding=None):
  """Attaches the longest cached prefix of each newly admitted prompt.

  Args:
    attach_slot: i32[A], inactive slots to activate (-1 padding, used lanes first).
    attach_len: i32[A], prompt tokens to look up (>= 1 where used).
    attach_start: i32[A], offset of each prompt in `attach_tokens`.
    attach_tokens: i32[LK], the prompts packed one after the other.
    attach_root, attach_tag: u32[A, 2] / i32[A], each prompt's cache salt
      (`salt.salt_key`; None: every prompt unsalted).
    sliding: hybrid KV only, the sliding group's BlockState: each hit is cut to what the
      sliding group can serve (`sliding_cache.hit_rule`) and the slot's sliding row gets
      the companions of the window before the hit's end.
  Returns:
    (ps, blocks, hit_tokens i32[max_seqs]): cached tokens each attached slot starts
    with (0 for other slots), the same in both groups; and `sliding` when given.
  """
  comp = ps.sliding
  max_len = ps.history.shape[1]
  buf = jnp.concatenate([attach_tokens, jnp.zeros((max_len,), _I32)])
  num = jnp.sum((attach_slot >= 0).astype(_I32))
  lane = lax.iota(_I32, max_len)
  if attach_root is None:
    attach_root = jnp.broadcast_to(jnp.asarray(pc.ROOT_HASH, jnp.uint32),
                                   attach_slot.shape + (2,))
  if attach_tag is None:
    attach_tag = jnp.zeros_like(attach_slot)

  # Software-pipelined: prompt i's lookup reads the states after prompt i - 1's writes,
  # applied at the top of its iteration (`core.attach_reads`).
  def write(cache, b, sb, w):
    cache, b = pc.attach_write(cache, b, w)
    if comp is not None:
      sb = sliding_cache.attach_write(comp, sb, w.row, w.ids, w.n_hit)
    return cache, b, sb

  def body(i, carry):
    cache, b, sb, hits, w = carry
    cache, b, sb = write(cache, b, sb, w)
    n = attach_len[i]
    tok = lax.dynamic_slice(buf, (attach_start[i],), (max_len,))
    tok = jnp.where(lane < n, tok, 0)
    rule = (None if comp is None else
            lambda n_hit, ids: sliding_cache.hit_rule(comp, cache, n_hit, ids))
    w, hit, _ = pc.attach_reads(cache, b, attach_slot[i], tok, n, attach_root[i],
                                attach_tag[i], hit_rule=rule)
    return cache, b, sb, hits.at[attach_slot[i]].set(hit, mode="drop"), w

  hits = jnp.zeros((blocks.max_seqs,), _I32)
  cache, blocks, sliding, hits, w = lax.fori_loop(
      0, num, body, (ps.cache, blocks, sliding, hits, pc.AttachWrites.idle(ps.cache, blocks)))
  cache, blocks, sliding = write(cache, blocks, sliding, w)
  out = ps.replace(cache=cache), blocks, hits
  return out if sliding is None else out + (sliding,)


def skip_hits(inputs, hits):
  """The step's inputs with the attached prompts' hit tokens taken out of their chunks.

  The host plans a newly admitted prompt's first chunk from position 0 as an
  allocation (`alloc_tokens`), not knowing the hit; `attach` has since activated the
  slot holding its `hits` cached tokens (maybe 0). That allocation becomes an append of the
  rest, and the chunk's tokens at positions < hits leave their row (repacked, rows keep
  their order). A chunk cut short by the step's budget may lie wholly inside the hit:
  its row is left empty and dropped (`row_slot` -1, like a padding row); it never
  samples, since a lookup never hits the block of the last prompt token. With no hit
  (a miss) the chunk runs as planned.

  Args:
    inputs: StepInputs (T tokens, R rows, S slots); hits: i32[S] from `attach`.
  Returns:
    StepInputs with alloc_tokens, append_tokens, tokens, positions, token_row,
    target_tokens, row_q_len and row_slot updated.
  """
  s_max, rows = hits.shape[0], inputs.row_slot.shape[0]
  a = inputs.attach_slot
  attached = jnp.zeros((s_max,), jnp.bool_).at[jnp.where(a >= 0, a, s_max)].set(True,
                                                                                 mode="drop")
  alloc = jnp.where(attached, 0, inputs.alloc_tokens)
  append = jnp.where(attached & (inputs.alloc_tokens > 0),
                     jnp.maximum(inputs.alloc_tokens - hits, 0), inputs.append_tokens)
  tr = inputs.token_row
  live = tr >= 0
  tslot = jnp.where(live, inputs.row_slot[jnp.clip(tr, 0, rows - 1)], -1)
  skip = live & (inputs.positions < hits[jnp.clip(tslot, 0, s_max - 1)])
  # Kept tokens first, in order: a stable partition by one scatter to each kept token's
  # rank (a cumsum; an argsort of T costs more), the rest (0, 0, -1, -1) after them.
  num_tokens = skip.shape[0]
  dest = jnp.where(skip, num_tokens, jnp.cumsum((~skip).astype(_I32)) - 1)
  cols = jnp.stack([inputs.tokens, inputs.positions, tr, inputs.target_tokens],
                   axis=1)                                                 # [T, 4]
  blank = jnp.broadcast_to(jnp.asarray([0, 0, -1, -1], _I32), cols.shape)
  moved = blank.at[dest].set(cols, mode="drop")
  dropped = jnp.zeros((rows,), _I32).at[jnp.where(skip, tr, rows)].add(1, mode="drop")
  q_len = inputs.row_q_len - dropped
  return inputs.replace(
      alloc_tokens=alloc, append_tokens=append,
      tokens=moved[:, 0], positions=moved[:, 1], token_row=moved[:, 2],
      target_tokens=moved[:, 3],
      row_q_len=q_len, row_slot=jnp.where((dropped > 0) & (q_len == 0), -1, inputs.row_slot))


def evict_for(ps: PrefixStepState, blocks: bm.BlockState, inputs, sliding=None, *,
              num_decode_steps: int, max_evict: int):
  """Evicts cache-only blocks (in the cache's eviction-policy order) until the step's
  worst-case need is free. With hybrid KV (`sliding` the sliding group's BlockState), then
  evicts cache-only companions (those the main eviction just made stale first) until the
  step's worst-case need of sliding blocks is free. Returns (ps, blocks), and sliding
  when given."""
  need = step_block_need(blocks, inputs, num_decode_steps)
  cache, blocks, _ = evict.ensure_free(ps.cache, blocks, need, max_evict=max_evict)
  ps = ps.replace(cache=cache)
  if sliding is None:
    return ps, blocks
  need = step_block_need(sliding, inputs, num_decode_steps)
  comp, sliding = sliding_cache.evict_for(ps.sliding, ps.cache, sliding, need, max_evict)
  return ps.replace(sliding=comp), blocks, sliding


def adopt(ps: PrefixStepState, blocks: bm.BlockState, sliding: bm.BlockState, inputs=None,
          num_cols: int = 0):
  """Hybrid KV, after `after` and before the window's release: the sliding blocks of
  newly cached blocks become their companions (`sliding_cache.adopt`). With the step's
  `inputs`, only the slots that computed tokens (its rows and sampled slots, at most 2R)
  are looked at, in their first `num_cols` columns (0: all): blocks register only there."""
  lanes = None
  if inputs is not None:
    s_max, rows = blocks.max_seqs, inputs.row_slot.shape[0]
    row_slot = jnp.where(inputs.row_slot >= 0, inputs.row_slot, s_max)
    grew = jnp.zeros((s_max,), jnp.bool_).at[row_slot].set(True, mode="drop")
    grew = grew | (inputs.sample_row >= 0)
    lanes = jnp.nonzero(grew, size=min(2 * rows, s_max), fill_value=s_max)[0].astype(_I32)
  comp, sliding = sliding_cache.adopt(ps.sliding, ps.cache, blocks, sliding, lanes, num_cols)
  return ps.replace(sliding=comp), sliding


def drop_stale(ps: PrefixStepState, sliding: bm.BlockState):
  """Hybrid KV, last in the step: releases the companions of evicted blocks."""
  comp, sliding = sliding_cache.drop_stale(ps.sliding, ps.cache, sliding)
  return ps.replace(sliding=comp), sliding


def _copy_rows(ps: PrefixStepState, src, dst) -> PrefixStepState:
  """History rows and chains src -> dst (i32[n], < 0 padding)."""
  s_max = ps.history.shape[0]
  ok = (src >= 0) & (dst >= 0)
  row = jnp.where(ok, dst, s_max)
  hist = ps.history.at[row].set(ps.history[jnp.clip(src, 0, s_max - 1)], mode="drop")
  cache = pc.fork_chain(ps.cache, jnp.where(ok, src, -1), jnp.where(ok, dst, -1))
  return ps.replace(history=hist, cache=cache)


def after(ps: PrefixStepState, blocks: bm.BlockState, inputs, outputs, *,
          max_items: int, forks: bool = True
          ) -> Tuple[PrefixStepState, bm.BlockState, jax.Array]:
  """Records the step's tokens and registers the blocks it filled.

  Args:
    blocks: the BlockState the step returned.
    inputs: the step's StepInputs; outputs: its StepOutputs (`ok` False: the
      step changed nothing, and neither does this).
    max_items: static bound on blocks registered per call (`max_new_blocks`).
    forks: False when the step has no beam fork and no post-fork (static): their
      history and chain copies are left out.
  Returns:
    (ps, blocks, available i32[]: free blocks plus evictable cached blocks).
  """
  # A failed step changed nothing: mask every write (no lax.cond returning the
  # states, which XLA:CPU would copy even when donated).
  ok = outputs.ok
  s_max, max_len = ps.history.shape
  bs = blocks.block_size
  slots = lax.iota(_I32, s_max)
  # Beam forks happened before the chunks (they stand even when reservations
  # failed): the child starts as its parent.
  if forks:
    ps = _copy_rows(ps, inputs.fork_src, inputs.fork_dst)
  # This step's chunk tokens at their positions.
  tr = inputs.token_row
  tslot = jnp.where(tr >= 0, inputs.row_slot[jnp.clip(tr, 0, s_max - 1)], -1)
  ok_t = ok & (tslot >= 0) & (inputs.positions >= 0) & (inputs.positions < max_len)
  hist = ps.history.at[jnp.where(ok_t, tslot, s_max), inputs.positions].set(
      inputs.tokens, mode="drop")
  ps = ps.replace(history=hist)
  # Parallel-sampling children share the leader's prompt after the prefill.
  if forks:
    ps = _copy_rows(ps, jnp.where(ok, inputs.post_fork_src, -1), inputs.post_fork_dst)
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
  # The slot whose run of items holds item i: how many runs end at or before it, as one
  # compare-all fusion (`jnp.searchsorted`'s default is a while loop: ~7 iterations here).
  owner = jnp.clip(jnp.sum((offs + todo)[None, :] <= i[:, None], axis=1, dtype=_I32), 0,
                   s_max - 1)
  j = start[owner] + (i - offs[owner])
  valid = i < total
  item_slot = jnp.where(valid, owner, -1)
  item_block = jnp.where(valid, j, -1)
  tok_pos = jnp.clip(j, 0, max_len // bs - 1)[:, None] * bs + lax.iota(_I32, bs)[None, :]
  item_tokens = ps.history[owner[:, None], tok_pos]
  cache, blocks = pc.register(cache, blocks, item_slot, item_block, item_tokens, total)
  ps = ps.replace(cache=cache)
  available = blocks.num_free + cache_state.num_evictable(ps.cache, blocks)
  return ps, blocks, available


def take_events(ps: PrefixStepState):
  """(ps with an empty event log, the log i32[E, 5], rows appended i32[]): the engine's
  step returns the log in its outputs (`prefix_cache.events`)."""
  cache = ps.cache
  return (ps.replace(cache=cache.replace(num_events=jnp.zeros((), _I32))), cache.events,
          cache.num_events)


def counters(ps: PrefixStepState, blocks: bm.BlockState):
  """Device counters: hit / query blocks, evictions, cached / evictable / free blocks."""
  cache = ps.cache
  out = dict(hit_blocks=cache.hit_blocks, query_blocks=cache.query_blocks,
             evictions=cache.evictions, cached_blocks=cache_state.num_cached_blocks(cache),
             evictable_blocks=cache_state.num_evictable(cache, blocks), num_free=blocks.num_free)
  if ps.sliding is not None:
    out.update(companion_blocks=sliding_cache.num_companions(ps.sliding))
  return out


def reset(ps: PrefixStepState, blocks: bm.BlockState, *sliding):
  """Drops every cached block (`evict.reset`) and, with hybrid KV, every companion of
  the sliding pool (`sliding`: its BlockState, the one windowed group); running sequences
  keep theirs. Returns (ps, blocks, *sliding)."""
  cache, blocks = evict.reset(ps.cache, blocks)
  ps = ps.replace(cache=cache)
  if ps.sliding is not None:
    ps, *sliding = drop_stale(ps, *sliding)
  return (ps, blocks, *sliding)
