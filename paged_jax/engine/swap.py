"""Swap preemption: a group's K/V blocks to host memory and back, sharing kept.

`swap_out` copies the distinct blocks of a group's slots to numpy once each (the
engine frees the slots in its next step) and records each slot's row as indices into
that copy; `swap_in` pops that many fresh blocks, restores every row over them with
the same sharing (ref counts = holders, as `block_manager.fork` left them) and
scatters the saved pages in, in one donated jit (evicting cached blocks first with
prefix caching). So parallel samples come back holding their prompt once, and beams
their common history once, as vLLM V0 swaps a multi-sequence group.

Shapes are bucketed so few trace: the copied block count to a power of two (capped at
the pool), the group's slot count to a power of two.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import block_rounds
from paged_jax import kv_cache
from paged_jax.config import INVALID, OK, OUT_OF_BLOCKS, cdiv
from paged_jax.engine.step import EngineState, TRACE_COUNT
from paged_jax.prefix_cache import evict

_I32 = jnp.int32


@dataclasses.dataclass
class SwappedKV:
  """Host copy of one group's pages.

  Attributes:
    num_tokens: i32[n] numpy, tokens held by each sequence (its slot's seq_len), in
      the group's sequence order.
    tables: i32[n, max_blocks_per_seq] numpy, each sequence's logical blocks as
      indices into the copied blocks (0 .. num_blocks - 1); -1 past its length.
    num_blocks: distinct blocks copied (what `swap_in` allocates).
    pages: field name -> numpy [num_layers, num_kv_heads, bucket, block_size(, head_dim)],
      the first `num_blocks` blocks valid (`kv_cache.read_blocks`: the blocks layout
      whatever the device's scale layout).
  """
  num_tokens: np.ndarray
  tables: np.ndarray
  num_blocks: int
  pages: dict

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.pages.values())


def _bucket(n: int, cap: int) -> int:
  return min(cap, 1 << max(0, (n - 1).bit_length()))


@jax.jit
def _gather(pages, ids):
  TRACE_COUNT["swap_out"] += 1
  return kv_cache.read_blocks(pages, ids)


def _as_list(x) -> list:
  return [int(v) for v in np.atleast_1d(np.asarray(x))]


def swap_out(state: EngineState, slots: Union[int, Sequence[int]],
             num_tokens: Union[int, Sequence[int]]) -> SwappedKV:
  """Copies the blocks holding the first `num_tokens[i]` tokens of each `slots[i]` to
  host memory, each shared block once."""
  slots, num_tokens = _as_list(slots), _as_list(num_tokens)
  if len(slots) != len(num_tokens) or not slots:
    raise ValueError(f"swap_out: slots and num_tokens must be equally long and non-empty, "
                     f"got {len(slots)} and {len(num_tokens)}")
  blocks = state.blocks
  bs, width = blocks.block_size, blocks.max_blocks_per_seq
  rows = np.asarray(jax.device_get(blocks.block_tables[jnp.asarray(slots)]))
  tables = np.full((len(slots), width), -1, np.int32)
  local = {}   # physical block -> index in the copy, in first-seen order
  for i, (slot, n) in enumerate(zip(slots, num_tokens)):
    nblk = cdiv(n, bs)
    if nblk < 1 or nblk > width or np.any(rows[i, :nblk] < 0):
      raise RuntimeError(f"swap_out: slot {slot} does not hold {n} tokens")
    tables[i, :nblk] = [local.setdefault(int(b), len(local)) for b in rows[i, :nblk]]
  ids = np.zeros((_bucket(len(local), blocks.num_blocks),), np.int32)
  ids[:len(local)] = list(local)
  host = jax.device_get(_gather(state.pages, jnp.asarray(ids)))
  return SwappedKV(num_tokens=np.asarray(num_tokens, np.int32), tables=tables,
                   num_blocks=len(local), pages={k: np.asarray(v) for k, v in host.items()})


def restore_blocks(blocks: bm.BlockState, slots, tables, num_tokens, num_blocks, *,
                   width: int):
  """Activates `slots` over `num_blocks` fresh blocks laid out as `tables` says.

  Args:
    blocks: the allocator.
    slots: i32[n], inactive, distinct slots; < 0 is padding.
    tables: i32[n, max_blocks_per_seq], indices into the fresh blocks; -1 past a
      slot's `cdiv(num_tokens, block_size)` blocks.
    num_tokens: i32[n], tokens each slot holds.
    num_blocks: i32[], distinct blocks (every index < num_blocks is referenced).
    width: static bound on num_blocks.
  Returns:
    (blocks, fresh i32[width] (the popped ids, -1 past num_blocks), status i32[]):
    INVALID when a slot is out of range, active or repeated; OUT_OF_BLOCKS when
    fewer than `num_blocks` are free. On a non-OK status nothing changes: the group
    comes back whole or not at all. Fresh blocks pop in stack order, as `allocate`
    pops them, and each gets the number of rows that reference it as its ref count.
  """
  s_max, nb = blocks.max_seqs, blocks.num_blocks
  live = slots >= 0
  sc = jnp.clip(slots, 0, s_max - 1)
  in_range = live & (slots < s_max)
  repeated = jnp.any(in_range & ~block_rounds.first_of_slot(slots, in_range, s_max))
  bad = jnp.any(live & ~in_range) | jnp.any(in_range & blocks.active[sc]) | repeated
  fits = num_blocks <= blocks.num_free
  ok = ~bad & fits
  status = jnp.where(bad, INVALID, jnp.where(fits, OK, OUT_OF_BLOCKS)).astype(_I32)
  # The allocator's own pop: one request of num_blocks (none unless ok), in stack order.
  fresh = bm._pop(blocks, jnp.where(ok, num_blocks, 0).astype(_I32)[None], width)[0][0]  # pylint: disable=protected-access
  take = fresh >= 0
  held = live[:, None] & (tables >= 0) & ok
  local = jnp.clip(tables, 0, width - 1)
  rows_tbl = jnp.where(held, fresh[local], -1)
  refs = jnp.zeros((width,), _I32).at[jnp.where(held, local, width)].add(1, mode="drop")
  rows = jnp.where(live & ok, sc, s_max)
  blocks = blocks.replace(
      ref_count=blocks.ref_count.at[jnp.where(take, fresh, nb)].set(refs, mode="drop"),
      num_free=blocks.num_free - jnp.where(ok, num_blocks, 0),
      block_tables=blocks.block_tables.at[rows].set(rows_tbl, mode="drop"),
      seq_lens=blocks.seq_lens.at[rows].set(num_tokens, mode="drop"),
      active=blocks.active.at[rows].set(True, mode="drop"))
  return blocks, fresh, status


@functools.partial(jax.jit, donate_argnums=(0,))
def _swap_in(state: EngineState, slots, tables, num_tokens, num_blocks, data):
  TRACE_COUNT["swap_in"] += 1
  blocks, prefix = state.blocks, state.prefix
  width = next(iter(data.values())).shape[2]
  if prefix is not None:   # cached blocks nobody holds make room first
    cache, blocks, _ = evict.ensure_free(prefix.cache, blocks, num_blocks, max_evict=width)
    prefix = prefix.replace(cache=cache)
  blocks, fresh, status = restore_blocks(blocks, slots, tables, num_tokens, num_blocks,
                                         width=width)
  ids = jnp.where(fresh >= 0, fresh, blocks.num_blocks)   # out of range: dropped
  pages = kv_cache.write_blocks(state.pages, ids, data)
  return state.with_full(blocks=blocks, pages=pages, prefix=prefix), status


def swap_in(state: EngineState, slots: Union[int, Sequence[int]], saved: SwappedKV):
  """Activates `slots` (the group's sequences, in `swap_out`'s order) with their saved
  pages and sharing. Returns (state, status i32[]); on a non-OK status the allocator
  is unchanged."""
  slots = _as_list(slots)
  if len(slots) != len(saved.num_tokens):
    raise ValueError(f"swap_in: {len(slots)} slots for {len(saved.num_tokens)} saved sequences")
  n = _bucket(len(slots), 1 << 30)
  pad = n - len(slots)
  return _swap_in(state, jnp.asarray(slots + [-1] * pad, _I32),
                  jnp.asarray(np.pad(saved.tables, ((0, pad), (0, 0)), constant_values=-1)),
                  jnp.asarray(np.pad(saved.num_tokens, (0, pad))),
                  jnp.asarray(saved.num_blocks, _I32),
                  {k: jnp.asarray(v) for k, v in saved.pages.items()})


# ---- a step's swaps (the engine runs them around the jitted call) ----------------------

def copy_out(state: EngineState, batch) -> dict:
  """Host copies of every group `batch` swaps out (group -> SwappedKV), made before its
  step frees them; `Scheduler.update` keeps each on its group."""
  return {group: swap_out(state, slots, [q.num_computed for q in group.seqs])
          for group, slots in batch.swap_out.items()}


def copy_in(state: EngineState, group, slots) -> EngineState:
  """Restores a group a step swaps in into `slots` (planned only once its copy exists)."""
  state, status = swap_in(state, slots, group.swapped_kv)
  if int(status) != OK:
    raise RuntimeError(f"swap-in of slots {slots} failed with status {int(status)}")
  return state
