"""StepShape: what one engine step computed, in the terms the device-time model needs.

A plain description, independent of the engine's classes: per row (a prefill chunk or a
decode sequence) the tokens computed and the context they attend to, plus the step's
block copies and swaps. An adapter from the engine's per-step report builds one.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np

from paged_jax import config as pj_config


def _int_tuple(name: str, values: Iterable[int]) -> Tuple[int, ...]:
  """A tuple of Python ints from a sequence or array of ints (TypeError naming `name`)."""
  arr = np.asarray(list(values)).reshape(-1)
  if arr.size and arr.dtype.kind not in "iu":
    raise TypeError(f"{name} must hold ints, got dtype {arr.dtype}")
  return tuple(int(v) for v in arr)


@dataclasses.dataclass(frozen=True)
class StepShape:
  """One engine step's work.

  Attributes:
    new_tokens: per row, tokens the row computed this step (a prefill chunk's length; 1 for
      a decode row). Every entry >= 1.
    context_lens: per row, tokens the row's LAST new token attends to (cached + new), so
      context_lens[i] >= new_tokens[i]; a chunk's j-th token attends to
      context_lens[i] - new_tokens[i] + j + 1 tokens.
    sampled_rows: rows whose logits are computed and sampled (None: every row; a prefill
      chunk that does not end its prompt samples nothing).
    decode_iterations: forward passes of the step (multi-step decoding): the first runs every
      row, each later one the decode rows (new_tokens == 1) again, one token longer each.
    bucket_tokens: tokens the compiled shape computes, padding included (0: no padding).
      The projections cost the padded count; attention only the real rows.
    cow_blocks: KV blocks copied by copy-on-write this step.
    swapped_blocks: KV blocks moved between host and device this step (either way).
    block_size: tokens per KV block (sizes the copies and swaps).
  """

  new_tokens: Tuple[int, ...] = ()
  context_lens: Tuple[int, ...] = ()
  sampled_rows: Optional[int] = None
  decode_iterations: int = 1
  bucket_tokens: int = 0
  cow_blocks: int = 0
  swapped_blocks: int = 0
  block_size: int = 16

  def __post_init__(self):
    new = _int_tuple("new_tokens", self.new_tokens)
    ctx = _int_tuple("context_lens", self.context_lens)
    object.__setattr__(self, "new_tokens", new)
    object.__setattr__(self, "context_lens", ctx)
    if len(new) != len(ctx):
      raise ValueError(f"new_tokens and context_lens must have one entry per row, got "
                       f"{len(new)} and {len(ctx)}")
    if new and min(new) < 1:
      raise ValueError(f"new_tokens must be >= 1 per row, got {min(new)}")
    bad = [i for i, (n, c) in enumerate(zip(new, ctx)) if c < n]
    if bad:
      i = bad[0]
      raise ValueError(f"context_lens must be >= new_tokens per row, got row {i}: "
                       f"context {ctx[i]} < new {new[i]}")
    if self.sampled_rows is not None:
      pj_config.check_int("sampled_rows", self.sampled_rows, 0, len(new))
    pj_config.check_int("decode_iterations", self.decode_iterations, 1)
    pj_config.check_int("bucket_tokens", self.bucket_tokens, 0)
    pj_config.check_int("cow_blocks", self.cow_blocks, 0)
    pj_config.check_int("swapped_blocks", self.swapped_blocks, 0)
    pj_config.check_block_size(self.block_size)

  # ---- constructors ----

  @classmethod
  def from_rows(cls, rows: Sequence[Tuple[int, int]], **kwargs) -> "StepShape":
    """From (new_tokens, context_len) pairs."""
    rows = list(rows)
    return cls(new_tokens=tuple(r[0] for r in rows), context_lens=tuple(r[1] for r in rows),
               **kwargs)

  @classmethod
  def decode(cls, context_lens: Sequence[int], **kwargs) -> "StepShape":
    """A decode-only step: one new token per row."""
    context_lens = _int_tuple("context_lens", context_lens)
    return cls(new_tokens=(1,) * len(context_lens), context_lens=context_lens, **kwargs)

  @classmethod
  def prefill(cls, prompt_lens: Sequence[int], **kwargs) -> "StepShape":
    """Whole prompts, each computed in one chunk from an empty cache."""
    prompt_lens = _int_tuple("prompt_lens", prompt_lens)
    return cls(new_tokens=prompt_lens, context_lens=prompt_lens, **kwargs)

  # ---- views ----

  @property
  def num_rows(self) -> int:
    return len(self.new_tokens)

  @property
  def num_tokens(self) -> int:
    """Real tokens computed in the first pass."""
    return int(sum(self.new_tokens))

  @property
  def num_sampled(self) -> int:
    return self.num_rows if self.sampled_rows is None else self.sampled_rows

  def arrays(self) -> Tuple[np.ndarray, np.ndarray]:
    """(new_tokens, context_lens) as float64 arrays of shape [rows]."""
    return (np.asarray(self.new_tokens, dtype=np.float64),
            np.asarray(self.context_lens, dtype=np.float64))

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)
