"""Batch decisions of the block manager: which requests of a batch succeed, as if applied
one at a time in argument order, with O(batch * width) vector work and no branch.

`paged_jax.block_manager` owns the `BlockState` and the ops; this module holds the
array-only planning they share (all inputs and outputs are per-request or per-slot
arrays, never the state): the first failure of a prefix sum, the at most `width - 1`
vector rounds after it, the static pop-window bound, and the copy-on-write writer
groups. No `lax.cond` and no data-dependent loop: on GPU either reads a predicate
back to the host every step.
"""

from __future__ import annotations

from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp

from paged_jax.config import cdiv

_I32 = jnp.int32


def blocks_bound(max_tokens: Optional[int], bs: int, p: int, cow: bool) -> int:
  """Static bound on blocks one request can pop (width of the pop window)."""
  if max_tokens is None:
    return p
  if cow:  # cdiv(L + n, bs) - cdiv(L, bs) + cow <= cdiv(n - 1, bs) + 1
    k = cdiv(max(max_tokens - 1, 0), bs) + 1
  else:
    k = cdiv(max_tokens, bs)
  return max(1, min(p, k))


def first_of_slot(slots: jax.Array, member: jax.Array, s_max: int) -> jax.Array:
  """bool[n]: entry i is the first member naming its slot (slots in [0, s_max)).

  A scatter-min into an s_max-sized array: O(n + max_seqs), no sort.
  """
  iota = lax.iota(_I32, slots.shape[0])
  first = jnp.full((s_max,), slots.shape[0], _I32).at[jnp.where(member, slots, s_max)].min(
      iota, mode="drop")
  return member & (first[jnp.clip(slots, 0, s_max - 1)] == iota)


def drop_neg(idx: jax.Array, size: int) -> jax.Array:
  """Maps negative ids to `size` so `.at[...](mode="drop")` ignores them."""
  return jnp.where(idx < 0, size, idx)


def static_rounds(num_rounds: int, body, carry):
  """`body` applied `num_rounds` (static) times: unrolled when few, else a fori_loop with a
  static trip count (an XLA while with a known trip count: no host readback on GPU)."""
  if num_rounds <= 8:
    for _ in range(num_rounds):
      carry = body(carry)
    return carry
  return lax.fori_loop(0, num_rounds, lambda _, c: body(c), carry)


def first_failure(fast_need: jax.Array, num_free: jax.Array):
  """Prefix where every request gets its `fast_need`: (f, blocks left after it).

  f is the first request whose inclusive prefix sum of `fast_need` exceeds `num_free`
  (len if none): requests before f all succeed, f fails with fewer than its need left.
  """
  n = fast_need.shape[0]
  iota = lax.iota(_I32, n)
  csum = jnp.cumsum(fast_need)
  f = jnp.min(jnp.where(csum > num_free, iota, n))
  return f, num_free - jnp.sum(jnp.where(iota < f, fast_need, 0))


def allocate_decide(sc, cand, first, need, num_free, s_max: int, width: int):
  """Which allocate requests succeed (ok) and which name a slot already taken (dup), as if
  applied one at a time, without a scan or a branch.

  Up to the first failure f (a prefix sum) every candidate that is first for its slot
  succeeds. f fails with fewer than need[f] <= width blocks left, and every later
  success takes >= 1 block, so at most width - 1 more succeed: each of width - 1 rounds
  finds the next one (the first later request that fits and names an unclaimed slot) with
  O(n) vector work, settling the requests it passes. O(n * width) in all, the same order
  as the pop window; no data-dependent branch. Nor can more than n - 1 requests follow
  f: min(width, n) - 1 rounds.
  """
  n = sc.shape[0]
  iota = lax.iota(_I32, n)
  fast_need = jnp.where(cand & first, need, 0)
  f, remaining = first_failure(fast_need, num_free)
  before = iota < f
  ok = cand & first & before
  dup = cand & ~first & before
  claimed = jnp.zeros((s_max,), jnp.bool_).at[jnp.where(ok, sc, s_max)].set(True, mode="drop")

  def round_(carry):
    pos, remaining, claimed, ok, dup = carry
    later, taken = iota > pos, claimed[sc]
    elig = later & cand & ~taken & (need <= remaining)
    j = jnp.min(jnp.where(elig, iota, n))  # n: none; settles every later request
    hit = iota == j
    dup = dup | (later & (iota <= j) & cand & taken)
    remaining = remaining - jnp.sum(jnp.where(hit, need, 0))
    claimed = claimed.at[jnp.where(hit, sc, s_max)].set(True, mode="drop")
    return j, remaining, claimed, ok | hit, dup

  pos, _, claimed, ok, dup = static_rounds(min(width, n) - 1, round_,
                                     (f - 1, remaining, claimed, ok, dup))
  # Left after the rounds: no request fits any more (see above); those naming a slot
  # claimed by now are duplicates.
  dup = dup | ((iota > pos) & cand & claimed[sc])
  return ok, dup


def writer_groups(ref_count, shared, last_block, refs):
  """Groups the slots writing into a shared last block, without a sort.

  Uses `ref_count` as scratch: the entries of the writers' blocks are set to
  the highest writing slot, read back, then restored. With the state donated
  this is O(max_seqs) work in place, never O(num_blocks). Each scatter's
  indices depend on the preceding gather, which lets XLA keep the array in
  place instead of copying it.
  Returns (ref_count (restored: equal to the input), idle i32[S]: holders of
  the slot's block that are not writing, rep i32[S]: highest writing slot of
  the group, used as group id and to spot the group's last writer).
  """
  s_max = shared.shape[0]
  nb, iota = ref_count.shape[0], lax.iota(_I32, s_max)
  keys = jnp.where(shared, last_block, nb)
  ref_count = ref_count.at[keys].set(-1, mode="drop").at[keys].max(iota, mode="drop")
  rep = jnp.where(shared, ref_count[jnp.clip(last_block, 0, nb - 1)], s_max)
  ref_count = ref_count.at[jnp.where(rep == iota, last_block, nb)].set(refs, mode="drop")
  writers = jnp.zeros((s_max,), _I32).at[rep].add(1, mode="drop")
  idle = refs - writers[jnp.clip(rep, 0, s_max - 1)]
  return ref_count, idle, rep


def append_decide(cand, grow, shared, refs, rep, cow_fast, num_free, width: int):
  """(ok, cow) per slot as if slots appended one at a time, in slot order; no scan, no branch.

  Up to the first failure f (a prefix sum of grow + cow_fast) every candidate succeeds
  and copies as `cow_fast` says. f fails with fewer than its need <= width blocks left;
  later successes needing no block (no growth, no copy) always go through and each other
  one takes >= 1 block, so at most width - 1 of them remain: each of width - 1 rounds
  finds the next (recomputing copies with the group's copy count so far) with O(max_seqs)
  vector work (at most max_seqs - 1 slots follow f: min(width, max_seqs) - 1 rounds).
  Decode (max_new_tokens=1, width 1) is the prefix sum alone.
  """
  s_max = cand.shape[0]
  iota = lax.iota(_I32, s_max)
  gid = jnp.clip(rep, 0, s_max - 1)
  f, remaining = first_failure(jnp.where(cand, grow + cow_fast.astype(_I32), 0), num_free)
  before = iota < f
  ok, cow = cand & before, cow_fast & before
  copies = jnp.zeros((s_max,), _I32).at[jnp.where(ok & cow, rep, s_max)].add(1, mode="drop")

  def need_now(copies):
    cow_now = shared & (refs - copies[gid] > 1)
    return cow_now, grow + cow_now.astype(_I32)

  def round_(carry):
    pos, remaining, copies, ok, cow = carry
    later = iota > pos
    cow_now, nd = need_now(copies)
    elig = later & cand & (nd > 0) & (nd <= remaining)
    j = jnp.min(jnp.where(elig, iota, s_max))  # s_max: none; settles every later slot
    span, hit = later & (iota <= j), iota == j
    # Before j only block-free appends fit (a fitting one needing blocks would be j).
    ok = ok | (span & cand & (nd <= remaining))
    cow = cow | (span & cow_now)
    remaining = remaining - jnp.sum(jnp.where(hit, nd, 0))
    copies = copies.at[jnp.where(hit & cow_now, rep, s_max)].add(1, mode="drop")
    return j, remaining, copies, ok, cow

  pos, remaining, copies, ok, cow = static_rounds(
      min(width, s_max) - 1, round_, (f - 1, remaining, copies, ok, cow))
  later = iota > pos
  cow_now, nd = need_now(copies)
  return ok | (later & cand & (nd <= remaining)), cow | (later & cow_now)
