"""Host-side wrapper over the pure block ops of `paged_jax.block_manager`.

`BlockManager` holds a `BlockState`, validates every argument on the host before
anything is traced (`ValueError` naming the argument and its allowed range,
`OutOfBlocksError` when the pool is short), then runs the jitted op with the
state donated (append excepted, see there). A call either succeeds for every slot it
names or raises and leaves `.state` untouched (all-or-nothing per call). Each call reads small
arrays back from the device to validate, so this is the convenient path for
scripts, notebooks and tests; the engine calls the pure ops inside its own jit.
"""

from __future__ import annotations

from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, OK, OUT_OF_BLOCKS, OutOfBlocksError, check_int

IntOrInts = Union[int, Sequence[int]]

_allocate = jax.jit(bm.allocate, donate_argnums=0)
# Not donated: append's result is adopted only when every slot succeeded (see append).
_append = jax.jit(bm.append, static_argnames=("max_new_tokens",))
_free = jax.jit(bm.free, donate_argnums=0)
_fork = jax.jit(bm.fork, donate_argnums=0)
_token_slots = jax.jit(bm.token_slots)


def _as_list(name: str, value: IntOrInts) -> list:
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return [int(value)]
  if isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0:
    out = []
    for i, v in enumerate(value):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} ({v!r})")
      out.append(int(v))
    return out
  raise TypeError(f"{name} must be an int or a non-empty sequence of ints, got {value!r}")


def _label(name: str, i: int, n: int) -> str:
  return name if n == 1 else f"{name}[{i}]"


class BlockManager:
  """Stateful convenience wrapper: `.state` is the current `BlockState`.

  Example:
    mgr = BlockManager(CacheConfig(block_size=16, num_blocks=64, max_seqs=4))
    mgr.allocate(0, 40)           # slot 0 holds 40 tokens in 3 blocks
    mgr.fork(0, 1)                # slot 1 shares them
    cow = mgr.append(1)           # [[old, new]]: copy before slot 1 writes
    mgr.free([0, 1])
  Donation: every op consumes the previous `.state` arrays; don't keep them.
  """

  def __init__(self, cache_config: CacheConfig):
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
    self.config = cache_config
    self.state = bm.init(cache_config)

  # -- read-only views ------------------------------------------------------
  @property
  def num_free_blocks(self) -> int:
    return int(self.state.num_free)

  def seq_len(self, slot: int) -> int:
    self._check_slots("slot", slot)
    return int(self.state.seq_lens[slot])

  def block_table(self, slot: int) -> list:
    """Physical blocks held by `slot`, in logical order."""
    self._check_slots("slot", slot)
    row = np.asarray(self.state.block_tables[slot])
    return [int(b) for b in row[row >= 0]]

  def is_active(self, slot: int) -> bool:
    self._check_slots("slot", slot)
    return bool(self.state.active[slot])

  def token_slots(self, seq_slot: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """Flat cache slots (see `block_manager.token_slots`); -1 for padding."""
    return np.asarray(_token_slots(self.state, jnp.asarray(seq_slot, jnp.int32),
                                   jnp.asarray(positions, jnp.int32)))

  # -- validation -----------------------------------------------------------
  def _check_slots(self, name: str, slot: IntOrInts) -> list:
    slots = _as_list(name, slot)
    for i, s in enumerate(slots):
      check_int(_label(name, i, len(slots)), s, 0, self.config.max_seqs - 1)
    seen = set()
    for i, s in enumerate(slots):
      if s in seen:
        raise ValueError(f"{_label(name, i, len(slots))}={s} repeats a slot of the same call; "
                         "each slot may appear once")
      seen.add(s)
    return slots

  def _counts(self, name: str, value: IntOrInts, n: int) -> list:
    counts = _as_list(name, value)
    if len(counts) == 1:
      counts = counts * n
    if len(counts) != n:
      raise ValueError(f"{name} must be one int or {n} ints (one per slot), got {len(counts)}")
    return counts

  def _host_active(self) -> np.ndarray:
    return np.asarray(self.state.active)

  # -- ops ------------------------------------------------------------------
  def allocate(self, slot: IntOrInts, num_tokens: IntOrInts) -> None:
    """Activates inactive `slot`(s) holding `num_tokens` tokens each.

    Raises ValueError (slot not in [0, max_seqs - 1], already active or
    repeated; num_tokens not in [1, max_seq_len]) or OutOfBlocksError.
    """
    slots = self._check_slots("slot", slot)
    counts = self._counts("num_tokens", num_tokens, len(slots))
    for i, n in enumerate(counts):
      check_int(_label("num_tokens", i, len(counts)), n, 1, self.config.max_seq_len)
    active = self._host_active()
    for i, s in enumerate(slots):
      if active[s]:
        raise ValueError(f"{_label('slot', i, len(slots))}={s} is already active; "
                         "allocate needs an inactive slot (free it first)")
    need = sum(self.config.blocks_for(n) for n in counts)
    if need > self.num_free_blocks:
      raise OutOfBlocksError(
          f"allocate needs {need} blocks, only {self.num_free_blocks} free")
    self.state, status = _allocate(self.state, jnp.asarray(slots, jnp.int32),
                                   jnp.asarray(counts, jnp.int32))
    _expect_ok("allocate", status)

  def append(self, slot: IntOrInts, num_new_tokens: IntOrInts = 1) -> np.ndarray:
    """Grows active `slot`(s) by `num_new_tokens` tokens each.

    Returns the copy-on-write pairs i32[num_copies, 2] (old block, new block),
    in slot order, that must be copied before the new tokens are written.
    Raises ValueError (slot not in [0, max_seqs - 1], inactive or repeated;
    num_new_tokens not in [1, max_seq_len - seq_len]) or OutOfBlocksError.
    """
    cfg = self.config
    slots = self._check_slots("slot", slot)
    counts = self._counts("num_new_tokens", num_new_tokens, len(slots))
    active, lens = self._host_active(), np.asarray(self.state.seq_lens)
    for i, (s, n) in enumerate(zip(slots, counts)):
      if not active[s]:
        raise ValueError(f"{_label('slot', i, len(slots))}={s} is not active; "
                         "append needs an allocated slot")
      room = cfg.max_seq_len - int(lens[s])
      if room == 0:
        raise ValueError(f"{_label('slot', i, len(slots))}={s} is full "
                         f"(max_seq_len={cfg.max_seq_len} tokens); it cannot grow")
      check_int(_label("num_new_tokens", i, len(counts)), n, 1, room)
    mask = np.zeros((cfg.max_seqs,), bool)
    mask[slots] = True
    per_slot = np.zeros((cfg.max_seqs,), np.int32)
    per_slot[slots] = counts
    # The pure op is transactional per slot, so a short pool can leave some slots grown
    # and others not; all-or-nothing per call means running it on an undonated state
    # and adopting the result only when every slot got its blocks.
    new_state, status, cow = _append(self.state, jnp.asarray(mask), jnp.asarray(per_slot))
    status = np.asarray(status)
    if (status == OUT_OF_BLOCKS).any():
      short = [int(s) for s in np.nonzero(status == OUT_OF_BLOCKS)[0]]
      raise OutOfBlocksError(
          f"append is short of blocks for slots {short} ({self.num_free_blocks} free)")
    _expect_ok("append", status)
    self.state = new_state
    cow = np.asarray(cow)
    return cow[cow[:, 0] >= 0]

  def free(self, slot: IntOrInts) -> None:
    """Releases active `slot`(s); blocks no other slot holds become free."""
    slots = self._check_slots("slot", slot)
    active = self._host_active()
    for i, s in enumerate(slots):
      if not active[s]:
        raise ValueError(f"{_label('slot', i, len(slots))}={s} is not active; "
                         "free needs an allocated slot")
    self.state, status = _free(self.state, jnp.asarray(slots, jnp.int32))
    _expect_ok("free", status)

  def fork(self, src_slot: IntOrInts, dst_slot: IntOrInts) -> None:
    """Makes each inactive `dst_slot` share every block of `src_slot`.

    Pairs run in order, so a dst forked earlier in the call may be a later src.
    """
    dsts = self._check_slots("dst_slot", dst_slot)
    srcs = _as_list("src_slot", src_slot)
    if len(srcs) == 1:
      srcs = srcs * len(dsts)
    if len(srcs) != len(dsts):
      raise ValueError(f"src_slot must be one int or {len(dsts)} ints, got {len(srcs)}")
    active = self._host_active().copy()
    for i, (s, d) in enumerate(zip(srcs, dsts)):
      check_int(_label("src_slot", i, len(srcs)), s, 0, self.config.max_seqs - 1)
      if not active[s]:
        raise ValueError(f"{_label('src_slot', i, len(srcs))}={s} is not active; "
                         "fork needs an allocated source")
      if active[d]:
        raise ValueError(f"{_label('dst_slot', i, len(dsts))}={d} is already active; "
                         "fork needs an inactive destination")
      active[d] = True
    self.state, status = _fork(self.state, jnp.asarray(srcs, jnp.int32),
                               jnp.asarray(dsts, jnp.int32))
    _expect_ok("fork", status)


def _expect_ok(op: str, status) -> None:
  status = np.asarray(status)
  if (status != OK).any():  # host validation should make this impossible
    raise RuntimeError(f"{op}: unexpected status {status.tolist()} after host validation")

