"""StepShape: what one engine step computed, in the terms the device-time model needs.

A plain description, independent of the engine's classes: per row (a prefill chunk or a
decode sequence) the tokens computed and the context they attend to, plus the step's
block copies and swaps. `StepShape.from_report` builds one from the engine's per-step
report (`paged_jax.engine.report.StepReport`, read by attribute name: perf imports only
config).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence, Tuple

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
      row, each later one the decode rows (new_tokens == 1) again, one token longer each
      (or `loop_rows` rows when given).
    loop_rows: per later pass (decode_iterations - 1 entries), its live rows, one new
      token each (None: the first pass's decode rows). Their contexts are not known one
      by one: each is the mean context of the first pass's first `num_sampled` rows (the
      sampled rows: `from_report` puts them first), plus the pass index (an engine's loop
      continues every sampled row that has not finished).
    bucket_tokens: tokens the compiled shape computes, padding included (0: no padding).
      The projections cost the padded count; attention only the real rows.
    bucket_rows: rows each later pass's compiled shape computes, padding included (0: no
      padding): its projections cost max(live rows, bucket_rows), so a pass with no live
      row still reads the weights.
    cow_blocks: KV blocks copied by copy-on-write this step.
    swapped_blocks: KV blocks moved between host and device this step (either way).
    host_in_blocks: KV blocks the prefix cache's host tier copied host -> device before
      the step (promotions: the step's prompts need them).
    host_out_blocks: KV blocks the host tier copied device -> host (blocks the device
      evicted, new to the host): staged on the device before the step, downloaded while
      it runs (`paged_jax.engine.tier`).
    block_size: tokens per KV block (sizes the copies and swaps).
  """

  new_tokens: Tuple[int, ...] = ()
  context_lens: Tuple[int, ...] = ()
  sampled_rows: Optional[int] = None
  decode_iterations: int = 1
  loop_rows: Optional[Tuple[int, ...]] = None
  bucket_tokens: int = 0
  bucket_rows: int = 0
  cow_blocks: int = 0
  swapped_blocks: int = 0
  host_in_blocks: int = 0
  host_out_blocks: int = 0
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
    if self.loop_rows is not None:
      loop = _int_tuple("loop_rows", self.loop_rows)
      object.__setattr__(self, "loop_rows", loop)
      if len(loop) != self.decode_iterations - 1:
        raise ValueError(f"loop_rows must have decode_iterations - 1 = "
                         f"{self.decode_iterations - 1} entries, got {len(loop)}")
      if loop and min(loop) < 0:
        raise ValueError(f"loop_rows must be >= 0 per pass, got {min(loop)}")
    pj_config.check_int("bucket_tokens", self.bucket_tokens, 0)
    pj_config.check_int("bucket_rows", self.bucket_rows, 0)
    pj_config.check_int("cow_blocks", self.cow_blocks, 0)
    pj_config.check_int("swapped_blocks", self.swapped_blocks, 0)
    pj_config.check_int("host_in_blocks", self.host_in_blocks, 0)
    pj_config.check_int("host_out_blocks", self.host_out_blocks, 0)
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

  @classmethod
  def from_report(cls, report: Any, *, block_size: int, padding: bool = False
                  ) -> "StepShape":
    """The work of one engine step from its report (`Engine.last_step`, a StepReport).

    Reads, by name: prefill_chunks and decode_rows ((new tokens, context) pairs),
    decode_loop_rows, cow_copies, swapped_blocks, generated_tokens, bucket (T, R, ...),
    ok, dispatches. A step that ran nothing (no dispatch, or a failed reservation: the
    engine re-plans, as a host-planned system would have before dispatching) computes no
    rows; its swaps still count.

    Args:
      report: the StepReport.
      block_size: the engine's tokens per KV block (sizes cow_copies and swapped_blocks;
        the report does not carry it).
      padding: charge the compiled shape's padded tokens (`bucket`), as this engine runs
        them; False (default): only the real rows, as an engine without shape buckets.
    Sampled rows are not reported one by one: every decode row samples, and of the
    prefill chunks as many as the first pass appended tokens beyond the decode rows
    (exact with one sequence per request; with n > 1 or beams a chunk appends several
    tokens, so the count is an upper bound, at most every chunk).
    """
    ran = bool(getattr(report, "ok", True)) and getattr(report, "dispatches", 1) > 0
    chunks = tuple(report.prefill_chunks) if ran else ()
    decodes = tuple(report.decode_rows) if ran else ()
    loop = tuple(report.decode_loop_rows) if ran else ()
    rows = decodes + chunks
    first_pass = max(0, int(report.generated_tokens) - sum(loop))
    sampled = len(decodes) + min(len(chunks), max(0, first_pass - len(decodes)))
    bucket = getattr(report, "bucket", None)
    pad = padding and bucket is not None and ran
    sampled = min(sampled, len(rows))
    return cls(new_tokens=tuple(r[0] for r in rows), context_lens=tuple(r[1] for r in rows),
               sampled_rows=None if sampled == len(rows) else sampled,
               decode_iterations=1 + len(loop), loop_rows=loop or None, bucket_tokens=int(bucket.tokens) if pad else 0,
               bucket_rows=int(bucket.rows) if pad else 0,
               cow_blocks=int(report.cow_copies) if ran else 0,
               swapped_blocks=int(report.swapped_blocks), block_size=block_size)

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
