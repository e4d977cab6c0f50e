"""Shared model, cache and prompts of the distributed tests (any device count).

Used by tests/distributed_cases.py (8 simulated devices), tests/distributed_family_cases.py
(every model family, 4 simulated devices), tests/multiprocess_worker.py (2 processes x 2
devices) and the single-device references in the *_test.py files.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention
from paged_jax.config import ModelConfig
from paged_jax.models import llama


def model_config(**kw) -> ModelConfig:
  # 16 query heads over 8 KV heads (GQA, group 2): every tp in {1, 2, 4, 8} divides both.
  base = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=16,
              num_kv_heads=8, head_dim=8, rope_theta=500.0, max_position_embeddings=256)
  base.update(kw)
  return ModelConfig(**base)


def random_params(config, seed, matrix_scale=1.5):
  """Flax-initialised tree refilled with O(1) random values so every part matters (and
  logits are well separated): norm weights around 1, matrices ~ N(0, matrix_scale^2 / fan_in).
  """
  params = llama.init_params(config, jax.random.key(seed))
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  new = [1.0 + 0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 1 else
         jax.random.normal(k, x.shape, x.dtype) / np.sqrt(x.shape[0]) * matrix_scale
         for k, x in zip(keys, leaves)]
  return jax.tree_util.tree_unflatten(treedef, new)


CONFIG = model_config()

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_golden")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")


def family_config(family: str) -> ModelConfig:
  """`family`'s model: every family field from its golden fixture's transformers-written
  config.json (biases, QK-norm, sandwich norms, soft caps, per-layer windows of 8, local RoPE
  ...), at a width every tp in {1, 2, 4} splits (the fixtures have one KV head): 8 query
  heads over 4 KV heads of 8 features, MLP 64, CONFIG's vocabulary."""
  with open(os.path.join(GOLDEN, family, "config.json")) as f:
    config = ModelConfig.from_hf_config(json.load(f))
  return dataclasses.replace(config, vocab_size=CONFIG.vocab_size, hidden_size=32, num_heads=8,
                             num_kv_heads=4, head_dim=8, intermediate_size=64)


def every_feature_config() -> ModelConfig:
  """Gemma-3's family fields (QK-norm, (1 + w) sandwich norms, GeGLU, scaled embeddings,
  query_pre_attn_scalar, final soft cap, a window of 8 on layer 0, local RoPE base) plus
  Gemma-2's attention soft cap, Llama's q/k/v, o_proj and MLP biases and Qwen's tied
  embeddings: every feature tensor parallelism must split (or not) in one model."""
  return dataclasses.replace(family_config("gemma3_text"), attn_logit_softcapping=5.0,
                             qkv_bias=True, o_proj_bias=True, mlp_bias=True,
                             tie_word_embeddings=True)
PARAMS_SEED = 7
CACHE = CONFIG.cache_config(block_size=4, num_blocks=48, max_seqs=8, max_blocks_per_seq=12)
# max_num_batched_tokens == max_seqs: one token bucket, so one trace per engine.
ENGINE_KW = dict(max_num_batched_tokens=8, attention_backend="reference")
MAX_TOKENS = 7
_rng = np.random.default_rng(3)
PROMPTS = [[int(t) for t in _rng.integers(0, 97, n)] for n in (9, 3, 14, 5)]


def params():
  return random_params(CONFIG, PARAMS_SEED)


def greedy():
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def ragged_step(rng, tables, lens, new_counts, t_rows=16):
  """Host-built metadata for one ragged step appending new_counts[i] random tokens to seq i.

  tables: per-sequence block lists; lens: per-sequence cached tokens (updated in place).
  Returns numpy (tokens i32[t_rows], positions i32[t_rows], AttentionMetadata fields dict).
  """
  bs = CACHE.block_size
  toks, pos, slots, cu = [], [], [], [0]
  for i, n in enumerate(new_counts):
    for p in range(lens[i], lens[i] + n):
      toks.append(int(rng.integers(0, CONFIG.vocab_size)))
      pos.append(p)
      slots.append(int(tables[i][p // bs]) * bs + p % bs)
    lens[i] += n
    cu.append(len(toks))
  pad = t_rows - len(toks)
  meta = dict(
      slot_mapping=np.asarray(slots + [-1] * pad, np.int32),
      block_tables=np.asarray(tables, np.int32),
      kv_lens=np.asarray(lens, np.int32),
      cu_q_lens=np.asarray(cu, np.int32),
      num_seqs=np.asarray(len(new_counts), np.int32),
      logits_indices=np.asarray([c - 1 for c in cu[1:]], np.int32))
  return (np.asarray(toks + [1] * pad, np.int32), np.asarray(pos + [0] * pad, np.int32), meta)


FORWARD_SCHEDULE = ([7, 5], [1, 6], [1, 1], [3, 1])


def forward_inputs(seed):
  """The ragged steps of FORWARD_SCHEDULE for two sequences on shuffled disjoint blocks."""
  rng = np.random.default_rng(seed)
  perm = rng.permutation(CACHE.num_blocks)
  tables, lens = [list(perm[:12]), list(perm[12:24])], [0, 0]
  return [ragged_step(rng, tables, lens, counts) for counts in FORWARD_SCHEDULE]


def as_meta(fields, put=jnp.asarray):
  return attention.AttentionMetadata(**{k: put(v) for k, v in fields.items()})
