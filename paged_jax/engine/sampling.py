"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p.

Every row of a batch carries its own sampling parameters, so one compiled step
serves any mix of requests. Randomness is seeded per request, never per batch:
the key of row s is `fold_in(key(seed[s]), sample_index[s])`, where
`sample_index` counts the tokens that sequence has generated so far. A request
therefore draws the same tokens whatever else shares its batch, whether it was
preempted and recomputed, and whatever `decode_steps_per_sync` is.

Semantics per row (vLLM's):
  temperature == 0     greedy (argmax; ties -> lowest id).
  top_k <= 0           no top-k cut; else keep the k most likely tokens.
  top_p in (0, 1]      keep the smallest set of most likely tokens whose mass
                       reaches top_p (the most likely token is always kept).
Filters are applied to the temperature-scaled distribution; tokens tied with
the cut-off value are kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array) -> jax.Array:
  """Scaled logits with filtered-out tokens at -inf.

  Args:
    logits: f32[S, V].
    temperature: f32[S] (> 0 rows are scaled; 0 rows are treated as 1 here).
    top_k: i32[S], <= 0 disables.
    top_p: f32[S] in (0, 1].

  Returns:
    f32[S, V].
  """
  vocab = logits.shape[-1]
  temp = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
  scaled = logits.astype(jnp.float32) / temp[:, None]
  sorted_desc = -jnp.sort(-scaled, axis=-1)                                 # [S, V]
  # Top-k: the k-th largest value is the smallest kept.
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)         # [S, 1]
  # Top-p over the top-k survivors: keep rank r while the mass before it < top_p.
  ranks = jnp.arange(vocab)[None, :]
  in_k = ranks < k[:, None]
  probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  # top_p >= 1 disables the cut exactly (f32 mass can round to 1 before the tail).
  keep_sorted = in_k & ((mass_before < top_p[:, None]) | (ranks == 0) | (top_p[:, None] >= 1))
  num_keep = jnp.sum(keep_sorted, axis=-1)                                   # >= 1
  cutoff = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
  cutoff = jnp.maximum(cutoff, kth)
  return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def row_keys(seeds: jax.Array, sample_index: jax.Array) -> jax.Array:
  """Typed PRNG keys [S]: fold_in(key(seed), sample_index) per row."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
      seeds.astype(jnp.uint32), sample_index.astype(jnp.uint32))


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, sample_index: jax.Array, *, all_greedy: bool = False) -> jax.Array:
  """One token per row.

  Args:
    logits: f32[S, V].
    temperature, top_k, top_p: per-row parameters, see `filtered_logits`.
    seeds: i32[S] per-request (per-sequence) seeds.
    sample_index: i32[S] tokens the sequence generated before this one.
    all_greedy: static; the host's promise that every row that matters has
      temperature 0: argmax only, no [S, V] sort, no random draw (the same tokens).

  Returns:
    i32[S] token ids.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if all_greedy:
    return greedy
  hot = temperature > 0

  # No lax.cond on "any row hot / filtered": on GPU a conditional copies its branch index
  # to the host and blocks, every step (and every iteration of the multi-step decode
  # loop). Both sides are computed and selected per row, so the filter's [S, V] sort
  # runs whenever a row samples (XLA:CPU, S=16, V=256: 1.9 ms vs 0.14 ms for argmax
  # alone); all-greedy steps skip it through the static `all_greedy` instead.
  temp = jnp.where(hot, temperature, 1.0).astype(jnp.float32)
  plain = logits.astype(jnp.float32) / temp[:, None]
  filtered = hot & ((top_k > 0) | (top_p < 1))
  masked = jnp.where(filtered[:, None], filtered_logits(logits, temperature, top_k, top_p),
                     plain)
  keys = row_keys(seeds, sample_index)
  drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, masked).astype(jnp.int32)
  return jnp.where(hot, drawn, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log p(tokens[r]) under row r's raw distribution (no temperature, top-k or top-p: the
  model's own probability, as OpenAI's and vLLM's `logprobs` report it).

  Args:
    logits: f32[R, V]; tokens: i32[R].

  Returns:
    f32[R].
  """
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def top_logprobs(logits: jax.Array, k: int):
  """The k best log-probabilities of each row (beam search candidates, reported
  alternatives).

  Args:
    logits: f32[S, V]; k: static, <= V.

  Returns:
    (f32[S, k] log-probs, descending; i32[S, k] token ids). Ties -> lower id first.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  values, ids = jax.lax.top_k(logp, k)   # k static
  return values, ids.astype(jnp.int32)
