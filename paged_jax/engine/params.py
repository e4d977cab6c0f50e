"""Request-level API types: `SamplingParams` (validated on construction, before
anything runs) and `RequestOutput`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional

import numpy as np

MAX_STOP_IDS = 8   # static width of the per-slot stop-id table in the jitted step


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to generate for one request.

  Attributes:
    max_tokens: tokens to generate, >= 1.
    temperature: >= 0; 0 = greedy.
    top_k: -1 (or 0) = off, else >= 1.
    top_p: in (0, 1].
    seed: >= 0; sample j of the request draws from seed + j.
    n: >= 1 parallel samples (they share the prompt's blocks).
    beam_width: 1 = no beam search; > 1 = beam search (needs temperature 0);
      returns the n best hypotheses (n <= beam_width).
    stop_token_ids: up to 8 ids that end a sequence (the stop id is kept).
  """
  max_tokens: int = 16
  temperature: float = 1.0
  top_k: int = -1
  top_p: float = 1.0
  seed: int = 0
  n: int = 1
  beam_width: int = 1
  stop_token_ids: tuple = ()

  def __post_init__(self):
    def need_int(name, lo, hi=None):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {v!r}")
      if v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {rng}, got {v}")
    need_int("max_tokens", 1)
    need_int("n", 1)
    need_int("beam_width", 1)
    need_int("top_k", -1)
    need_int("seed", 0, 2**31 - 1 - 4096)
    if not (isinstance(self.temperature, (int, float, np.integer, np.floating)) and math.isfinite(self.temperature)
            and self.temperature >= 0):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if not (isinstance(self.top_p, (int, float, np.integer, np.floating)) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    ids = tuple(self.stop_token_ids)
    if len(ids) > MAX_STOP_IDS or any(
        isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0 for t in ids):
      raise ValueError(f"stop_token_ids must be at most {MAX_STOP_IDS} ids >= 0, got {ids!r}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
    if self.beam_width > 1:
      if self.temperature != 0:
        raise ValueError(f"beam search (beam_width={self.beam_width}) needs temperature=0, "
                         f"got {self.temperature}")
      if self.n > self.beam_width:
        raise ValueError(f"n must be <= beam_width={self.beam_width}, got {self.n}")

  @property
  def num_seqs(self) -> int:
    """Sequences (slots) the request may hold at once."""
    return max(self.n, self.beam_width)


@dataclasses.dataclass
class RequestOutput:
  """A finished request. `outputs[j]` are the generated ids of sample j (or of the
  j-th best beam); `cumulative_logprobs` is set for beam search."""
  request_id: Any
  prompt_token_ids: List[int]
  outputs: List[List[int]]
  finish_reasons: List[str]
  cumulative_logprobs: Optional[List[float]] = None
  num_preemptions: int = 0
