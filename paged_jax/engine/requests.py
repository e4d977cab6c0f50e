"""Requests in: each validated in full (prompt, sampling params, id, fit in the cache)
before anything changes, built into a scheduler `Group`, then given its request id,
arrival order and sequence ids when queued (`Intake`)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from paged_jax.config import CacheConfig
from paged_jax.engine.params import MAX_INT, SamplingParams, check_prompt
from paged_jax.engine.block_needs import forked_blocks
from paged_jax.engine.sequence import Group, SeqState, Sequence


def prepare_group(prompt, params, request_id: Any, *, vocab_size: int, cache_config: CacheConfig,
                  max_beam_width: int, max_model_len: int, priority: int = 0,
                  max_n: int = 0) -> Group:
  """A Group for the request (id, arrival and sequence ids set when queued).

  Raises a one-line ValueError naming the argument and its allowed range, or the
  blocks a request that can never fit would need.
  """
  if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, (int, np.integer)) or (
      not -MAX_INT - 1 <= priority <= MAX_INT):
    raise ValueError(f"priority must be an int in [{-MAX_INT - 1}, {MAX_INT}], got {priority!r}")
  params = SamplingParams() if params is None else params
  if not isinstance(params, SamplingParams):
    raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
  vocab = vocab_size
  prompt = check_prompt(prompt, vocab)
  for t in params.stop_token_ids:
    if t >= vocab:
      raise ValueError(f"stop_token_ids holds {t}, outside [0, {vocab})")
  if params.beam_width > max_beam_width:
    raise ValueError(f"beam_width must be in [1, max_beam_width={max_beam_width}], "
                     f"got {params.beam_width}")
  if max_n and params.beam_width == 1 and params.n > max_n:   # draft_model speculation
    raise ValueError(f"n must be in [1, {max_n}] with speculative_config method "
                     f"'draft_model', got {params.n}")
  p, m = len(prompt), params.max_tokens
  if p + m - 1 > max_model_len:
    raise ValueError(f"prompt of {p} tokens + max_tokens={m} needs {p + m - 1} cached tokens; "
                     f"the context holds {max_model_len}")
  c = cache_config
  if params.num_seqs > c.max_seqs:
    raise ValueError(f"n / beam_width ({params.num_seqs}) exceeds max_seqs={c.max_seqs}")
  # Worst case with only the prompt's full blocks shared (the scheduler's exact
  # copy-on-write count never exceeds it, so an accepted request fits alone).
  worst = forked_blocks(p, [p + m - 1] * params.num_seqs, c.block_size)
  if worst > c.num_blocks:
    raise ValueError(f"request can never fit: it may need {worst} blocks of {c.block_size} "
                     f"tokens, the cache has num_blocks={c.num_blocks}")
  count = 1 if params.beam_width > 1 else params.n
  seqs = [Sequence(seq_id=-1, index=j, sample_seed=params.seed + j, tokens=list(prompt),
                   prompt_len=p, state=SeqState.FORKING if j else SeqState.WAITING)
          for j in range(count)]
  scores = None if params.prompt_logprobs is None else (None,) * p
  return Group(request_id=request_id, arrival=-1, params=params, prompt=list(prompt),
               seqs=seqs, slots_needed=params.num_seqs, priority=int(priority),
               prompt_scores=scores)



class Intake:
  """Builds an engine's Groups (`prepare`, no state changes) and numbers them (`number`).

  Args:
    in_use: request_id -> bool, the ids the engine holds (queued, running, or finished
      and not yet returned); **limits: `prepare_group`'s keywords.
  """

  def __init__(self, in_use: Callable[[Any], bool], **limits):
    self._in_use, self._limits = in_use, limits
    self._next_id = self._arrivals = self._seq_ids = 0

  def prepare(self, prompt, params, request_id, priority: int = 0) -> Group:
    """Validates one request (no state changes) and builds its Group."""
    try:
      hash(request_id)
    except TypeError:
      raise ValueError(f"request_id must be hashable, got {type(request_id).__name__}") from None
    if request_id is not None and self._in_use(request_id):
      raise ValueError(f"request_id {request_id!r} is already in use")
    return prepare_group(prompt, params, request_id, priority=priority, **self._limits)

  def number(self, group: Group) -> Group:
    """Gives the group its id (automatic ids skip any id in use), its arrival order and
    its sequences' ids."""
    if group.request_id is None:
      while self._in_use(self._next_id):
        self._next_id += 1
      group.request_id = self._next_id
      self._next_id += 1
    group.arrival = self._arrivals
    self._arrivals += 1
    for q in group.seqs:
      q.seq_id = self._seq_ids
      self._seq_ids += 1
    return group
