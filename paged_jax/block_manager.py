"""Functional block manager: the `BlockState` pytree and pure, jittable block ops.

PagedAttention (Kwon et al., SOSP 2023) cuts the KV cache into blocks of
`block_size` token slots; each sequence slot owns a row of `block_tables`
mapping logical to physical blocks. Here the allocator is an immutable pytree
and every op a pure function with static shapes and no host sync, so block
bookkeeping, copy-on-write and attention can share one `jax.jit`.

Free structure: a stack; `free_stack[:num_free]` are the free ids, the top
(`num_free - 1`) is popped first. A batch pops with an exclusive prefix sum, so
every op costs O(batch * max_blocks_per_seq), never O(num_blocks) (no scan,
argmin or sort over the pool), provided the state is donated (`donate_argnums`)
so XLA updates the O(num_blocks) arrays in place.

Batch policy (every op): requests act as if applied one at a time in argument
(slot) order. A request that cannot be satisfied gets `OUT_OF_BLOCKS`,
`TOO_LONG` or `INVALID` (`paged_jax.config`) and leaves its slot exactly as it
was; later requests still run on the blocks it did not take. Up to the first
shortfall this is one prefix sum; after it at most `width - 1` more requests can
fit (`width` the static per-request block bound), each found by an O(batch)
vector round (`paged_jax.block_rounds`). No `lax.cond`/`lax.switch` and no
data-dependent loop: on GPU either would copy a predicate to the host and block,
every step.
Negative slot ids are padding: `INVALID`, no effect.

Invariants: a slot with `L` tokens holds `cdiv(L, block_size)` blocks in the
first columns of its row, -1 after; inactive slots have `L == 0`;
`ref_count[b]` is the number of table entries pointing at `b`; a block is on the
free stack (once) iff its ref count is 0; all holders of a shared block hold it
at the same logical index with the same fill.

Copy-on-write: `append` into a shared (`ref_count > 1`), partially filled last
block gives the writer a fresh block and reports `(old, new)` in `cow`, which
the caller applies with `kv_cache.copy_blocks` in the same jit before writing.
When several holders append in one batch, all but the last remaining holder
copy; that one sees `ref_count == 1` and writes in place.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_rounds
# The state pytree lives in its own module; `bm.BlockState`, `bm.init` read as before.
from paged_jax.block_state import BlockState, check_state, init, int_arg  # noqa: F401
from paged_jax.config import INVALID, OK, OUT_OF_BLOCKS, TOO_LONG, cdiv

_I32 = jnp.int32


def num_free_blocks(state: BlockState) -> jax.Array:
  """i32[]: blocks on the free stack."""
  return state.num_free


def _pop(state: BlockState, need: jax.Array, width: int):
  """Pops `need[i]` blocks for request i (in order) off the stack.

  Returns (blocks i32[m, width], -1 past need[i]; total popped i32[]). Request
  i's k-th block is `free_stack[num_free - 1 - off_i - k]`, `off` the exclusive
  prefix sum of `need`: exactly the order of popping one block at a time.
  """
  off = jnp.cumsum(need) - need
  k = lax.iota(_I32, width)[None, :]
  take = k < need[:, None]
  pos = jnp.clip(state.num_free - 1 - off[:, None] - k, 0, state.num_blocks - 1)
  return jnp.where(take, state.free_stack[pos], -1), jnp.sum(need)


def allocate(state: BlockState, slot, num_tokens, *, max_num_tokens: Optional[int] = None):
  """Activates `slot` holding `num_tokens` tokens in `cdiv(num_tokens, bs)` fresh blocks.

  Args:
    state: the allocator.
    slot: i32[] or i32[n]: inactive slots in [0, max_seqs); < 0 is padding.
    num_tokens: i32, broadcast to `slot`'s shape: prompt length in [1, max_seq_len].
    max_num_tokens: optional static bound on `num_tokens` (larger values get
      INVALID); narrows the pop window, and the vector rounds after a shortfall,
      from max_blocks_per_seq to cdiv(max_num_tokens, bs) blocks. Inferred from an
      int argument.
  Returns:
    (state, status with `slot`'s shape): INVALID (slot out of range or already
    active, num_tokens < 1 or > max_num_tokens), TOO_LONG (> max_seq_len),
    OUT_OF_BLOCKS.
  """
  bs, s_max, nb, max_len = state.block_size, state.max_seqs, state.num_blocks, state.max_seq_len
  static_n = max_num_tokens
  if isinstance(num_tokens, int):
    static_n = num_tokens if static_n is None else min(static_n, num_tokens)
  check_state(state)
  slot = int_arg(slot, "slot")
  num_tokens = int_arg(num_tokens, "num_tokens")
  shape = slot.shape
  slots = slot.reshape(-1)
  n_tok = jnp.broadcast_to(jnp.asarray(num_tokens, _I32), shape).reshape(-1)
  sc = jnp.clip(slots, 0, s_max - 1)
  bad = (slots < 0) | (slots >= s_max) | state.active[sc] | (n_tok < 1)
  if max_num_tokens is not None:
    bad = bad | (n_tok > max_num_tokens)
  too_long = ~bad & (n_tok > max_len)
  cand = ~bad & ~too_long
  need = jnp.where(cand, cdiv(jnp.clip(n_tok, 0, max_len), bs), 0)
  first = block_rounds.first_of_slot(slots, cand, s_max)
  width = block_rounds.blocks_bound(static_n, bs, state.max_blocks_per_seq, cow=False)
  ok, dup = block_rounds.allocate_decide(sc, cand, first, need, state.num_free, s_max, width)
  # A slot taken by an earlier request of the batch is active by now: INVALID
  # takes precedence over TOO_LONG, as in one-at-a-time application.
  iota = lax.iota(_I32, slots.shape[0])
  first_ok = jnp.full((s_max,), slots.shape[0], _I32).at[jnp.where(ok, sc, s_max)].min(
      iota, mode="drop")
  dup = dup | (too_long & (first_ok[sc] < iota))
  status = jnp.where(bad | dup, INVALID,
                     jnp.where(too_long, TOO_LONG, jnp.where(ok, OK, OUT_OF_BLOCKS)))

  blocks, total = _pop(state, jnp.where(ok, need, 0), width)
  rows = jnp.where(ok, sc, s_max)
  state = state.replace(
      ref_count=state.ref_count.at[block_rounds.drop_neg(blocks, nb)].set(1, mode="drop"),
      num_free=state.num_free - total,
      block_tables=state.block_tables.at[rows, :width].set(blocks, mode="drop"),
      seq_lens=state.seq_lens.at[rows].set(n_tok, mode="drop"),
      active=state.active.at[rows].set(True, mode="drop"))
  return state, status.reshape(shape).astype(_I32)


def _append_plan(state: BlockState, slot_mask, num_new_tokens, max_new_tokens):
  """Decides append per slot.

  Returns (ref_count: equal to state.ref_count, to be updated in place, ok,
  cow, grow, status, n_new, last_block), all per slot except ref_count.
  """
  bs, s_max, max_len = state.block_size, state.max_seqs, state.max_seq_len
  mask = jnp.broadcast_to(jnp.asarray(slot_mask, jnp.bool_), (s_max,))
  n_new = jnp.broadcast_to(jnp.asarray(num_new_tokens, _I32), (s_max,))
  lens = state.seq_lens
  bad = ~state.active | (n_new < 0)
  if max_new_tokens is not None:
    bad = bad | (n_new > max_new_tokens)
  bad = mask & bad
  too_long = mask & ~bad & (n_new > max_len - lens)
  cand = mask & ~bad & ~too_long
  n_ok = jnp.where(cand, n_new, 0)
  old_blocks = cdiv(lens, bs)
  grow = cdiv(lens + n_ok, bs) - old_blocks
  last_block = jnp.take_along_axis(
      state.block_tables, jnp.maximum(old_blocks - 1, 0)[:, None], axis=1)[:, 0]
  refs = state.ref_count[jnp.clip(last_block, 0, state.num_blocks - 1)]
  # Materialise `refs` before the scratch scatters below update ref_count in place: XLA:GPU
  # otherwise re-gathers it from the original inside later fusions, which then must keep
  # the original alive and copy the whole num_blocks-long array (seen in the sm_90 compile).
  ref_count, refs = lax.optimization_barrier((state.ref_count, refs))
  # Writers into a shared (ref > 1), partially filled last block.
  shared = cand & (n_ok > 0) & (lens % bs != 0) & (refs > 1)
  # Masked scratch scatters (non-writers' indices are dropped): O(max_seqs) in place, run
  # every step (no lax.cond: on GPU its branch index is read back to the host).
  ref_count, idle, rep = block_rounds.writer_groups(ref_count, shared, last_block, refs)
  # If every candidate succeeds, each writer copies except a group's last
  # writer when no idle holder remains (it then sees ref_count == 1).
  iota = lax.iota(_I32, s_max)
  cow_fast = shared & ((idle > 0) | (rep != iota))
  width = block_rounds.blocks_bound(max_new_tokens, bs, state.max_blocks_per_seq, cow=True)
  ok, cow = block_rounds.append_decide(cand, grow, shared, refs, rep, cow_fast, state.num_free,
                                       width)
  cow = ok & cow
  status = jnp.where(bad, INVALID, jnp.where(
      too_long, TOO_LONG, jnp.where(cand & ~ok, OUT_OF_BLOCKS, OK)))
  return ref_count, ok, cow, grow, status.astype(_I32), n_new, last_block


def append(state: BlockState, slot_mask, num_new_tokens, *,
           max_new_tokens: Optional[int] = None):
  """Grows the masked slots by `num_new_tokens` tokens (new blocks at boundaries).

  Args:
    state: the allocator.
    slot_mask: bool[max_seqs]: slots to grow (must be active).
    num_new_tokens: i32[max_seqs] or int, tokens to add per slot (>= 0).
    max_new_tokens: optional static bound on `num_new_tokens` (larger values
      get INVALID); narrows the per-slot pop window from max_blocks_per_seq to
      cdiv(max_new_tokens - 1, bs) + 1 blocks. Inferred from an int argument.
  Returns:
    (state, status i32[max_seqs], cow i32[max_seqs, 2]): status OK for
    unmasked slots; INVALID (inactive slot, negative count), TOO_LONG (past
    max_seq_len), OUT_OF_BLOCKS. cow[s] = (old, new) block to copy before slot
    s writes, or (-1, -1).
  """
  if isinstance(num_new_tokens, int):
    max_new_tokens = num_new_tokens if max_new_tokens is None else min(
        max_new_tokens, num_new_tokens)
  check_state(state)
  slot_mask = jnp.asarray(slot_mask)
  chex.assert_type(slot_mask, bool, custom_message="slot_mask")
  if slot_mask.ndim:
    chex.assert_shape(slot_mask, (state.max_seqs,), custom_message="slot_mask")
  num_new_tokens = int_arg(num_new_tokens, "num_new_tokens")
  if num_new_tokens.ndim:
    chex.assert_shape(num_new_tokens, (state.max_seqs,), custom_message="num_new_tokens")
  s_max, nb = state.max_seqs, state.num_blocks
  ref_count, ok, cow, grow, status, n_new, last_block = _append_plan(
      state, slot_mask, num_new_tokens, max_new_tokens)
  cow_i = cow.astype(_I32)
  need = jnp.where(ok, grow + cow_i, 0)
  width = block_rounds.blocks_bound(max_new_tokens, state.block_size, state.max_blocks_per_seq,
                                    cow=True)
  blocks, total = _pop(state, need, width)  # k = 0 is the copy target when cow
  k = lax.iota(_I32, width)[None, :]
  old_blocks = cdiv(state.seq_lens, state.block_size)
  cols = jnp.where(cow[:, None] & (k == 0), old_blocks[:, None] - 1,
                   old_blocks[:, None] + k - cow_i[:, None])
  rows = jnp.where(blocks >= 0, lax.iota(_I32, s_max)[:, None], s_max)
  cow_src = jnp.where(cow, last_block, -1)
  # One scatter: popped blocks go 0 -> 1, copied-from blocks lose this holder.
  ref_count = ref_count.at[jnp.concatenate([block_rounds.drop_neg(blocks, nb).reshape(-1),
                                            block_rounds.drop_neg(cow_src, nb)])].add(
      jnp.concatenate([jnp.ones((blocks.size,), _I32), jnp.full((s_max,), -1, _I32)]),
      mode="drop")
  state = state.replace(
      ref_count=ref_count,
      num_free=state.num_free - total,
      block_tables=state.block_tables.at[rows, cols].set(blocks, mode="drop"),
      seq_lens=jnp.where(ok, state.seq_lens + n_new, state.seq_lens))
  cow_pairs = jnp.stack([cow_src, jnp.where(cow, blocks[:, 0], -1)], axis=-1)
  return state, status, cow_pairs


def free(state: BlockState, slot):
  """Releases active slots: each held block's ref count drops by one; blocks
  reaching 0 are pushed on the free stack once, in the order they reach 0.

  Args:
    state: the allocator.
    slot: i32[] or i32[n], active slots; < 0 is padding.
  Returns:
    (state, status with `slot`'s shape): INVALID for out-of-range or inactive
    slots (including a slot already freed earlier in the same batch).
  Cost: O(n * max_blocks_per_seq) scatters and gathers, no sort: blocks shared
  by several freed slots are deduplicated through their ref_count entries.
  """
  s_max, p = state.max_seqs, state.max_blocks_per_seq
  check_state(state)
  slot = int_arg(slot, "slot")
  shape = slot.shape
  slots = slot.reshape(-1)
  sc = jnp.clip(slots, 0, s_max - 1)
  live = (slots >= 0) & (slots < s_max) & state.active[sc]
  ok = block_rounds.first_of_slot(slots, live, s_max)
  held = jnp.where(ok[:, None], state.block_tables[sc], -1).reshape(-1)  # (request, column) order
  rows = jnp.where(ok, sc, s_max)
  state = release_references(state, held)
  state = state.replace(
      block_tables=state.block_tables.at[rows].set(jnp.full((p,), -1, _I32), mode="drop"),
      seq_lens=state.seq_lens.at[rows].set(0, mode="drop"),
      active=state.active.at[rows].set(False, mode="drop"))
  return state, jnp.where(ok, OK, INVALID).reshape(shape).astype(_I32)


def release_references(state: BlockState, held) -> BlockState:
  """Drops one reference per entry of `held` (i32[n] block ids, -1 = none; a block may
  appear several times); blocks reaching 0 are pushed on the free stack once, in the order
  of their last occurrence, as one-at-a-time release would. Leaves the tables alone (the
  caller clears the entries it released). Cost: O(n) scatters and gathers, no sort."""
  nb = state.num_blocks
  keys = block_rounds.drop_neg(held, nb)
  gather_at = jnp.clip(held, 0, nb - 1)
  pos = lax.iota(_I32, held.shape[0])
  # Decrement (duplicates accumulate), then mark each block that reached 0 once,
  # at its last occurrence, using its now-zero ref_count entry as scratch.
  ref_count = state.ref_count.at[keys].add(-1, mode="drop")
  zero = (held >= 0) & (ref_count[gather_at] == 0)
  zero_keys = jnp.where(zero, held, nb)
  ref_count = ref_count.at[zero_keys].max(pos + 1, mode="drop")
  pushed = zero & (ref_count[gather_at] == pos + 1)
  ref_count = ref_count.at[jnp.where(pushed, held, nb)].set(0, mode="drop")  # one per block
  rank = jnp.cumsum(pushed.astype(_I32)) - 1
  push_at = jnp.where(pushed, state.num_free + rank, nb)
  return state.replace(ref_count=ref_count,
                       free_stack=state.free_stack.at[push_at].set(held, mode="drop"),
                       num_free=state.num_free + jnp.sum(pushed.astype(_I32)))


def fork(state: BlockState, src_slot, dst_slot):
  """Makes each inactive `dst_slot` share every block of `src_slot` (ref_count += 1).

  Args:
    state: the allocator.
    src_slot, dst_slot: i32[] or i32[n] (broadcast together). A dst activated
      by an earlier fork of the batch may be a later src (chains work).
  Returns:
    (state, status): INVALID when a slot is out of range, src is inactive, dst
    is active, or src == dst. Never needs blocks: copy-on-write happens later,
    in `append`. Cost: an O(n) loop over the requests plus O(n * P) scatters.
  """
  s_max, nb = state.max_seqs, state.num_blocks
  check_state(state)
  src, dst = jnp.broadcast_arrays(int_arg(src_slot, "src_slot"), int_arg(dst_slot, "dst_slot"))
  shape = src.shape
  src, dst = src.reshape(-1), dst.reshape(-1)
  in_range = (src >= 0) & (src < s_max) & (dst >= 0) & (dst < s_max) & (src != dst)
  sc, dc = jnp.clip(src, 0, s_max - 1), jnp.clip(dst, 0, s_max - 1)

  def body(i, carry):  # tracks which initial slot's row each slot holds
    active, origin, ok = carry
    s, d = sc[i], dc[i]
    good = in_range[i] & active[s] & ~active[d]
    active = active.at[d].set(active[d] | good)
    origin = origin.at[d].set(jnp.where(good, origin[s], origin[d]))
    return active, origin, ok.at[i].set(good)

  carry = (state.active, lax.iota(_I32, s_max), jnp.zeros(src.shape, jnp.bool_))
  active, origin, ok = lax.fori_loop(0, src.shape[0], body, carry)
  root = origin[dc]
  shared_rows = state.block_tables[root]  # [n, P]
  rows = jnp.where(ok, dc, s_max)
  bumped = jnp.where(ok[:, None] & (shared_rows >= 0), shared_rows, nb)
  state = state.replace(
      ref_count=state.ref_count.at[bumped].add(1, mode="drop"),
      block_tables=state.block_tables.at[rows].set(shared_rows, mode="drop"),
      seq_lens=state.seq_lens.at[rows].set(state.seq_lens[root], mode="drop"),
      active=active)
  return state, jnp.where(ok, OK, INVALID).reshape(shape).astype(_I32)


def token_slots(state: BlockState, seq_slot, positions):
  """Flat cache slot of each token: `block_tables[s, p // bs] * bs + p % bs`.

  Args:
    seq_slot: i32[T], sequence slot of each token; < 0 is padding.
    positions: i32[T], token positions within their sequence.
  Returns:
    i32[T]; -1 for padding and for any position the slot does not hold
    (p < 0 or p >= seq_lens[s]), so such tokens are never written.
  """
  bs, s_max, p_max = state.block_size, state.max_seqs, state.max_blocks_per_seq
  check_state(state)
  s, pos = int_arg(seq_slot, "seq_slot"), int_arg(positions, "positions")
  chex.assert_equal_shape([s, pos], custom_message="seq_slot, positions")
  sc = jnp.clip(s, 0, s_max - 1)
  held = (s >= 0) & (s < s_max) & (pos >= 0) & (pos < state.seq_lens[sc])
  block = state.block_tables[sc, jnp.clip(pos // bs, 0, p_max - 1)]
  held = held & (block >= 0)
  return jnp.where(held, block * bs + pos % bs, -1)

