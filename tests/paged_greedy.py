"""Greedy decoding of a few prompts through `DecoderForCausalLM` on a paged cache, with host
bookkeeping this small: the model-level harness of the family tests (no engine)."""

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, kv_cache
from paged_jax.config import cdiv
from paged_jax.models.decoder import DecoderForCausalLM


def paged_greedy(config, params, prompts, max_tokens, block_size, *, backend="auto", seed=0,
                 decode_only=False):
  """Decodes every prompt together, `max_tokens` greedy steps.

  The first step prefills all prompts as one ragged batch, each later step decodes one
  token per sequence, on pages whose blocks are handed out in a shuffled order. Every step
  has the prefill's row count (padding rows write nothing), so the step compiles once;
  with `decode_only`, decode steps have one row per sequence and run the decode kernel
  (`AttentionMetadata.decode_only`), as the engine's decode steps do.

  Returns:
    (outputs: one list of max_tokens ids per prompt, f32[len(prompts), vocab] logits of the
    last step).
  """
  n = len(prompts)
  per_seq = cdiv(max(len(p) for p in prompts) + max_tokens, block_size)
  cache = config.cache_config(block_size=block_size, num_blocks=n * per_seq, max_seqs=n,
                              max_blocks_per_seq=per_seq, hybrid_kv=False)   # one pool
  tables = np.random.default_rng(seed).permutation(n * per_seq).reshape(n, per_seq)
  rows = sum(len(p) for p in prompts)
  pages = kv_cache.init(cache)
  step = jax.jit(DecoderForCausalLM(config, attention_backend=backend).apply)
  lens, new, outs = [0] * n, [list(p) for p in prompts], [[] for _ in prompts]
  logits = None
  for _ in range(max_tokens):
    tokens, positions, slots, cu = [], [], [], [0]
    for i in range(n):
      for pos in range(lens[i], lens[i] + len(new[i])):
        positions.append(pos)
        slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
      tokens += new[i]
      lens[i] += len(new[i])
      cu.append(len(tokens))
    decoding = decode_only and len(tokens) == n
    pad = (n if decoding else rows) - len(tokens)
    meta = attention.AttentionMetadata(
        slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32), kv_lens=jnp.asarray(lens, jnp.int32),
        cu_q_lens=jnp.asarray(cu, jnp.int32), num_seqs=jnp.asarray(n, jnp.int32),
        logits_indices=jnp.asarray([c - 1 for c in cu[1:]], jnp.int32), decode_only=decoding)
    logits, pages = step(params, jnp.asarray(tokens + [0] * pad, jnp.int32),
                         jnp.asarray(positions + [0] * pad, jnp.int32), pages, meta)
    nxt = np.asarray(jnp.argmax(logits, axis=-1))
    for i in range(n):
      outs[i].append(int(nxt[i]))
      new[i] = [int(nxt[i])]
  return outs, np.asarray(logits)
