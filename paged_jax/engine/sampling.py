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
from jax import lax
import jax.numpy as jnp


def _ordered_keys(x: jax.Array) -> jax.Array:
  """u32 keys with the order of f32 `x` (IEEE bits, negatives flipped): a bisection over
  keys visits every float between two values, so 32 halvings find one exactly."""
  i = lax.bitcast_convert_type(x, jnp.int32)
  i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
  return lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _bisect(lo, hi, go_up, *, steps: int = 32):
  """Per row, the largest u32 t in [lo, hi] with `go_up(t)` (bool[S] of u32[S]), given
  go_up(lo) holds and go_up is monotone (true, then false). A fixed trip count, which
  XLA:GPU recognises: no predicate is read back to the host per iteration
  (gpu_compile_model_test)."""
  def body(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2 + (hi - lo) % 2          # in (lo, hi] while lo < hi
    up = go_up(mid)
    return jnp.where(up, mid, lo), jnp.where(up, hi, mid - 1)
  return lax.fori_loop(0, steps, body, (lo, jnp.maximum(hi, lo)))[0]


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array) -> jax.Array:
  """Scaled logits with filtered-out tokens at -inf, without sorting a row.

  Top-k keeps the values >= the k-th largest; top-p then keeps, among those, the values
  >= the smallest c whose strictly larger values hold less than top_p of the mass (the
  most likely token always stays; ties with a cut-off are kept). Both cut-offs are found by
  bisection over the floats' ordered bit patterns, 32 halvings of O(V) counts or sums per
  row, as FlashInfer's sorting-free sampling does: no [S, V] sort, and its temporaries
  (281.7 MiB for 64 rows at a 128,256-token vocabulary, the whole step compiled for TPU
  v6e) are not needed. `filtered_logits_sorted` is the sort-based reference.

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
  keys = _ordered_keys(scaled)                                              # [S, V]
  lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  # Top-k: the largest key with at least k keys at or above it (the k-th largest).
  kth = _bisect(lo, hi, lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k)
  in_k = keys >= kth[:, None]
  probs = jax.nn.softmax(jnp.where(in_k, scaled, -jnp.inf), axis=-1)
  # Top-p: the smallest key whose strictly larger keys hold < top_p, i.e. one past the
  # largest key whose strictly larger keys still hold >= top_p (that one is cut).
  mass_above = lambda t: jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1)
  holds = lambda t: mass_above(t) >= top_p
  below = _bisect(kth, hi, holds)
  cut = jnp.where(holds(kth), below + 1, kth)
  # top_p >= 1 disables the cut exactly (f32 mass can round to 1 before the tail).
  cut = jnp.where(top_p >= 1, kth, jnp.minimum(cut, hi))
  return jnp.where(keys >= cut[:, None], scaled, -jnp.inf)


def filtered_logits_sorted(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                           top_p: jax.Array) -> jax.Array:
  """`filtered_logits` by sorting each row (the reference; the step does not use it)."""
  vocab = logits.shape[-1]
  temp = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
  scaled = logits.astype(jnp.float32) / temp[:, None]
  sorted_desc = -jnp.sort(-scaled, axis=-1)                                 # [S, V]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)         # [S, 1]
  ranks = jnp.arange(vocab)[None, :]
  in_k = ranks < k[:, None]
  probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = in_k & ((mass_before < top_p[:, None]) | (ranks == 0) | (top_p[:, None] >= 1))
  num_keep = jnp.sum(keep_sorted, axis=-1)                                   # >= 1
  cutoff = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
  return jnp.where(scaled >= jnp.maximum(cutoff, kth), scaled, -jnp.inf)


def row_keys(seeds: jax.Array, sample_index: jax.Array) -> jax.Array:
  """Typed PRNG keys [S]: fold_in(key(seed), sample_index) per row."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
      seeds.astype(jnp.uint32), sample_index.astype(jnp.uint32))


def masked_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array) -> jax.Array:
  """f32[S, V]: what a hot row draws from (temperature-scaled logits, -inf where top-k /
  top-p cut); rows with temperature 0 come back scaled by 1 (their token is the argmax)."""
  hot = temperature > 0
  temp = jnp.where(hot, temperature, 1.0).astype(jnp.float32)
  plain = logits.astype(jnp.float32) / temp[:, None]
  filtered = hot & ((top_k > 0) | (top_p < 1))
  return jnp.where(filtered[:, None], filtered_logits(logits, temperature, top_k, top_p),
                   plain)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, sample_index: jax.Array, *, all_greedy: bool = False,
           exclude=None) -> jax.Array:
  """One token per row.

  Args:
    logits: f32[S, V].
    temperature, top_k, top_p: per-row parameters, see `filtered_logits`.
    seeds: i32[S] per-request (per-sequence) seeds.
    sample_index: i32[S] tokens the sequence generated before this one.
    all_greedy: static; the host's promise that every row that matters has
      temperature 0: argmax only, no [S, V] sort, no random draw (the same tokens).
    exclude: optional i32[S]: a hot row draws from its filtered distribution with this
      token removed (-1: none); speculative decoding's residual after a rejected draft.

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
  masked = masked_logits(logits, temperature, top_k, top_p)
  if exclude is not None:
    vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :]
    masked = jnp.where(vocab == exclude[:, None], -jnp.inf, masked)
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
