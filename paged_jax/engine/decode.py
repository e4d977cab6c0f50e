"""One decode iteration's sampling and what it reports, the same for the step's first
iteration and each iteration of its decode loop (`step.make_step`): a token per sampled
lane, its log-probability and its position's best alternatives (`Decoded`, K iterations
deep), and, in the step's `logprobs` variant, the prompt tokens' scores.

Shapes: K decode iterations, S slots, R lanes (rows), V vocabulary, L reported
alternatives (MAX_LOGPROBS in the `logprobs` variant, else 0), T tokens.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from paged_jax.engine import sampling
from paged_jax.engine.state import StepInputs

_I32 = jnp.int32


def finished(tokens, remaining, stop_ids):
  """bool[S]: the token just sampled ends its sequence."""
  is_stop = jnp.any((stop_ids >= 0) & (stop_ids == tokens[:, None]), axis=-1)
  return is_stop | (remaining <= 1)


def sample_lanes(logits, lane_slot, inp: StepInputs, index_offset=0, all_greedy=False):
  """Samples one token per lane (lane l: slot lane_slot[l], logits row l).

  logits f32[R, V]; lane_slot i32[R]. Sampling is keyed per request (seed,
  sample_index), so a slot draws the same token whatever lane or bucket it sits in.
  Returns i32[R].
  """
  ls = jnp.clip(lane_slot, 0, inp.temperature.shape[0] - 1)
  return sampling.sample(logits, inp.temperature[ls], inp.top_k[ls], inp.top_p[ls],
                         inp.seed[ls], inp.sample_index[ls] + index_offset,
                         all_greedy=all_greedy)


@flax.struct.dataclass
class Decoded:
  """What the decode iterations sampled (K iterations, S slots, L reported alternatives):
  tokens i32[K, S], valid bool[K, S], logprobs f32[K, S], top_logprobs f32[K, S, L],
  top_ids i32[K, S, L] (StepOutputs' fields of the same names)."""
  tokens: jax.Array
  valid: jax.Array
  logprobs: jax.Array
  top_logprobs: jax.Array
  top_ids: jax.Array

  @classmethod
  def empty(cls, k: int, s: int, num_top: int) -> "Decoded":
    return cls(jnp.zeros((k, s), _I32), jnp.zeros((k, s), jnp.bool_),
               jnp.zeros((k, s), jnp.float32), jnp.zeros((k, s, num_top), jnp.float32),
               jnp.zeros((k, s, num_top), _I32))


def scatter_lanes(values, lane_slot, s_max: int):
  """Per-lane arrays ([R, ...] each, a tuple) onto slots ([S, ...]; lane l -> slot
  lane_slot[l], S = none; zeros elsewhere)."""
  return tuple(jnp.zeros((s_max,) + v.shape[1:], v.dtype).at[lane_slot].set(v, mode="drop")
               for v in values)


def sample_iteration(i, logits, lane_slot, keep, last, inp: StepInputs, decoded: Decoded,
                      all_greedy: bool, offset=None):
  """Decode iteration i's sampling, the same for the step's first iteration and the
  decode loop's: lane l (logits row l, f32[R, V]) samples the next token of slot
  lane_slot[l] (S = none); the slots in `keep` (bool[S]) get it (the others keep `last`,
  i32[S]) and iteration i's row of `decoded`: token, valid, its log-probability and the
  position's best alternatives. `offset` (i32[S], optional): slot s's iteration i is its
  (i + offset[s])-th token of the step (after speculative decoding's emitted tokens): its
  sample index and row move by it. Returns (tokens i32[S], decoded)."""
  s_max, num_top = keep.shape[0], decoded.top_logprobs.shape[2]
  if offset is not None:
    lane_off = offset[jnp.clip(lane_slot, 0, s_max - 1)]
    lane_tok = sample_lanes(logits, lane_slot, inp, index_offset=i + lane_off,
                            all_greedy=all_greedy)
  else:
    lane_tok = sample_lanes(logits, lane_slot, inp, index_offset=i, all_greedy=all_greedy)
  per_lane = (lane_tok, sampling.token_logprobs(logits, lane_tok))
  if num_top:
    per_lane += sampling.top_logprobs(logits, num_top)
  tok, lp, *top = scatter_lanes(per_lane, lane_slot, s_max)
  tok = jnp.where(keep, tok, last)
  if offset is None:
    put = lambda a, new: a.at[i].set(jnp.where(keep.reshape((-1,) + (1,) * (new.ndim - 1)),
                                               new, a[i]))
  else:   # row i + offset[s] of slot s, where kept
    slots = jnp.arange(s_max, dtype=_I32)
    row = jnp.where(keep, i + offset, decoded.tokens.shape[0])   # out of range: dropped
    put = lambda a, new: a.at[row, slots].set(new, mode="drop")
  decoded = decoded.replace(tokens=put(decoded.tokens, tok), valid=put(decoded.valid, keep),
                            logprobs=put(decoded.logprobs, lp))
  if num_top:
    decoded = decoded.replace(top_logprobs=put(decoded.top_logprobs, top[0]),
                              top_ids=put(decoded.top_ids, top[1]))
  return tok, decoded


def prompt_scores(logits, inp: StepInputs, token_row, row_slot, num_top: int):
  """The StepOutputs' prompt_* fields: with L = num_top > 0, `logits` is every token's
  (f32[T, V]) and each token with a target (`inp.target_tokens` >= 0, in a live row) gets
  the target's log-probability, its position's best L alternatives and its (slot,
  position); with L = 0 every field is empty ([0] / [0, 0])."""
  if num_top == 0:
    e = jnp.zeros((0,), _I32)
    return dict(prompt_logprobs=jnp.zeros((0,), jnp.float32),
                prompt_top_logprobs=jnp.zeros((0, 0), jnp.float32),
                prompt_top_ids=jnp.zeros((0, 0), _I32), prompt_slot=e, prompt_pos=e)
  tgt = inp.target_tokens
  scored = (tgt >= 0) & (token_row >= 0)
  slot = jnp.where(scored, row_slot[jnp.clip(token_row, 0, row_slot.shape[0] - 1)], -1)
  scored = scored & (slot >= 0)
  v, ids = sampling.top_logprobs(logits, num_top)
  return dict(prompt_logprobs=jnp.where(scored, sampling.token_logprobs(
      logits, jnp.maximum(tgt, 0)), 0.0), prompt_top_logprobs=v, prompt_top_ids=ids,
              prompt_slot=jnp.where(scored, slot, -1),
              prompt_pos=jnp.where(scored, inp.positions, -1))
