"""Speculative decoding: draft tokens proposed on the host, verified in the jitted step.

A speculating sequence's decode row carries its last sampled token and up to k draft
tokens (q_len 1 + k, positions L .. L + k); the step reserves their KV slots like any
append (blocks, copy-on-write: vLLM v1's lookahead slots), runs them through the same
ragged paged attention, and `verify` accepts the longest prefix of the drafts the target
model agrees with, plus one token of its own (the correction, or a bonus when every draft
is accepted). The step then rolls the slot back to its accepted length
(`block_manager.truncate`: blocks past it go back to the free stack in the same jit), and
the prefix cache registers only blocks full of verified tokens. A rejected draft is just
state the step never keeps.

Proposer: "ngram" (prompt lookup, vLLM's `prompt_lookup_max` / `prompt_lookup_min`): the
most recent earlier occurrence of the sequence's last n tokens (n from max down to min)
proposes the tokens that followed it. No match, no draft: the sequence decodes as without
speculation (a plain decode row). Drafts that do not pay back off (the planner reads
`Sequence.spec_retry_at` and `Scheduler.spec_retry_step`, which `update` writes:
`STEP_MIN_GAIN`).

Sampling: greedy rows accept a draft iff it is the argmax, so outputs equal speculation
off. Sampled rows use rejection sampling for a point-mass draft (Leviathan et al. 2023,
arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318): draft x is accepted with
probability p(x) under the row's filtered distribution (temperature, top-k, top-p), and a
rejection samples from p with x removed, renormalised, which leaves every emitted token
distributed as the non-speculative sampler's. Keys stay per request: position j of a row
draws from `fold_in(key(seed), sample_index + j)`, the same key the non-speculative
sampler uses for that token, and the acceptance test from a separate fold of it.

Shapes: R lanes (sampled slots), k = num_speculative_tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.engine import decode
from paged_jax.engine import sampling

METHODS = ("ngram", "draft_model")
# Engine-wide back-off (`back_off`, written by engine/update.py only): a running average of
# the gain of drafting steps (accepted drafts per drafting row, one sample per step that
# had drafts), each new step weighted 1 - GAIN_DECAY. While the average is below
# STEP_MIN_GAIN, each drafting step doubles the steps without drafts that follow it
# (2, 4, ... 1024; `Scheduler.spec_retry_step`); the drafting steps let through are the
# probes, and once their gains lift the average to STEP_MIN_GAIN the wait resets. A
# drafting step is a mixed step (ragged attention, k + 1 logits a row): on this CPU it
# cost more than the decode step it replaced, so low acceptance must stop it, not only
# slow it (experiments.speculative). One accepted draft no longer resets the wait (the
# rule it replaces counted misses in a row, and ran 0.87-0.93x at acceptance 0.06-0.22).
STEP_MIN_GAIN = 0.5
GAIN_DECAY = 0.75      # a drafting step's weight in the average falls by 3/4 each later one
MAX_BACK_OFF_DOUBLINGS = 10
MAX_SPECULATIVE_TOKENS = 16
_ACCEPT_TAG = 0x5BEC   # folds the acceptance test's uniform off the token's own key
_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """Validated `speculative_config` (vLLM's keys).

  Attributes:
    method: "ngram" (prompt lookup over the request's own tokens) or "draft_model" (a
      smaller paged model drafts: `draft_model.py`).
    num_speculative_tokens: k, drafts per speculating sequence and step, [1, 16].
    prompt_lookup_max / prompt_lookup_min: longest / shortest n-gram matched, 1 <= min <=
      max <= 64; as vLLM, one given sets the other, neither gives 5 and 5.
    proposer: a plug-in in place of prompt lookup, `(tokens, k) -> up to k draft ids`
      (host Python, called once per decoding sequence and step); given only by building
      a SpeculativeConfig (e.g. the paper-scale runs' stand-in proposer of a set
      acceptance rate, experiments/speculative_scale.py), None: `propose_ngram`.
    model: "draft_model" only: (ModelConfig, params) or a checkpoint directory, sharing
      the target's vocabulary (checked when the engine is built).
  """
  method: str = "ngram"
  num_speculative_tokens: int = 3
  prompt_lookup_max: int = 5
  prompt_lookup_min: int = 5
  proposer: Optional[Callable[[Seq[int], int], tuple]] = None
  model: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

  def propose(self, tokens: Seq[int], k: int) -> tuple:
    """Up to k drafts to follow `tokens`."""
    if self.proposer is not None:
      return tuple(int(t) for t in self.proposer(tokens, k))[:k]
    return propose_ngram(tokens, k, self.prompt_lookup_max, self.prompt_lookup_min)


def back_off(ema: Optional[float], misses: int, gain: float, steps: int):
  """The engine-wide back-off after a step with drafts.

  Args:
    ema: the running average of earlier drafting steps' gains (None: none yet).
    misses: drafting steps in a row that left the average below STEP_MIN_GAIN.
    gain: this step's accepted drafts per drafting row (>= 0).
    steps: the engine's step count after this step (`Scheduler.stats["steps"]`).
  Returns:
    (ema, misses, retry_step): the new average (the first gain itself, then
    GAIN_DECAY * ema + (1 - GAIN_DECAY) * gain), the new miss count, and the step count
    before which no sequence drafts (steps + 2**misses, misses capped at
    MAX_BACK_OFF_DOUBLINGS; 0 while the average is at or above STEP_MIN_GAIN).
  """
  ema = gain if ema is None else GAIN_DECAY * ema + (1.0 - GAIN_DECAY) * gain
  if ema >= STEP_MIN_GAIN:
    return ema, 0, 0
  misses += 1
  return ema, misses, steps + 2 ** min(misses, MAX_BACK_OFF_DOUBLINGS)


def parse(config: Any) -> Optional[SpeculativeConfig]:
  """A `speculative_config` dict (or SpeculativeConfig, or None) checked: one-line
  ValueErrors naming the key and its allowed values."""
  if config is None or isinstance(config, SpeculativeConfig):
    return config
  if not isinstance(config, dict):
    raise ValueError(f"speculative_config must be a dict or None, got {type(config).__name__}")
  known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
           "model"}
  unknown = sorted(set(config) - known)
  if unknown:
    raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; keys are "
                     f"{', '.join(sorted(known))}")
  method = config.get("method", "ngram")
  if method not in METHODS:
    raise ValueError(f"speculative_config['method'] must be one of {', '.join(METHODS)}, "
                     f"got {method!r}")
  if method == "draft_model":
    extra = sorted(set(config) & {"prompt_lookup_max", "prompt_lookup_min"})
    if extra:
      raise ValueError(f"speculative_config[{extra[0]!r}] is only for method 'ngram'")
    if config.get("model") is None:
      raise ValueError("speculative_config['model'] is required with method 'draft_model': "
                       "(ModelConfig, params) or a checkpoint directory")
  elif "model" in config:
    raise ValueError("speculative_config['model'] is only for method 'draft_model'")
  if "num_speculative_tokens" not in config:
    raise ValueError("speculative_config['num_speculative_tokens'] is required, an int in "
                     f"[1, {MAX_SPECULATIVE_TOKENS}]")
  k = config["num_speculative_tokens"]
  hi = config.get("prompt_lookup_max", config.get("prompt_lookup_min", 5))
  lo = config.get("prompt_lookup_min", hi)
  limits = [("num_speculative_tokens", k, MAX_SPECULATIVE_TOKENS)]
  if method == "ngram":
    limits += [("prompt_lookup_max", hi, 64), ("prompt_lookup_min", lo, 64)]
  for name, value, top in limits:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
      raise ValueError(f"speculative_config['{name}'] must be an int in [1, {top}], "
                       f"got {value!r}")
  if method == "draft_model":
    return SpeculativeConfig("draft_model", k, model=config["model"])
  if lo > hi:
    raise ValueError(f"speculative_config['prompt_lookup_min'] must be <= "
                     f"prompt_lookup_max ({hi}), got {lo}")
  return SpeculativeConfig(method, k, hi, lo)


def propose_ngram(tokens: Seq[int], k: int, n_max: int, n_min: int) -> tuple:
  """Prompt lookup: up to `k` tokens that followed the most recent earlier occurrence of
  the last n tokens of `tokens` (n tried from `n_max` down to `n_min`); () on no match.
  numpy, O(len(tokens) * n) per try."""
  t = np.asarray(tokens, np.int64)
  size = t.shape[0]
  for n in range(min(n_max, size - 1), n_min - 1, -1):
    # Windows starting at 0 .. size - n - 1: every earlier occurrence with a successor.
    windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)
    hits = np.nonzero(np.all(windows == t[size - n:], axis=1))[0]
    if hits.size:
      start = int(hits[-1]) + n
      return tuple(int(x) for x in t[start:start + k])
  return ()


def logits_indices(cu_q_lens, spec_len_row, k: int):
  """i32[R * (k + 1)]: the token whose logits each (row, position j) reads. A speculating
  row (spec_len_row > 0) reads its tokens from its first (the last sampled token) on, one
  per position (clipped to the row); any other row reads its last token at every j."""
  start, last = cu_q_lens[:-1], jnp.maximum(cu_q_lens[1:] - 1, 0)
  j = jnp.arange(k + 1, dtype=_I32)[None, :]
  idx = jnp.where((spec_len_row > 0)[:, None], jnp.minimum(start[:, None] + j, last[:, None]),
                  last[:, None])
  return idx.reshape(-1).astype(_I32)


def verify(logits, drafts, num_drafts, temperature, top_k, top_p, seeds, sample_index, *,
           all_greedy: bool = False):
  """Accepts each lane's longest agreeing draft prefix and samples one more token.

  Args:
    logits: f32[R, k + 1, V]; position j: the distribution after the row's j-th draft
      (j = 0: after its last sampled token).
    drafts: i32[R, k], draft j at [:, j] (entries past `num_drafts` are ignored).
    num_drafts: i32[R] in [0, k]; 0: a plain sample at position 0 (the non-speculative
      sampler's token, same key).
    temperature, top_k, top_p, seeds, sample_index: per lane, as `sampling.sample`.
    all_greedy: static, every lane is greedy.
  Returns:
    (tokens i32[R, k + 1]: drafts[:a] then the lane's own token at a, zeros after;
     accepted i32[R]: a, in [0, num_drafts]).
  """
  r, k1, vocab = logits.shape
  k = k1 - 1
  flat = logits.reshape(r * k1, vocab)
  rep = lambda x: jnp.repeat(x, k1)
  index = rep(sample_index) + jnp.tile(jnp.arange(k1, dtype=sample_index.dtype), r)
  greedy = jnp.argmax(flat, axis=-1).astype(_I32).reshape(r, k1)
  live = jnp.arange(k, dtype=_I32)[None, :] < num_drafts[:, None]
  accept = greedy[:, :k] == drafts
  if not all_greedy:
    masked = sampling.masked_logits(flat, rep(temperature), rep(top_k), rep(top_p))
    p = jax.nn.softmax(masked, axis=-1).reshape(r, k1, vocab)[:, :k]
    p_draft = jnp.take_along_axis(p, jnp.clip(drafts, 0, vocab - 1)[..., None], axis=-1)[..., 0]
    keys = jax.vmap(lambda key: jax.random.fold_in(key, _ACCEPT_TAG))(
        sampling.row_keys(rep(seeds), index))
    u = jax.vmap(jax.random.uniform)(keys).reshape(r, k1)[:, :k]
    accept = jnp.where((temperature > 0)[:, None], u < p_draft, accept)
  accepted = jnp.sum(jnp.cumprod((accept & live).astype(_I32), axis=1), axis=1).astype(_I32)
  lanes = jnp.arange(r, dtype=_I32)
  at = flat[lanes * k1 + accepted]                                       # [R, V]
  # A sampled lane rejected at `accepted`: p with the rejected draft removed (the residual).
  rejected = accepted < num_drafts
  exclude = jnp.where(rejected, drafts[lanes, jnp.minimum(accepted, max(k - 1, 0))], -1)
  own = sampling.sample(at, temperature, top_k, top_p, seeds, sample_index + accepted,
                        all_greedy=all_greedy, exclude=exclude)
  j = jnp.arange(k1, dtype=_I32)[None, :]
  padded = jnp.concatenate([drafts, jnp.zeros((r, 1), _I32)], axis=1)
  tokens = jnp.where(j < accepted[:, None], padded, jnp.where(j == accepted[:, None],
                                                              own[:, None], 0))
  return tokens.astype(_I32), accepted


def rollback(state, seq_lens):
  """Rolls every slot back to `seq_lens` (i32[S], <= its length; the accepted length
  after a verification): the table entries past `cdiv(seq_lens, block_size)` are cleared
  and their references dropped (blocks reaching 0 go back on the free stack,
  `block_manager.release_references`). A block kept for the next step would save its
  pop, but the allocator's invariant (a slot of L tokens holds exactly cdiv(L, B)
  blocks) is what every other op relies on; the freed blocks are the next pops anyway."""
  table = state.block_tables
  keep = (seq_lens + state.block_size - 1) // state.block_size
  col = jnp.arange(table.shape[1], dtype=_I32)[None, :]
  drop = (col >= keep[:, None]) & (table >= 0) & state.active[:, None]
  state = bm.release_references(state, jnp.where(drop, table, -1).reshape(-1))
  return state.replace(block_tables=jnp.where(drop, -1, table),
                       seq_lens=jnp.where(state.active, seq_lens, state.seq_lens))


def first_iteration(lane_logits, lane_slot, sampled, inp, cu_q_lens, decoded, all_greedy):
  """The step's first decode iteration when it speculates (its `spec` variant), in place of
  `decode.sample_iteration(0, ...)`: every sampled lane verifies its drafts (none: a plain
  sample, the same token) and emits up to k + 1 tokens, cut after the first that finishes
  the sequence (stop id, max_tokens).

  Args:
    lane_logits: f32[R, k + 1, V], lane l's logits at its row's positions
      (`logits_indices`); lane_slot i32[R] (S = none); sampled bool[S].
    inp: the StepInputs (drafts are the row's tokens after its first, `spec_len` of them);
    cu_q_lens: i32[R + 1], the rows' token offsets; decoded: `decode.Decoded` at least
      k + 1 iterations deep.
  Returns:
    (tokens i32[S]: each slot's last emitted token, decoded (rows 0 .. emitted - 1 set),
     done bool[S]: finished in this iteration, emitted i32[S]: tokens emitted, >= 1 where
     sampled).
  """
  r, k1, _ = lane_logits.shape
  k, s_max = k1 - 1, sampled.shape[0]
  ls = jnp.clip(lane_slot, 0, s_max - 1)
  lane_live = lane_slot < s_max
  num_drafts = jnp.where(lane_live, inp.spec_len[ls], 0)
  start = cu_q_lens[jnp.clip(inp.sample_row[ls], 0, r - 1)]
  at = jnp.clip(start[:, None] + 1 + jnp.arange(k, dtype=_I32)[None, :], 0,
                inp.tokens.shape[0] - 1)
  toks, accepted = verify(lane_logits, inp.tokens[at], num_drafts, inp.temperature[ls],
                          inp.top_k[ls], inp.top_p[ls], inp.seed[ls], inp.sample_index[ls],
                          all_greedy=all_greedy)
  # The first emitted position that finishes the sequence cuts the emission there.
  i = jnp.arange(k1, dtype=_I32)[None, :]
  fin = decode.finished(toks.reshape(-1), (inp.remaining[ls][:, None] - i).reshape(-1),
                        jnp.repeat(inp.stop_ids[ls], k1, axis=0)).reshape(r, k1)
  fin = fin & (i <= accepted[:, None])
  any_fin = jnp.any(fin, axis=1)
  emitted = jnp.where(any_fin, jnp.argmax(fin, axis=1) + 1, accepted + 1).astype(_I32)
  flat = lane_logits.reshape(r * k1, -1)
  per_lane = (toks, sampling.token_logprobs(flat, toks.reshape(-1)).reshape(r, k1),
              i < emitted[:, None], jnp.take_along_axis(toks, (emitted - 1)[:, None], 1)[:, 0],
              any_fin, emitted)
  num_top = decoded.top_logprobs.shape[2]
  if num_top:
    per_lane += tuple(x.reshape(r, k1, num_top) for x in sampling.top_logprobs(flat, num_top))
  tok, lp, keep, last, fin_s, emitted_s, *top = decode.scatter_lanes(per_lane, lane_slot, s_max)
  keep = keep & sampled[:, None]                                       # [S, k + 1]
  put = lambda a, new: a.at[:k1].set(jnp.where(
      jnp.swapaxes(keep, 0, 1).reshape(keep.shape[::-1] + (1,) * (new.ndim - 2)),
      jnp.swapaxes(new, 0, 1), a[:k1]))
  decoded = decoded.replace(tokens=put(decoded.tokens, tok),
                            valid=decoded.valid.at[:k1].set(jnp.swapaxes(keep, 0, 1)),
                            logprobs=put(decoded.logprobs, lp))
  if num_top:
    decoded = decoded.replace(top_logprobs=put(decoded.top_logprobs, top[0]),
                              top_ids=put(decoded.top_ids, top[1]))
  return last, decoded, fin_s & sampled, jnp.where(sampled, emitted_s, 0)
