"""A stand-in for the model's forward: the real engine at any scale, with nothing heavy.

    config, params = standin.model(vocab_size=256)
    cache = config.cache_config(block_size=16, num_blocks=982, max_seqs=256,
                                max_blocks_per_seq=128)          # OPT-13B's 15.7K slots
    engine = Engine(config, params, cache, model_apply=standin.apply)

The `Engine` stays the real one (scheduler, jitted block manager, prefix cache,
copy-on-write, swapping, sampling); only `model_apply` is replaced. The stand-in's K/V
pages are 1 layer x 1 KV head x `HEAD_DIM` features, so a pool of OPT-175B's 60K slots
is 4 MB; it writes each new token's K/V to its slot (so the pages still follow the block
tables: `page_tokens` reads them back) and returns logits that are a cheap hash of
(token, position, vocabulary id): deterministic, different per row, so greedy decoding,
sampling and beam search all pick varied tokens. It computes no attention.

Requests run to `max_tokens`: the stand-in has no end-of-sequence token, so pass no
`stop_token_ids` (as the serving harness does), and each request generates exactly its
trace's output length.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import kv_cache
from paged_jax.config import ModelConfig

HEAD_DIM = 8          # features per K/V head: the smallest page that still holds a token
_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)   # odd 32-bit multipliers


def config(vocab_size: int = 256, max_position_embeddings: int = 2048) -> ModelConfig:
  """The stand-in's ModelConfig: 1 layer, 1 head, 1 KV head of HEAD_DIM features.

  `vocab_size` must exceed every prompt id; `max_position_embeddings` caps the
  engine's max_model_len (the setting's context, e.g. 2,048 for OPT)."""
  return ModelConfig(vocab_size=vocab_size, hidden_size=HEAD_DIM,
                     intermediate_size=HEAD_DIM, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=HEAD_DIM, max_position_embeddings=max_position_embeddings)


def hybrid_config(vocab_size: int = 256, max_position_embeddings: int = 2048,
                  sliding_window: int = 4096) -> ModelConfig:
  """`config` with 2 layers, layer 0 sliding-window (`sliding_window` tokens) and layer 1
  full attention: the least a hybrid-KV engine needs (`CacheConfig.sliding_layers`), for
  a sliding-window model's paper-scale runs (`bench.paper_scale`). A pool's blocks serve
  every layer of their group alike, so 2 layers schedule as Gemma-2's 42 do."""
  return dataclasses.replace(config(vocab_size, max_position_embeddings), num_layers=2,
                             sliding_window=sliding_window,
                             layer_types=("sliding_attention", "full_attention"))


def model(vocab_size: int = 256, max_position_embeddings: int = 2048,
          sliding_window: Optional[int] = None) -> Tuple[ModelConfig, dict]:
  """(config, params): params of the real model's shapes (the Engine checks them); `apply`
  reads only the vocabulary size from them. A few KB at vocab 256. `sliding_window`: the
  2-layer `hybrid_config` instead (None: the 1-layer `config`)."""
  from paged_jax.models.llama import init_params  # pylint: disable=g-import-not-at-top
  cfg = (config(vocab_size, max_position_embeddings) if sliding_window is None else
         hybrid_config(vocab_size, max_position_embeddings, sliding_window))
  return cfg, init_params(cfg, jax.random.key(0))


def _hash(x: jax.Array) -> jax.Array:
  """A 32-bit integer mix (xorshift-multiply), elementwise on uint32."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(_MIX[3])
  x = x ^ (x >> 15)
  return x


def apply(params, tokens: jax.Array, positions: jax.Array, kv_pages: kv_cache.KVPages,
          meta) -> Tuple[jax.Array, kv_cache.KVPages]:
  """The model's `apply` signature, at no model's cost.

  Args:
    params: `model`'s params ({"params": ...}); only the vocabulary size is read.
    tokens: i32[T] new token ids; positions: i32[T] their positions.
    kv_pages: KVPages of `config`'s shapes, or with hybrid KV (`hybrid_config`) a
      HybridPages of its two pools.
    meta: AttentionMetadata (slot_mapping i32[T], logits_indices i32[R]; with hybrid KV
      `meta.sliding` maps the sliding pool's slots).
  Returns:
    (f32[R, vocab] logits, pages with each new token's K/V written to its slot of the
    first layer of each pool: K holds the token id, V its position, in every feature).
  """
  vocab = params["params"]["model"]["embed_tokens"]["embedding"].shape[0]   # static
  tok = tokens.astype(jnp.float32)
  k_new = jnp.broadcast_to(tok[:, None, None], tok.shape + (1, HEAD_DIM))
  v_new = jnp.broadcast_to(positions.astype(jnp.float32)[:, None, None], k_new.shape)
  if isinstance(kv_pages, kv_cache.HybridPages):
    pages = kv_pages.replace(
        full=kv_cache.write(kv_pages.full, 0, k_new, v_new, meta.slot_mapping),
        sliding=kv_cache.write(kv_pages.sliding, 0, k_new, v_new, meta.sliding.slot_mapping))
  else:
    pages = kv_cache.write(kv_pages, 0, k_new, v_new, meta.slot_mapping)
  rows = meta.logits_indices
  row_tok = tokens[rows].astype(jnp.uint32)
  row_pos = positions[rows].astype(jnp.uint32)
  ids = jnp.arange(vocab, dtype=jnp.uint32)
  h = _hash(row_tok[:, None] * jnp.uint32(_MIX[0]) + row_pos[:, None] * jnp.uint32(_MIX[1])
            + ids[None, :] * jnp.uint32(_MIX[2]))
  # Uniform-ish in [-4, 4): spread enough that sampling at temperature 1 is not uniform.
  logits = (h >> 8).astype(jnp.float32) * (8.0 / 2**24) - 4.0
  return logits, pages


def page_tokens(pages: kv_cache.KVPages, block_table: np.ndarray, length: int) -> np.ndarray:
  """i32[length] the token ids the stand-in wrote for a sequence's first `length` tokens
  (read through its block table): the pages follow the block manager's tables."""
  k = np.asarray(pages.k[0])[0]                  # [num_blocks, block_size, HEAD_DIM]
  bs = k.shape[1]
  pos = np.arange(length)
  return k[np.asarray(block_table)[pos // bs], pos % bs, 0].astype(np.int32)
