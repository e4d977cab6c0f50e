"""Request-level API types: `SamplingParams` (validated on construction, before
anything runs) and `RequestOutput`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Tuple

import numpy as np

MAX_STOP_IDS = 8   # static width of the per-slot stop-id table in the jitted step
MAX_INT = 2**31 - 1          # int32 device arrays hold every int field
MAX_SEQS = 2**20             # CacheConfig's largest max_seqs
MAX_SEED = 2**31 - 1 - 4096  # sample j draws from seed + j (j < max_seqs in practice)
MAX_TEMPERATURE = 1e4
MAX_SALT_LEN = 1024
MAX_LOGPROBS = 20            # top alternatives per token (OpenAI's chat `top_logprobs` bound)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to generate for one request.

  Every field is checked on construction (type and range); a bad value raises a
  one-line ValueError naming the field and its range.

  Attributes:
    max_tokens: tokens to generate, in [1, 2**31 - 1].
    temperature: in [0, 1e4]; 0 = greedy.
    top_k: -1 (or 0) = off, else in [1, 2**31 - 1] (a cut >= vocab keeps all).
    top_p: in (0, 1].
    seed: in [0, 2**31 - 4097]; sample j of the request draws from seed + j.
    n: >= 1 parallel samples (they share the prompt's blocks).
    beam_width: 1 = no beam search; > 1 = beam search (needs temperature 0);
      returns the n best hypotheses (n <= beam_width).
    stop_token_ids: up to 8 ids that end a sequence (the stop id is kept).
    cache_salt: None (share the prefix cache with every unsalted request) or a
      non-empty str of at most 1024 characters: cached blocks are shared only among
      requests with the same salt (vLLM's `cache_salt`: one tenant cannot learn by
      timing what another's prompt began with).
    logprobs: in [0, 20]: the top alternatives (id, log-prob) reported per generated
      token besides the sampled token's own log-probability (always reported); not with
      beam search.
    prompt_logprobs: None, or in [0, 20]: report each prompt token's log-probability
      given the tokens before it (the first has none) with that many top alternatives
      (scoring, as lm-evaluation-harness's loglikelihood asks). The prompt is then
      computed whole: it takes no prefix-cache hit (it still registers its blocks);
      not with beam search.
  """
  max_tokens: int = 16
  temperature: float = 1.0
  top_k: int = -1
  top_p: float = 1.0
  seed: int = 0
  n: int = 1
  beam_width: int = 1
  stop_token_ids: tuple = ()
  cache_salt: Optional[str] = None
  logprobs: int = 0
  prompt_logprobs: Optional[int] = None

  def __post_init__(self):
    def need_int(name, lo, hi):
      v = getattr(self, name)
      if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
      object.__setattr__(self, name, int(v))

    def need_float(name, lo, hi, lo_open=False):
      v = getattr(self, name)
      ok = (not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, float, np.integer,
                                                                   np.floating))
            and math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi)
      if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ValueError(f"{name} must be a finite number in {rng}, got {v!r}")
      object.__setattr__(self, name, float(v))

    need_int("max_tokens", 1, MAX_INT)
    need_int("n", 1, MAX_SEQS)
    need_int("beam_width", 1, MAX_SEQS)
    need_int("top_k", -1, MAX_INT)
    need_int("seed", 0, MAX_SEED)
    need_int("logprobs", 0, MAX_LOGPROBS)
    if self.prompt_logprobs is not None:
      need_int("prompt_logprobs", 0, MAX_LOGPROBS)
    need_float("temperature", 0, MAX_TEMPERATURE)
    need_float("top_p", 0, 1, lo_open=True)
    ids = self.stop_token_ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
      raise ValueError(f"stop_token_ids must be a sequence of at most {MAX_STOP_IDS} ids in "
                       f"[0, {MAX_INT}], got {ids!r}")
    ids = tuple(ids)
    if len(ids) > MAX_STOP_IDS or any(
        isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
        or not 0 <= t <= MAX_INT for t in ids):
      raise ValueError(f"stop_token_ids must be a sequence of at most {MAX_STOP_IDS} ids in "
                       f"[0, {MAX_INT}], got {ids!r}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
    salt = self.cache_salt
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= MAX_SALT_LEN):
      shown = repr(salt) if isinstance(salt, str) else type(salt).__name__
      raise ValueError(f"cache_salt must be None or a str of 1 to {MAX_SALT_LEN} characters, "
                       f"got {shown[:80]}")
    if self.beam_width > 1:
      if self.temperature != 0:
        raise ValueError(f"beam search (beam_width={self.beam_width}) needs temperature=0, "
                         f"got {self.temperature}")
      if self.logprobs or self.prompt_logprobs is not None:
        raise ValueError(f"logprobs / prompt_logprobs are not reported for beam search "
                         f"(beam_width={self.beam_width}); use logprobs=0, "
                         f"prompt_logprobs=None")
      if self.n > self.beam_width:
        raise ValueError(f"n must be in [1, beam_width={self.beam_width}], got {self.n}")

  @property
  def num_seqs(self) -> int:
    """Sequences (slots) the request may hold at once."""
    return max(self.n, self.beam_width)


@dataclasses.dataclass
class RequestOutput:
  """A finished request. `outputs[j]` are the generated ids of sample j (or of the
  j-th best beam); `cumulative_logprobs` is set for beam search; `logprobs[j][i]` is
  the log-probability of `outputs[j][i]` under the model (sampling, not beam search).

  With `SamplingParams.logprobs = k > 0`, `top_logprobs[j][i]` is the k best
  (id, log-prob) pairs at that position, best first. With `prompt_logprobs = k`,
  `prompt_logprobs[i]` is log p(prompt[i] | prompt[:i]) (None for i = 0) and
  `prompt_top_logprobs[i]` its k best (id, log-prob) pairs (None for i = 0).
  Log-probabilities are under the model's raw distribution (no temperature or cuts).
  """
  request_id: Any
  prompt_token_ids: List[int]
  outputs: List[List[int]]
  finish_reasons: List[str]
  cumulative_logprobs: Optional[List[float]] = None
  num_preemptions: int = 0
  logprobs: Optional[List[List[float]]] = None
  top_logprobs: Optional[List[List[List[Tuple[int, float]]]]] = None
  prompt_logprobs: Optional[List[Optional[float]]] = None
  prompt_top_logprobs: Optional[List[Optional[List[Tuple[int, float]]]]] = None


def check_prompt(prompt, vocab_size: int) -> List[int]:
  """The prompt as a list of ints; a one-line ValueError unless it is a non-empty
  1-D sequence (list, tuple, numpy or jax array) of token ids in [0, vocab_size)."""
  if prompt is None or isinstance(prompt, (str, bytes)):
    raise ValueError(f"prompt must be a 1-D sequence of token ids in [0, {vocab_size}), "
                     f"got {type(prompt).__name__}")
  try:
    arr = np.asarray(prompt)
  except Exception:  # pylint: disable=broad-except
    raise ValueError(f"prompt must be a 1-D sequence of token ids in [0, {vocab_size})") from None
  if arr.ndim != 1 or arr.size == 0:
    raise ValueError(f"prompt must hold at least one token id in [0, {vocab_size}) in one "
                     f"dimension, got shape {arr.shape}")
  if isinstance(prompt, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) for t in prompt):
    arr = np.asarray(prompt, dtype=object)
  if arr.dtype.kind not in "iu":
    items = list(prompt) if isinstance(prompt, (list, tuple)) else arr.tolist()
    bad = next((i for i, t in enumerate(items) if isinstance(t, (bool, np.bool_))
                or not isinstance(t, (int, np.integer))), 0)
    raise ValueError(f"prompt[{bad}]={items[bad]!r} is not a token id in [0, {vocab_size})")
  ids = arr.tolist()
  for i, t in enumerate(ids):
    if not 0 <= t < vocab_size:
      raise ValueError(f"prompt[{i}]={t} is not a token id in [0, {vocab_size})")
  return ids
