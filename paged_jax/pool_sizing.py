"""How many blocks each KV pool gets: the main pool from a memory budget, as a serving
system sizes it, and hybrid KV's sliding-window pool from the engine's step limits.

`CacheConfig.from_memory_budget` and `ModelConfig.cache_config` (`hybrid_fields`) call in
here, and `CacheConfig` checks its sliding-pool fields with `check_sliding_fields`. The
functions read configs by their fields, so this module imports nothing from paged_jax but
`checks` (`config` imports it, and re-exports `sliding_blocks_per_seq` and
`sliding_pool_blocks`). What happens to the sliding pool at run time (blocks that slid out
of every window go back to it) is `paged_jax.block_window`.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from paged_jax.checks import cdiv, check_int


def sliding_blocks_per_seq(sliding_window: int, block_size: int, tokens_per_step: int) -> int:
  """Most blocks one sequence holds in a hybrid-KV sliding pool: after a step it keeps
  the blocks of its last `sliding_window - 1` tokens (what its next query can still see),
  and a step adds at most `tokens_per_step` tokens before the out-of-window blocks go
  back: cdiv(sliding_window - 1 + tokens_per_step, block_size) + 1 (a window rarely
  starts on a block boundary)."""
  return cdiv(sliding_window - 1 + tokens_per_step, block_size) + 1


def sliding_pool_blocks(sliding_window: int, block_size: int, max_seqs: int,
                        max_num_batched_tokens: int, decode_steps_per_sync: int = 1,
                        num_blocks: Optional[int] = None) -> int:
  """Blocks a hybrid-KV sliding pool needs so it can never run short: the fewer of two
  bounds. (1) Windows: sequence s holds at most cdiv(W - 1, bs) + 1 + cdiv(n_s, bs)
  blocks (`sliding_blocks_per_seq`, n_s the tokens it adds in a step), and a step adds at
  most `max_num_batched_tokens` tokens plus `decode_steps_per_sync - 1` per sequence in
  all: max_seqs * (cdiv(W - 1, bs) + 2) + (those tokens) // bs (each cdiv rounds up by
  < 1). (2) The main pool's `num_blocks` (when given): every sliding block in use is the
  twin of a distinct main block (a slot's sliding block at logical j of its main block
  at j; a cached one, `prefix_cache.sliding`'s companion, of its cached main block, and
  companions whose twin was evicted go first when the step needs room), so the sliding
  pool never holds more blocks than the main one. (1) binds for long sequences and
  many slots, (2) whenever sequences are shorter than the window: then a window per
  slot would be memory no sequence can use."""
  tokens = max_num_batched_tokens + max_seqs * (decode_steps_per_sync - 1)
  windows = max_seqs * (cdiv(sliding_window - 1, block_size) + 2) + tokens // block_size
  return windows if num_blocks is None else min(windows, int(num_blocks))


def hybrid_fields(model: Any, hybrid_kv: Optional[bool], max_num_batched_tokens: int,
                  decode_steps_per_sync: int, kwargs: dict, config_cls: Any) -> None:
  """`ModelConfig.cache_config`'s hybrid KV fields, added to `kwargs` (CacheConfig fields;
  `config_cls` is CacheConfig, for its defaults). `hybrid_kv` None (the default): on iff
  the model has both sliding-window and full-attention layers (Gemma-2 / 3; all-sliding
  Mistral stays on one pool); True insists (one-line error otherwise); False: one pool."""
  if hybrid_kv is not None and not isinstance(hybrid_kv, bool):
    raise TypeError(f"hybrid_kv must be a bool or None, got {type(hybrid_kv).__name__}")
  layers = model.sliding_layers
  both = bool(layers) and len(layers) < model.num_layers
  if hybrid_kv and not both:
    raise ValueError(f"hybrid_kv needs both sliding-window and full-attention layers; "
                     f"this model has {len(layers)} sliding of {model.num_layers}")
  if not (both if hybrid_kv is None else hybrid_kv):
    return
  check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
  check_int("decode_steps_per_sync", decode_steps_per_sync, 1)
  probe = config_cls(**{k: v for k, v in kwargs.items() if k != "num_sliding_blocks"})
  kwargs.setdefault("num_sliding_blocks", sliding_pool_blocks(
      model.sliding_window, probe.block_size, probe.max_seqs, max_num_batched_tokens,
      decode_steps_per_sync, probe.num_blocks))
  kwargs.update(sliding_layers=layers, sliding_window=model.sliding_window)


def check_sliding_fields(config: Any) -> Tuple[int, ...]:
  """A `CacheConfig`'s hybrid KV fields: all set or all off (one-line errors naming the
  field). Returns `sliding_layers` as a tuple (hashable even when given a list)."""
  layers = tuple(config.sliding_layers)
  if not layers:
    if config.sliding_window is not None or config.num_sliding_blocks:
      raise ValueError("sliding_window and num_sliding_blocks need sliding_layers "
                       "(hybrid KV); got sliding_layers=()")
    return layers
  if (any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in layers)
      or list(layers) != sorted(set(layers)) or layers[0] < 0
      or layers[-1] >= config.num_layers or len(layers) == config.num_layers):
    raise ValueError(f"sliding_layers must be sorted distinct layer indices in "
                     f"[0, {config.num_layers}) leaving at least one full-attention layer, "
                     f"got {list(layers)}")
  if config.sliding_window is None:
    raise ValueError("sliding_window must be set (>= 1) when sliding_layers is")
  check_int("sliding_window", config.sliding_window, 1)
  check_int("num_sliding_blocks", config.num_sliding_blocks, 1, 2**31 - 1)
  if config.num_sliding_blocks * config.block_size > 2**31 - 1:
    raise ValueError(f"num_sliding_blocks * block_size must be <= 2**31 - 1, got "
                     f"{config.num_sliding_blocks} * {config.block_size}")
  return layers


def check_host_blocks(config: Any) -> None:
  """A `CacheConfig`'s `num_host_blocks`: an int in [0, 2**31 - 1] (a ValueError for a
  wrong type too, the contract's one-line error), > 0 only under the prefix cache and
  without hybrid KV (the host tier sits under the prefix cache)."""
  h = config.num_host_blocks
  if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not 0 <= h < 2**31:
    raise ValueError(f"num_host_blocks must be an int in [0, 2**31 - 1], got {h!r}")
  if h and (not config.enable_prefix_caching or config.hybrid):
    raise ValueError("num_host_blocks > 0 needs enable_prefix_caching=True and no hybrid "
                     f"KV (the host tier sits under the prefix cache), got "
                     f"num_host_blocks={h}")


def from_memory_budget(
    model: Any,
    *,
    block_size: int = 16,
    kv_budget_bytes: Optional[int] = None,
    gpu_memory_utilization: Optional[float] = None,
    max_seqs: int = 64,
    max_model_len: Optional[int] = None,
    dtype: str = "auto",
    **kwargs,
):
  """`CacheConfig.from_memory_budget`: a `model.cache_config(...)` whose pool fills a
  memory budget with whole blocks.

  Exactly one of `kv_budget_bytes` (bytes for K/V pages) or
  `gpu_memory_utilization` (fraction in (0, 1] of the first device's free
  memory; falls back to an error on devices that report no memory stats) must
  be given. `max_model_len` defaults to the model's max positions. `dtype` is the
  page dtype; "auto" (default) is the model's, and the pool's bytes are counted in it.
  With hybrid KV (`ModelConfig.cache_config`'s default for a model with sliding-window and
  full-attention layers) both pools share the budget: the sliding pool is
  `sliding_pool_blocks` (never more than the main pool's blocks), the main pool the rest.
  """
  if (kv_budget_bytes is None) == (gpu_memory_utilization is None):
    raise ValueError("give exactly one of kv_budget_bytes or gpu_memory_utilization")
  if gpu_memory_utilization is not None:
    if not 0.0 < gpu_memory_utilization <= 1.0:
      raise ValueError(
          f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    import jax  # pylint: disable=g-import-not-at-top
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
      raise ValueError(
          "gpu_memory_utilization needs a device that reports memory_stats(); "
          "pass kv_budget_bytes on this backend")
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    kv_budget_bytes = int(free * gpu_memory_utilization)
  check_int("kv_budget_bytes", int(kv_budget_bytes), 1)
  max_model_len = max_model_len or model.max_position_embeddings
  # A probe as large as int32 slots allow: its sliding pool is the window bound alone.
  probe = model.cache_config(block_size=block_size, num_blocks=(2**31 - 1) // block_size,
                             max_seqs=max_seqs,
                             max_blocks_per_seq=max(1, cdiv(max_model_len, block_size)),
                             dtype=dtype, **kwargs)
  per_layer_block = probe.kv_bytes_per_token // probe.num_layers * block_size
  full, slide = len(probe.full_layers), len(probe.sliding_layers)
  budget, bound = int(kv_budget_bytes), probe.num_sliding_blocks
  # Hybrid KV: N main blocks cost full * N and the sliding pool slide * min(bound, N)
  # layer-blocks (`sliding_pool_blocks`); the largest N the budget holds. A sliding pool
  # given explicitly comes off the budget as it is.
  num_blocks = budget // (per_layer_block * (full + slide))
  if slide and ("num_sliding_blocks" in kwargs or num_blocks > bound):
    num_blocks = (budget - per_layer_block * slide * bound) // (per_layer_block * full)
  if num_blocks < 1:
    raise ValueError(
        f"kv_budget_bytes={kv_budget_bytes} holds no block of {block_size} tokens "
        f"({probe.kv_bytes_per_token * block_size} bytes per block)")
  if slide and "num_sliding_blocks" not in kwargs:
    return probe.replace(num_blocks=num_blocks, num_sliding_blocks=min(bound, num_blocks))
  return probe.replace(num_blocks=num_blocks)
