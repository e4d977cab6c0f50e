"""Tensor-parallel memory scaling of the paged KV cache: what a per-device budget holds,
served and timed on a mesh of (simulated) devices.

    tp_scaling.fit_full_length(requests, cache)          # requests whose blocks fit at once
    tp_scaling.serve(tp_engine, requests)["peak_running"]
    run = tp_scaling.decode_call(tp_model, params, cache, batch=8, vocab_size=256); run()
    tp_scaling.budget_rows(model_config, [1, 2, 4, 8], gib=16.0, block_size=16)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention import AttentionMetadata
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.distributed import cache_config_for_device_budget


def fit_full_length(requests, cache: CacheConfig) -> int:
  """Requests (in order) whose full-length blocks fit the pool together."""
  used = 0
  for i, r in enumerate(requests):
    used += cache.blocks_for(r.total_len)
    if used > cache.num_blocks:
      return i
  return len(requests)


def serve(engine, requests) -> dict:
  """Serves `requests` (all at t = 0, greedy) on `engine`; {"peak_running" (most requests
  running after a step), "engine_steps", "preemptions", "generated_tokens",
  "serve_seconds"}."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  for r in requests:
    engine.add_request([int(t) for t in r.prompt_token_ids],
                       SamplingParams(max_tokens=r.output_len, temperature=0.0))
  peak, steps, t0 = 0, 0, time.perf_counter()
  while engine.has_unfinished():
    engine.step()
    peak = max(peak, engine.last_step.num_running_groups)
    steps += 1
  engine.flush()
  return dict(peak_running=peak, engine_steps=steps, preemptions=engine.num_preemptions,
              generated_tokens=int(engine.stats["generated_tokens"]),
              serve_seconds=time.perf_counter() - t0)


def decode_call(tp_model, params, cache: CacheConfig, batch: int, vocab_size: int):
  """A compiled, warmed-up decode forward: `batch` sequences at context 4 blocks, 1 token each.

  Returns a no-argument callable that runs one step and waits for it.
  """
  ctx = 4 * cache.block_size
  per_seq = cache.blocks_for(ctx)
  tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq) % cache.num_blocks
  slots = tables[:, -1] * cache.block_size + (ctx - 1) % cache.block_size
  meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                           kv_lens=jnp.full((batch,), ctx, jnp.int32),
                           cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
                           num_seqs=jnp.asarray(batch, jnp.int32),
                           logits_indices=jnp.arange(batch, dtype=jnp.int32))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab_size, batch), jnp.int32)
  positions = jnp.full((batch,), ctx - 1, jnp.int32)
  step = jax.jit(tp_model.apply, donate_argnums=(3,))
  state = {"pages": tp_model.init_pages(cache)}

  def run():
    logits, state["pages"] = step(params, tokens, positions, state["pages"], meta)
    logits.block_until_ready()

  run()   # compile + warm up
  return run


def budget_rows(model_config: ModelConfig, tps, gib: float, block_size: int) -> list:
  """Computed rows of `model_config` at `gib` GiB of KV per device, per tp: KV bytes per
  token per device, blocks, tokens and full-context sequences the budget holds."""
  rows = []
  for tp in tps:
    cache = cache_config_for_device_budget(model_config, tp, int(gib * 2**30),
                                           block_size=block_size, max_seqs=256,
                                           dtype=model_config.dtype)
    rows.append(dict(tp=tp, kv_bytes_per_token_per_device=cache.kv_bytes_per_token // tp,
                     num_blocks=cache.num_blocks, tokens=cache.num_slots,
                     full_context_seqs=cache.num_slots // model_config.max_position_embeddings))
  return rows
