"""The prefix cache's block-level costs and hit rates, without a model.

    prefix_blocks.prefix_hit_rate(requests, 16, prefix_len=80)      # prompt tokens reused
    prefix_blocks.hit_rate_by_block_size([1, 16, 256], num_pairs=48)
    prefix_blocks.lookup_cost([1024, 1 << 20])                      # s per lookup / eviction

Each runs the real jitted `paged_jax.prefix_cache` and `block_manager` ops.
"""

from __future__ import annotations

import functools
import time
from typing import Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import prefix_cache as pc
from paged_jax.config import CacheConfig, cdiv


@functools.lru_cache(maxsize=16)
def _step(block_size: int):
  """Jitted: attach a prompt (cached prefix), append the rest, register its full blocks, free."""

  def step(cache, blocks, tokens, length):
    cache, blocks, hit, st_attach = pc.attach(cache, blocks, 0, tokens, length)
    mask = jnp.zeros((blocks.max_seqs,), bool).at[0].set(True)
    blocks, st_append, _ = bm.append(blocks, mask, jnp.zeros((blocks.max_seqs,), jnp.int32)
                                     .at[0].set(length - hit))
    p = blocks.max_blocks_per_seq
    first = hit // block_size
    item_block = first + jnp.arange(p, dtype=jnp.int32)
    per_block = tokens[:p * block_size].reshape(p, block_size)
    item_tokens = per_block[jnp.clip(item_block, 0, p - 1)]
    cache, blocks = pc.register(cache, blocks, jnp.zeros((p,), jnp.int32), item_block,
                                item_tokens, length // block_size - first)
    cache, blocks, st_free = pc.free(cache, blocks, 0)
    return cache, blocks, hit, jnp.stack([st_attach, st_append[0], jnp.asarray(st_free).reshape(
        -1)[0]])

  return jax.jit(step, donate_argnums=(0, 1))


def prefix_hit_rate(requests: Sequence, block_size: int, *, prefix_len: int = 80,
                    max_len: int = 1024, seed: int = 0) -> float:
  """Fraction of prompt tokens served from `paged_jax.prefix_cache` (a shared system prompt).

  Every request's prompt becomes one shared `prefix_len`-token system prompt
  (the paper's 1-shot prefix is 80 tokens) followed by its own stream prompt;
  the requests run one after another through the real prefix cache (attach,
  append, register full blocks, free), with a pool big enough that nothing is
  evicted. Only whole blocks can hit, and never the prompt's last token.
  """
  prefix = np.random.default_rng([seed, 11]).integers(0, 1 << 15, prefix_len, dtype=np.int32)
  prompts = [np.concatenate([prefix, r.prompt_token_ids]).astype(np.int32) for r in requests]
  if max(len(p) for p in prompts) > max_len + prefix_len:
    raise ValueError(f"prompts must be <= max_len={max_len} tokens")
  # Shapes depend only on (block size, max_len, prefix_len, #requests): one compile
  # per block size serves every stream.
  per_seq = cdiv(max_len + prefix_len, block_size)
  num_blocks = (len(prompts) + 1) * per_seq
  cfg = CacheConfig(block_size=block_size, num_blocks=num_blocks, max_seqs=1,
                    max_blocks_per_seq=per_seq)
  blocks, cache = bm.init(cfg), pc.init(cfg)
  step = _step(block_size)
  hits, statuses = [], []
  for prompt in prompts:
    tokens = np.zeros((per_seq * block_size,), np.int32)
    tokens[:len(prompt)] = prompt
    cache, blocks, hit, status = step(cache, blocks, tokens, np.int32(len(prompt)))
    hits.append(hit)
    statuses.append(status)
  if np.any(np.asarray(jax.device_get(statuses))):
    raise RuntimeError("prefix-cache attach/append/free failed in the hit-rate run")
  return float(np.sum(jax.device_get(hits)) / sum(len(p) for p in prompts))


def hit_rate_by_block_size(block_sizes: Sequence[int], *, num_pairs: int = 64,
                           prompt_len: int = 512, seed: int = 0) -> List[Dict]:
  """Hit rate against block size for prompt pairs that share a random-length prefix.

  Per pair, the first prompt is cached (attach, append, register its full blocks); the
  second, equal to it up to a random cut and different after, attaches: only whole
  blocks hit, so large blocks lose up to block_size - 1 shared tokens.
  Returns one row per block size: {"block_size", "hit_rate" (hit / shared tokens),
  "mean_hit_tokens", "mean_shared_tokens", "lost_tokens" (mean shared tokens missed)}.
  """
  rng = np.random.default_rng(seed)
  firsts = rng.integers(0, 256, (num_pairs, prompt_len)).astype(np.int32)
  cuts = rng.integers(1, prompt_len, num_pairs)
  seconds = firsts.copy()
  for i, c in enumerate(cuts):     # differ from position c on
    seconds[i, c:] = (firsts[i, c:] + 1 + rng.integers(0, 255, prompt_len - c)) % 256
  rows = []
  for bs in block_sizes:
    p = -(-prompt_len // bs)
    cfg = CacheConfig(block_size=bs, num_blocks=2 * p + 2, max_seqs=2, max_blocks_per_seq=p)
    attach = jax.jit(pc.attach)
    append = jax.jit(bm.append)
    register = jax.jit(pc.register)
    free = jax.jit(pc.free)
    reset = jax.jit(pc.reset)
    cache, blocks = pc.init(cfg), bm.init(cfg)
    n_full = prompt_len // bs
    hits = []
    for a, b in zip(firsts, seconds):
      cache, blocks, _, _ = attach(cache, blocks, 0, a, prompt_len)
      blocks, _, _ = append(blocks, jnp.arange(2) == 0, jnp.asarray([prompt_len, 0]))
      cache, blocks = register(cache, blocks, np.zeros((p,), np.int32),
                               np.arange(p, dtype=np.int32),
                               np.pad(a, (0, p * bs - prompt_len)).reshape(p, bs), n_full)
      cache, blocks, hit, _ = attach(cache, blocks, 1, b, prompt_len)
      hits.append(int(hit))
      cache, blocks, _ = free(cache, blocks, jnp.asarray([0, 1]))
      cache, blocks = reset(cache, blocks)
    hits = np.asarray(hits)
    shared = np.minimum(cuts, prompt_len - 1)
    rows.append({"block_size": bs, "hit_rate": float(hits.sum() / shared.sum()),
                 "mean_hit_tokens": float(hits.mean()), "mean_shared_tokens": float(shared.mean()),
                 "lost_tokens": float((shared - hits).mean())})
  return rows


def lookup_cost(num_blocks_list: Sequence[int], *, block_size: int = 16,
                cached_blocks: int = 330, reps: int = 15) -> List[Dict]:
  """Per looked-up block lookup time (median of `reps`); eviction of 16 blocks (ring, donated, as
  the engine runs it) against the O(num_blocks) top-k scan it replaces; the
  per-step O(num_blocks) count of evictable blocks. One sequence of
  `cached_blocks` full blocks is cached and released first."""

  def timed(fn, n=reps):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(n):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t0)
    return float(np.median(ts))

  rows = []
  for nb in num_blocks_list:
    cb = min(cached_blocks, nb // 2)
    cfg = CacheConfig(block_size=block_size, num_blocks=nb, max_seqs=2,
                      max_blocks_per_seq=cb + 1)
    cache, blocks = pc.init(cfg), bm.init(cfg)
    toks = np.random.default_rng(nb).integers(0, 1000, cfg.max_seq_len).astype(np.int32)
    n = cb * block_size + 1
    cache, blocks, _, _ = jax.jit(pc.attach)(cache, blocks, 0, toks, n)
    blocks, _, _ = jax.jit(bm.append)(blocks, jnp.arange(2) == 0, jnp.asarray([n, 0]))
    cache, blocks = jax.jit(pc.register)(
        cache, blocks, np.zeros((cb,), np.int32), np.arange(cb, dtype=np.int32),
        toks[:cb * block_size].reshape(-1, block_size), cb)
    cache, blocks, _ = jax.jit(pc.free)(cache, blocks, 0)
    lookup = jax.jit(pc.lookup)
    assert int(lookup(cache, toks, n)[0]) == cb
    t_lookup = timed(lambda: lookup(cache, toks, n))
    vic = jax.jit(pc.lru_victims, static_argnames=("max_evict",))
    cnt = jax.jit(pc.num_evictable)
    short = blocks.replace(num_free=jnp.asarray(0, jnp.int32))
    t_topk = timed(lambda: vic(cache, short, 16, max_evict=64))
    t_count = timed(lambda: cnt(cache, blocks))
    ev = jax.jit(pc.ensure_free, donate_argnums=(0, 1), static_argnames=("max_evict",))
    ts = []
    for _ in range(min(reps, cb // 16 - 1)):       # each call evicts 16 more, donated
      blocks = blocks.replace(num_free=jnp.asarray(0, jnp.int32))
      t0 = time.perf_counter()
      cache, blocks, k = ev(cache, blocks, 16, max_evict=64)
      jax.block_until_ready(k)
      ts.append(time.perf_counter() - t0)
      assert int(k) == 16
    rows.append({"num_blocks": nb, "lookup_s": t_lookup, "lookup_s_per_block": t_lookup / cb,
                 "evict16_s": float(np.median(ts[1:])), "topk16_s": t_topk,
                 "count_evictable_s": t_count})
  return rows
