"""The engine's KV tiers as the host sees them: the host tier's exchange around a step
and the KV cache events of both tiers.

    tiers = KVTiers(cache_config, options, state.pages)
    plan = tiers.plan(batch, inputs, scheduler, swapped_in)    # None: no extra call
    state, out = tier.exchange(state, plan, num_decode_steps)  # the device call (tier.py)
    counts, error = tiers.finish(plan, out, scheduler.counts)  # victims stored, events
    tiers.read_step_log(outputs, state)                        # the step's device events
    tiers.drain()                                              # -> [KVEvent], oldest first

The device call and its rules are `tier.py`'s; this module keeps what the engine holds
between steps for them: the host pool (`prefix_cache.host_tier.HostTier`, None without
`CacheConfig.num_host_blocks`; in pinned host memory on a GPU / TPU, numpy on a CPU, as
`host_tier.host_memory_kind` chooses from the pages' device), the events not yet handed
out, the device cache's hashes
as the events published them (`events.DeviceView`), and the exchange counters. Every
method that changes them is called with SIGINT held (`commit.sigint_deferred`).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Dict, List, Optional

import jax
import numpy as np

from paged_jax.engine import tier as tier_lib
from paged_jax.engine.sequence import DeviceCounts
from paged_jax.prefix_cache import events as events_lib
from paged_jax.prefix_cache import state as prefix_state
from paged_jax.prefix_cache import step as prefix_step

# What the device cache holds (its rows' cached flags, hash and parent-hash columns): read
# only when a step's event log overflowed (`events.DeviceView.take`).
_H, _P = prefix_state.HASH, prefix_state.PARENT_HASH
_cached_hashes = jax.jit(lambda state: (state.prefix.cache.cached,
                                        state.prefix.cache.block_meta[:, _H:_H + 2],
                                        state.prefix.cache.block_meta[:, _P:_P + 2]))

_prefix_counters = jax.jit(lambda state: prefix_step.counters(state.prefix, state.blocks))


def prefix_counters(state) -> Dict[str, int]:
  """The device prefix cache's counters (`prefix_step.counters`), read in one sync."""
  return {k: int(v) for k, v in jax.device_get(_prefix_counters(state)).items()}


@functools.partial(jax.jit, donate_argnums=(0,))
def reset_device_cache(state):
  """Drops every block the device's prefix cache holds, in every KV group (running
  sequences keep theirs); the EngineState is donated."""
  prefix, *blocks = prefix_step.reset(state.prefix, *(g.blocks for g in state.groups))
  return state.replace(prefix=prefix, groups=tuple(
      g.replace(blocks=b) for g, b in zip(state.groups, blocks)))


def prefix_stats(state, stats) -> Dict[str, float]:
  """`Engine.prefix_stats()`: the device counters (one sync) with the host's counts of
  hit, prefill and computed tokens (`stats`, the scheduler's Counter) and the hit rate."""
  d = prefix_counters(state)
  d.update(hit_tokens=stats["prefix_hit_tokens"], prefill_tokens=stats["prefill_tokens"],
           computed_tokens=stats["computed_tokens"])
  d["hit_rate"] = d["hit_blocks"] / d["query_blocks"] if d["query_blocks"] else 0.0
  return d


def counts_after_reset(state, counts: DeviceCounts) -> DeviceCounts:
  """The scheduler's device counts after `reset_device_cache` (one sync)."""
  c = prefix_counters(state)
  free, evictable = c["num_free"], c["evictable_blocks"]
  return DeviceCounts(free, free + evictable, evictable, sole_blocks=counts.sole_blocks)


class KVTiers:
  """The host tier and the KV events of an engine (one per Engine).

  Attributes:
    host: the host pool (None without a host tier).
    stats: Counter of exchange "calls", "promoted_blocks" and "prefix_host_hit_tokens".
  """

  def __init__(self, cache_config, options, pages):
    if cache_config.num_host_blocks and options.hash_mode != "chained":
      raise ValueError(f"num_host_blocks needs hash_mode='chained' (host hits trust the "
                       f"chained hash), got hash_mode={options.hash_mode!r}")
    self.host = tier_lib.make_tier(cache_config, pages)
    self.stats = collections.Counter()
    self._events: List[events_lib.KVEvent] = []
    self._device_view = events_lib.DeviceView()
    self._cache_config = cache_config
    self._num_decode_steps = options.decode_steps_per_sync

  def plan(self, batch, inputs, scheduler, swapped_in: bool) -> Optional[tier_lib.Plan]:
    """The exchange this step needs before it (`tier.plan`), or None: no host tier, or
    nothing to promote and no eviction possible."""
    if self.host is None:
      return None
    c = self._cache_config
    starts = np.full((c.max_seqs,), -1, np.int64)
    for ch in batch.chunks:
      if not ch.allocate:
        starts[ch.slot] = ch.start
    share = bool(batch.forks or batch.post_forks or swapped_in or any(
        len(g.seqs) > 1 for g in scheduler.running))
    return tier_lib.plan(self.host, inputs, scheduler.counts, swapped_in=swapped_in,
                         block_size=c.block_size, num_blocks=c.num_blocks,
                         num_decode_steps=self._num_decode_steps, starts=starts,
                         may_share=share)

  def finish(self, plan: tier_lib.Plan, out, counts: DeviceCounts):
    """The host side of an exchange the device ran: its victims stored on the host, its
    events and counters recorded. Returns (the device counts after it, the host store's
    exception or None: the caller re-raises it once the counts are recorded)."""
    promoted, counts, error = tier_lib.finish(self.host, plan, out, counts)
    self._events += self.host.take_events()
    self.stats.update(calls=1, promoted_blocks=promoted,
                      prefix_host_hit_tokens=promoted * self._cache_config.block_size)
    return counts, error

  def read_step_log(self, out, state) -> None:
    """Records the device events in a step's outputs (`StepOutputs.kv_log`); an
    overflowed log is made good by one read of what the device cache holds."""
    if out is None or not hasattr(out, "kv_log") or state.prefix is None:
      return
    self._events += self._device_view.take(
        np.asarray(out.kv_log), int(out.kv_log_len),
        lambda: jax.device_get(_cached_hashes(state)))

  def cleared(self) -> None:
    """Both tiers were emptied (`Engine.reset_prefix_cache`): one "cleared" event each."""
    self._events += self._device_view.clear()
    if self.host is not None:
      self.host.clear()
      self._events += self.host.take_events()

  def drain(self) -> List[events_lib.KVEvent]:
    """The events not yet handed out, oldest first; none are kept."""
    out, self._events = self._events, []
    return out

  def metrics(self) -> Dict[str, Any]:
    """The host tier's part of `Engine.metrics()`."""
    return dict(num_host_blocks=self._cache_config.num_host_blocks,
                num_free_host_blocks=self.host.num_free if self.host is not None else 0,
                prefix_host_hit_tokens=self.stats["prefix_host_hit_tokens"])
