"""Continuous-batching memory simulation: paged blocks vs Orca's contiguous reservations.

Both allocators serve the same FCFS request stream under the same KV budget of
`T` token slots; all requests are waiting at step 0 (a saturated server). One
step is one decode iteration:

  1. requests that reached their final length (prompt + output) at the previous
     step finish and free their memory;
  2. every running request grows by one token (its next output token's K/V);
  3. waiting requests are admitted in FCFS order while memory allows; an
     admitted request holds its prompt's K/V (prefill) at this step;
  4. the step is accounted (`paged_jax.bench.memory`).

A request admitted at step s with prompt p and output o therefore holds
p, p+1, ..., p+o tokens at steps s..s+o and finishes at s+o+1.

Paged (vLLM): the real `paged_jax.block_manager` pure ops, jitted with the state
donated; blocks on demand (`allocate` for the prompt, `append` by one token per
step), admission while free blocks minus a watermark (vLLM: 1% of blocks) cover
the prompt, and preemption by recompute of the latest-admitted requests when the
step's appends would run out of blocks (checked on the host before the append,
as vLLM's scheduler does; a victim rejoins the head of the queue and is
re-admitted holding the tokens it had).

Orca: one contiguous span per request, reserved at admission by policy
(`orca.reservation_tokens`), first-fit in a `ContiguousArena`; admission stops at
the first waiting request no hole can take (FCFS head-of-line blocking). Steps
between two finishes change nothing but lengths, so they are accounted in closed
form (exact).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager
from paged_jax.bench.baselines.orca import OrcaAllocator
from paged_jax.config import OK, CacheConfig, cdiv, check_int
from paged_jax.bench.memory import MemoryAccount, compacting_admission, request_usage


def _lengths(requests) -> List[tuple]:
  """(request_id, prompt_len, final_len) per request; accepts workloads.Request or tuples."""
  out = []
  for r in requests:
    if hasattr(r, "prompt_len"):
      out.append((r.request_id, r.prompt_len, r.total_len))
    else:
      rid, p, o = r
      out.append((rid, int(p), int(p) + int(o)))
  return out


def _check(requests, kv_budget_tokens: int, max_len: int) -> List[tuple]:
  check_int("max_len", max_len, 1)
  check_int("kv_budget_tokens", kv_budget_tokens, max_len)   # one max_len request must fit
  reqs = _lengths(requests)
  for rid, p, f in reqs:
    if not 1 <= p < f <= max_len:
      raise ValueError(f"request {rid}: need 1 <= prompt_len < prompt_len + output_len <= "
                       f"max_len={max_len}, got prompt_len={p}, final length {f}")
  return reqs


def simulate_orca(requests: Sequence, policy: str, kv_budget_tokens: int, max_len: int = 2048,
                  progress=None) -> Dict:
  """Serves `requests` with Orca(`policy`) reservations; returns the memory summary.

  Args:
    requests: workloads.Request list, or (request_id, prompt_len, output_len) tuples.
    policy: "max", "pow2" or "oracle".
    kv_budget_tokens: T, KV slots in the contiguous arena.
    max_len: context limit (Orca(Max) reserves this much).
    progress: optional object with `update(n)` called per finished request (tqdm).
  Returns:
    `MemoryAccount.summary()` plus "preemptions" (always 0: reservations never run out).
  """
  reqs = _check(requests, kv_budget_tokens, max_len)
  alloc = OrcaAllocator(policy, kv_budget_tokens, max_len)
  acct = MemoryAccount(kv_budget_tokens)
  waiting = collections.deque(reqs)
  running: Dict = {}   # request_id -> [current_len, final_len, allocated]
  while waiting or running:
    done = [rid for rid, (c, f, _) in running.items() if c == f]          # 1. finish
    for rid in done:
      alloc.release(rid)
      del running[rid]
    if progress is not None and done:
      progress.update(len(done))
    for entry in running.values():                                        # 2. grow
      entry[0] += 1
    while waiting and alloc.try_admit(waiting[0][0], waiting[0][2]):      # 3. admit
      rid, p, f = waiting.popleft()
      running[rid] = [p, f, alloc.reserved(rid)]
    if not running:
      if waiting:
        raise RuntimeError(f"request {waiting[0][0]} can never be admitted")
      break
    cur, fin, held = zip(*running.values())
    tokens, reserved, internal = request_usage(held, cur, fin)
    external = 0
    if waiting:
      external = compacting_admission(alloc.arena.free,
                                      (alloc.reservation(f) for _, _, f in waiting))
    # The next `skip` steps only grow lengths: no request finishes, so nothing is freed
    # and the blocked queue head stays blocked. Account them in closed form.
    skip = min(f - c for c, f in zip(cur, fin))
    acct.record(tokens=tokens, reservation=reserved, internal=internal, external=external,
                num_running=len(running), saturated=bool(waiting), steps=1 + skip,
                token_growth=len(running))
    for entry in running.values():
      entry[0] += skip
  out = acct.summary()
  out["preemptions"] = 0
  return out


@functools.partial(jax.jit, donate_argnums=0)
def _step(state, finish_slots, grow_mask):
  """One paged step's block work: snapshot, free slots, grow the others by one.

  Args:
    finish_slots: i32[max_seqs] slots to free (finished or preempted) first, then -1.
    grow_mask: bool[max_seqs] slots to grow.
  Returns:
    (state, snapshot of the state BEFORE this op: (free blocks, blocks held per slot,
    seq_lens), free status i32[max_seqs], append status, free blocks after).
  """
  held = jnp.sum((state.block_tables >= 0).astype(jnp.int32), axis=1)
  snapshot = (block_manager.num_free_blocks(state), held, state.seq_lens)

  def free_one(i, carry):   # one slot at a time: cost follows the real number of frees
    st, statuses = carry
    st, status = block_manager.free(st, finish_slots[i])
    return st, statuses.at[i].set(status)

  num_finish = jnp.sum((finish_slots >= 0).astype(jnp.int32))
  state, free_status = jax.lax.fori_loop(
      0, num_finish, free_one, (state, jnp.zeros(finish_slots.shape, jnp.int32)))
  state, status, _ = block_manager.append(state, grow_mask, 1)
  return state, snapshot, free_status, status, block_manager.num_free_blocks(state)


_allocate = jax.jit(block_manager.allocate, donate_argnums=0)


def simulate_paged(requests: Sequence, block_size: int, kv_budget_tokens: int,
                   max_len: int = 2048, watermark: float = 0.01,
                   max_seqs: Optional[int] = None, progress=None) -> Dict:
  """Serves `requests` with paged blocks (the real block manager); returns the summary.

  The allocator state lives on the device; the host reads back statuses, the
  free-block count and (for accounting) each slot's held blocks and length,
  and checks them against its own bookkeeping every step.

  Args:
    requests: as `simulate_orca`.
    block_size: tokens per KV block (power of two); must divide `kv_budget_tokens`.
    kv_budget_tokens: T; the pool has T / block_size blocks.
    max_len: context limit.
    watermark: fraction of blocks admission keeps free (vLLM's 0.01).
    max_seqs: sequence slots (default: enough never to bind).
    progress: optional `update(n)` object.
  Returns:
    `MemoryAccount.summary()` plus "preemptions" (recompute preemptions).
  """
  reqs = _check(requests, kv_budget_tokens, max_len)
  if kv_budget_tokens % block_size:
    raise ValueError(f"kv_budget_tokens must be a multiple of block_size={block_size}, "
                     f"got {kv_budget_tokens}")
  if not 0.0 <= watermark < 1.0:
    raise ValueError(f"watermark must be in [0, 1), got {watermark}")
  bs, num_blocks = block_size, kv_budget_tokens // block_size
  wm_blocks = int(watermark * num_blocks)
  if cdiv(max_len, bs) > num_blocks - wm_blocks:
    raise ValueError(f"kv_budget_tokens={kv_budget_tokens} leaves {num_blocks - wm_blocks} "
                     f"blocks after the watermark; max_len={max_len} needs {cdiv(max_len, bs)}")
  max_seqs = max_seqs or max(1, min(len(reqs), num_blocks))
  cfg = CacheConfig(block_size=bs, num_blocks=num_blocks, max_seqs=max_seqs,
                    max_blocks_per_seq=cdiv(max_len, bs))
  state = block_manager.init(cfg)
  acct = MemoryAccount(kv_budget_tokens)
  waiting = collections.deque([rid, p, f] for rid, p, f in reqs)   # [id, current, final]
  running: Dict[int, list] = {}   # slot -> [request_id, current_len, final_len, admit_order]
  free_slots = list(range(max_seqs - 1, -1, -1))
  admitted = preemptions = 0
  num_free = num_blocks
  pending = None      # the previous step, accounted from the next op's snapshot
  blocks = lambda n: cdiv(n, bs)
  alloc_status = []   # device scalars, checked at the next sync

  def account(snapshot):
    nf, held, seq_lens = snapshot
    p_free, p_slots, p_cur, p_fin, p_waiting = pending
    if (int(nf) != p_free or seq_lens[p_slots].tolist() != p_cur
        or (held[p_slots] != [blocks(c) for c in p_cur]).any()
        or any(st != OK for st in jax.device_get(alloc_status))):
      raise RuntimeError("block manager state disagrees with the simulation")
    alloc_status.clear()
    tokens, reserved, internal = request_usage((held[p_slots] * bs).tolist(), p_cur, p_fin)
    acct.record(tokens=tokens, reservation=reserved, internal=internal, external=0,
                num_running=len(p_slots), saturated=p_waiting)

  while waiting or running:
    done = [s for s, (_, c, f, _) in running.items() if c == f]          # 1. finish
    if progress is not None and done:
      progress.update(len(done))
    free_blocks = num_free + sum(blocks(running[s][2]) for s in done)
    for slot in done:
      running.pop(slot)
    # 2. grow. Like vLLM's scheduler, check on the host that the appends fit; if
    # not, preempt (recompute) the latest-admitted requests until they do. The
    # victims are freed in the same op, before the append (which then never fails).
    need = sum(1 for s, r in running.items() if r[1] % bs == 0)
    victims = []
    while need > free_blocks:
      victim = max(running, key=lambda s: running[s][3])
      rid, cur, fin, _ = running.pop(victim)
      victims.append(victim)
      free_blocks += blocks(cur)
      need -= cur % bs == 0
      waiting.appendleft([rid, cur, fin])
      preemptions += 1
    finish = np.full(max_seqs, -1, np.int32)
    finish[:len(done) + len(victims)] = done + victims
    free_slots.extend(done + victims)
    mask = np.zeros(max_seqs, bool)
    mask[list(running)] = True
    out = _step(state, finish, mask)
    state = out[0]
    snapshot, free_status, status, nf = jax.device_get(out[1:])   # one host sync per step
    if pending is not None:
      account(snapshot)
      pending = None
    if (free_status[finish >= 0] != OK).any() or (status[mask] != OK).any():
      raise RuntimeError(f"block_manager free/append failed: {free_status[finish >= 0]}, "
                         f"{status[mask]}")
    for slot in running:
      running[slot][1] += 1
    num_free = free_blocks - need
    if int(nf) != num_free:
      raise RuntimeError(f"block manager has {int(nf)} free blocks, the simulation {num_free}")
    while waiting and free_slots:                                          # 3. admit
      rid, cur, fin = waiting[0]
      need = cdiv(cur, bs)
      if need > num_free - wm_blocks:
        break
      slot = free_slots.pop()
      state, status = _allocate(state, np.int32(slot), np.int32(cur))
      alloc_status.append(status)
      waiting.popleft()
      running[slot] = [rid, cur, fin, admitted]
      admitted += 1
      num_free -= need
    if not running:
      if waiting:
        raise RuntimeError(f"request {waiting[0][0]} can never be admitted")
      break
    slots = list(running)                                                  # 4. account
    pending = (num_free, slots, [running[s][1] for s in slots],
               [running[s][2] for s in slots], bool(waiting))
  if pending is not None:
    held = jnp.sum((state.block_tables >= 0).astype(jnp.int32), axis=1)
    account(jax.device_get((block_manager.num_free_blocks(state), held, state.seq_lens)))
  out = acct.summary()
  out["preemptions"] = preemptions
  return out


def simulate_allocators(requests: Sequence, allocators: Sequence[str], *, block_size: int,
                        kv_budget_tokens: int, max_len: int = 2048, watermark: float = 0.01,
                        max_seqs: Optional[int] = None, progress=None) -> Dict[str, Dict]:
  """{allocator: summary} of one stream under each of `allocators` ("paged" or
  "orca_max" / "orca_pow2" / "orca_oracle"), same budget, one after the other.

  Args:
    progress: optional name -> context manager with `update(n)` (a tqdm bar per allocator).
  """
  results = {}
  for name in allocators:
    bar = progress(name) if progress is not None else contextlib.nullcontext()
    with bar as b:
      if name == "paged":
        res = simulate_paged(requests, block_size, kv_budget_tokens, max_len,
                             watermark=watermark, max_seqs=max_seqs, progress=b)
      elif name.startswith("orca_"):
        res = simulate_orca(requests, name[len("orca_"):], kv_budget_tokens, max_len,
                            progress=b)
      else:
        raise ValueError(f"allocator must be paged or orca_max / orca_pow2 / orca_oracle, "
                         f"got {name!r}")
    results[name] = res
  return results
