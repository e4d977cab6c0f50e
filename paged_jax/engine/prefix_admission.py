"""Prefix caching in the serving engine: admission by longest cached prefix.

    engine = PrefixCachingEngine(model_config, params,
                                 cache_config.replace(enable_prefix_caching=True))
    engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    engine.prefix_stats()   # hit rate, prefill tokens computed, cached blocks, ...

What changes against `Engine` (the engine's step itself is reused unchanged):
  * admission: when the scheduler gives a waiting group its slots, the leader's
    prompt is looked up on device (`prefix_cache.attach`, one small donated
    jit): the longest cached run of full blocks, at most `(len - 1) // bs`
    blocks so the last prompt token is always recomputed, joins the slot's
    block table (ref_count += 1) and the sequence starts with
    `num_computed = hit tokens`; its first chunk is an append of the rest, so
    only the rest is prefilled (ragged attention over the cached blocks);
  * around every device step, `prefix_cache_step.before` (touch blocks being
    freed, evict LRU cache-only blocks for the step's worst-case need) and
    `.after` (record computed tokens, register newly full blocks, copy chains
    along forks) run as two more donated jits;
  * the free-block count the scheduler plans with is `num_free + evictable`
    (cached blocks nobody holds are reclaimable), so caching never preempts.
Preempted (recompute) requests come back through the same admission and hit
their own still-cached blocks. Swap-ins evict for their blocks first.
"""

from __future__ import annotations

import collections
from typing import Dict

import jax
import numpy as np

from paged_jax import prefix_cache as pc
from paged_jax import prefix_cache_step as pcs
from paged_jax.config import OK
from paged_jax.engine.engine import Engine
from paged_jax.engine.scheduler import Scheduler, cdiv

_attach = jax.jit(pc.attach, donate_argnums=(0, 1))
_before = jax.jit(pcs.before, donate_argnums=(0, 1),
                  static_argnames=("num_decode_steps", "max_evict"))
_after = jax.jit(pcs.after, donate_argnums=(0, 1), static_argnames=("max_items",))
_ensure_free = jax.jit(pc.ensure_free, donate_argnums=(0, 1), static_argnames=("max_evict",))
_reset = jax.jit(pc.reset, donate_argnums=(0, 1))


@jax.jit
def _counters(cache, blocks):
  return dict(hit_blocks=cache.hit_blocks, query_blocks=cache.query_blocks,
              evictions=cache.evictions, cached_blocks=pc.num_cached_blocks(cache),
              evictable_blocks=pc.num_evictable(cache, blocks), num_free=blocks.num_free)


class _AdmittingScheduler(Scheduler):
  """Scheduler that calls `on_admit(group)` right after a group gets its slots."""

  def __init__(self, on_admit, **kwargs):
    super().__init__(**kwargs)
    self._on_admit = on_admit

  def _assign_slots(self, group):
    super()._assign_slots(group)
    self._on_admit(group)


class PrefixCachingEngine(Engine):
  """`Engine` with automatic prefix caching (needs `enable_prefix_caching=True`).

  Extra args:
    max_probe: hash-table slots searched per block.
    hash_mode: "chained" or "constant" (every block collides: tests only).
  """

  def __init__(self, model_config, params, cache_config, *, max_probe: int = 16,
               hash_mode: str = "chained", **kwargs):
    if not getattr(cache_config, "enable_prefix_caching", False):
      raise ValueError("PrefixCachingEngine needs cache_config.enable_prefix_caching=True")
    super().__init__(model_config, params, cache_config, **kwargs)
    c = cache_config
    old = self.scheduler
    self.scheduler = _AdmittingScheduler(
        self._admit, block_size=c.block_size, max_seqs=c.max_seqs,
        max_num_batched_tokens=self.max_num_batched_tokens,
        preemption_mode=old.preemption_mode)
    self.prefix = pcs.init(c, max_probe=max_probe, hash_mode=hash_mode)
    self._max_new = pcs.max_new_blocks(self.max_num_batched_tokens, c.max_seqs,
                                       c.block_size, self.decode_steps_per_sync)
    self._inner_step = self._step
    self._step = self._cached_step
    self.prefix_counts = collections.Counter()

  # ---- admission ---------------------------------------------------------------------
  def _admit(self, group) -> None:
    """Attaches the leader's longest cached prefix to its freshly assigned slot."""
    lead = group.leader
    if lead.on_device or lead.num_computed:
      return
    c = self.cache_config
    # While children wait to fork at the prompt's end, only the prompt may hit.
    n = lead.prompt_len if any(s.pending_fork for s in group.seqs) else len(lead.tokens)
    tokens = np.zeros((c.max_seq_len,), np.int32)
    tokens[:n] = lead.tokens[:n]
    blocks = self.state.blocks
    cache, blocks, hit, status = _attach(self.prefix.cache, blocks, np.int32(lead.slot),
                                         tokens, np.int32(n))
    self.prefix = self.prefix.replace(cache=cache)
    self.state = self.state.replace(blocks=blocks)
    hit, status = int(hit), int(status)
    if status != OK:
      raise RuntimeError(f"prefix attach of slot {lead.slot} failed with status {status}")
    lead.num_computed = hit
    lead.on_device = True
    self.prefix_counts["hit_tokens"] += hit
    self.prefix_counts["lookup_tokens"] += n

  # ---- the bracketed step ------------------------------------------------------------
  def _cached_step(self, params, state, inputs):
    ps, blocks = _before(self.prefix, state.blocks, inputs,
                         num_decode_steps=self.decode_steps_per_sync, max_evict=self._max_new)
    self.prefix = ps            # (the old one was donated)
    inputs = inputs.replace(free_slots=np.full(inputs.free_slots.shape, -1, np.int32))
    state, out = self._inner_step(params, state.replace(blocks=blocks), inputs)
    ps, blocks, available = _after(ps, state.blocks, inputs, out, max_items=self._max_new)
    self.prefix = ps
    return state.replace(blocks=blocks), out.replace(num_free=available)

  def _swap_ins(self, batch) -> None:
    need = sum(cdiv(s.num_computed, self.cache_config.block_size)
               for s in batch.swap_in if s.swapped_kv is not None)
    if need:
      cache, blocks, _ = _ensure_free(self.prefix.cache, self.state.blocks, np.int32(need),
                                      max_evict=self.cache_config.max_blocks_per_seq
                                      * self.cache_config.max_seqs)
      self.prefix = self.prefix.replace(cache=cache)
      self.state = self.state.replace(blocks=blocks)
    super()._swap_ins(batch)

  def _process(self, batch, out):
    for ch in batch.chunks:
      seq, nc = ch.seq, ch.seq.num_computed
      self.prefix_counts["prefill_tokens"] += max(0, min(nc + ch.num_tokens, seq.prompt_len) - nc)
      self.prefix_counts["computed_tokens"] += ch.num_tokens
    return super()._process(batch, out)

  # ---- stats / reset -----------------------------------------------------------------
  def prefix_stats(self) -> Dict[str, float]:
    """Device counters plus host counts: hit_rate (blocks), hit/lookup/prefill tokens."""
    d = {k: int(v) for k, v in jax.device_get(
        _counters(self.prefix.cache, self.state.blocks)).items()}
    d.update(self.prefix_counts)
    d["hit_rate"] = d["hit_blocks"] / d["query_blocks"] if d["query_blocks"] else 0.0
    return d

  def reset_prefix_cache(self) -> None:
    """Drops every cached block (running sequences keep theirs) and zeroes counters."""
    cache, blocks = _reset(self.prefix.cache, self.state.blocks)
    self.prefix = self.prefix.replace(cache=cache)
    self.state = self.state.replace(blocks=blocks)
    self.num_free = int(blocks.num_free) + 0
    self.prefix_counts.clear()
