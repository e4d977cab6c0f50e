"""Reference models for tests and benchmarks: plain Python (and numpy), no JAX.

`BlockModel` is the block allocator written from the semantics in
`paged_jax/block_manager.py`'s docstrings, one request at a time in argument
order, the way a host allocator would do it. The free list is a Python list used
as a stack (pop from the end), so the model predicts the exact block ids the
batched JAX ops must hand out. Tests compare the JAX state with it after every
op (tests/block_manager_test.py); it is library code so benchmarks and notebooks
can use the same oracle. Hybrid KV's sliding pool (`paged_jax.block_window`) is the same
model plus `release_out_of_window`; a released table entry is -1.
"""

from __future__ import annotations

import numpy as np

from paged_jax.config import INVALID, OK, OUT_OF_BLOCKS, TOO_LONG, cdiv


class BlockModel:
  """Sequential allocator: `stack[-1]` is the next block handed out."""

  def __init__(self, num_blocks: int, max_seqs: int, max_blocks_per_seq: int, block_size: int):
    self.num_blocks, self.max_seqs = num_blocks, max_seqs
    self.max_blocks_per_seq, self.block_size = max_blocks_per_seq, block_size
    self.max_seq_len = max_blocks_per_seq * block_size
    self.ref = [0] * num_blocks
    self.stack = list(range(num_blocks - 1, -1, -1))
    self.tables = [[] for _ in range(max_seqs)]
    self.lens = [0] * max_seqs
    self.active = [False] * max_seqs

  @classmethod
  def from_config(cls, cfg) -> "BlockModel":
    return cls(cfg.num_blocks, cfg.max_seqs, cfg.max_blocks_per_seq, cfg.block_size)

  def _slot_ok(self, s: int) -> bool:
    return 0 <= s < self.max_seqs

  def _pop(self) -> int:
    b = self.stack.pop()
    assert self.ref[b] == 0, f"model: popped block {b} with ref {self.ref[b]}"
    self.ref[b] = 1
    return b

  def allocate(self, slots, counts, max_num_tokens=None) -> list:
    status = []
    for s, n in zip(slots, counts):
      if (not self._slot_ok(s) or self.active[s] or n < 1
          or (max_num_tokens is not None and n > max_num_tokens)):
        status.append(INVALID)
      elif n > self.max_seq_len:
        status.append(TOO_LONG)
      elif cdiv(n, self.block_size) > len(self.stack):
        status.append(OUT_OF_BLOCKS)
      else:
        self.tables[s] = [self._pop() for _ in range(cdiv(n, self.block_size))]
        self.lens[s], self.active[s] = n, True
        status.append(OK)
    return status

  def append(self, mask, counts, max_new_tokens=None):
    """Returns (status per slot, cow per slot as (old, new) or (-1, -1))."""
    status, cow = [], []
    bs = self.block_size
    for s in range(self.max_seqs):
      n = counts[s]
      cow.append((-1, -1))
      if not mask[s]:
        status.append(OK)
        continue
      if not self.active[s] or n < 0 or (max_new_tokens is not None and n > max_new_tokens):
        status.append(INVALID)
        continue
      length = self.lens[s]
      if length + n > self.max_seq_len:
        status.append(TOO_LONG)
        continue
      copy = n > 0 and length % bs != 0 and self.ref[self.tables[s][-1]] > 1
      grow = cdiv(length + n, bs) - cdiv(length, bs)
      if grow + copy > len(self.stack):
        status.append(OUT_OF_BLOCKS)
        continue
      if copy:
        old = self.tables[s][-1]
        new = self._pop()
        self.ref[old] -= 1
        self.tables[s][-1] = new
        cow[-1] = (old, new)
      self.tables[s].extend(self._pop() for _ in range(grow))
      self.lens[s] = length + n
      status.append(OK)
    return status, cow

  def free(self, slots) -> list:
    status = []
    for s in slots:
      if not self._slot_ok(s) or not self.active[s]:
        status.append(INVALID)
        continue
      self._drop(self.tables[s])
      self.tables[s], self.lens[s], self.active[s] = [], 0, False
      status.append(OK)
    return status

  def _drop(self, blocks) -> None:
    for b in blocks:
      if b < 0:   # released by release_out_of_window
        continue
      self.ref[b] -= 1
      if self.ref[b] == 0:
        self.stack.append(b)

  def release_out_of_window(self, window: int) -> None:
    """Hybrid KV: slot by slot, the blocks no later query of the slot can see (logical
    blocks before (len - window + 1) // block_size) drop a reference; entries become -1."""
    for s in range(self.max_seqs):
      if not self.active[s]:
        continue
      keep = max(self.lens[s] - window + 1, 0) // self.block_size
      for c in range(min(keep, len(self.tables[s]))):
        self._drop([self.tables[s][c]])
        self.tables[s][c] = -1

  def fork(self, srcs, dsts) -> list:
    status = []
    for s, d in zip(srcs, dsts):
      if (not self._slot_ok(s) or not self._slot_ok(d) or s == d or not self.active[s]
          or self.active[d]):
        status.append(INVALID)
        continue
      self.tables[d] = list(self.tables[s])
      for b in self.tables[d]:
        if b >= 0:
          self.ref[b] += 1
      self.lens[d], self.active[d] = self.lens[s], True
      status.append(OK)
    return status

  def restore(self, slots, tables, lens, num_blocks) -> int:
    """A swapped group back: `num_blocks` fresh blocks popped one at a time; slot
    `slots[i]` holds `lens[i]` tokens in blocks `tables[i][c]` (indices into the
    fresh ones). All or nothing; returns the status."""
    live = [s for s in slots if s >= 0]
    if (any(not self._slot_ok(s) or self.active[s] for s in live)
        or len(set(live)) != len(live)):
      return INVALID
    if num_blocks > len(self.stack):
      return OUT_OF_BLOCKS
    fresh = [self.stack.pop() for _ in range(num_blocks)]
    for s, row, n in zip(slots, tables, lens):
      if s < 0:
        continue
      self.tables[s] = [fresh[i] for i in row[:cdiv(n, self.block_size)]]
      for b in self.tables[s]:
        self.ref[b] += 1
      self.lens[s], self.active[s] = n, True
    return OK

  def block_table_array(self) -> np.ndarray:
    """i32[max_seqs, max_blocks_per_seq] block tables, -1 past each slot's blocks (the
    array a host allocator uploads to the device every step)."""
    out = np.full((self.max_seqs, self.max_blocks_per_seq), -1, np.int32)
    for s, table in enumerate(self.tables):
      out[s, :len(table)] = table
    return out

  def token_slots(self, seq_slots, positions) -> list:
    out = []
    for s, p in zip(seq_slots, positions):
      if (not self._slot_ok(s) or not 0 <= p < self.lens[s]
          or self.tables[s][p // self.block_size] < 0):
        out.append(-1)
      else:
        out.append(self.tables[s][p // self.block_size] * self.block_size + p % self.block_size)
    return out
