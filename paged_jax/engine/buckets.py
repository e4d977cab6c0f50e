"""The step's shape buckets: the few compiled shapes a step runs on, chosen per step
from what is live (`StepBuckets.pick` -> `Bucket`), and the set of them a run can reach
(`reachable_buckets`, what a warm-up compiles ahead of time).

Shapes: T tokens and R rows (the smallest buckets >= what is live), W block-table
columns attention reads (a jit static argument, like decode_only and all_greedy; one W
where attention's cost does not follow it: `attention_reads_width`).
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Tuple

from paged_jax.config import CacheConfig, cdiv


def _geometric(largest: int, smallest: int, factor: int, *,
               halfway_from: Optional[int] = None) -> Tuple[int, ...]:
  """smallest, smallest * factor, ... below `largest`, then `largest` itself; with
  `halfway_from` (factor 2) also each v * 1.5 from v = halfway_from up (8, 16, 24, 32, 48)."""
  out, v = [], smallest
  while v < largest:
    out.append(v)
    if halfway_from is not None and v >= halfway_from and v * 3 // 2 < largest:
      out.append(v * 3 // 2)
    v *= factor
  return tuple(out) + (largest,)


class Bucket(NamedTuple):
  """One compiled shape of the step (each distinct Bucket traces and compiles once).

  Attributes:
    tokens: T, new tokens the step computes (padded; = rows when decode_only).
    rows: R, attention rows and sampling lanes (chunks, sampled slots, forks).
    width: W, block-table columns attention reads (the step's static `width=`).
    decode_only: every row has one new token: the decode kernel runs.
    all_greedy: every running request is greedy: sampling is an argmax.
    prefix_light: with prefix caching, the step admits, frees and forks nothing (the
      host knows): it runs without the prefix cache's lookup, first release and fork
      copies (`step.make_step`); always False without caching.
    prefix_admit_only: with prefix caching, a mixed step that admits prompts but frees,
      forks and swaps nothing: it keeps the lookup, leaves out the first release and the
      fork copies; always False without caching, with `prefix_light` or decode_only.
    logprobs: a running request asks for top alternatives, or a chunk scores its prompt
      (`SamplingParams.logprobs` / `prompt_logprobs`): the step computes every token's
      logits and reports the best `MAX_LOGPROBS` per token (`StepOutputs`). A variant
      because it costs: 8 requests x (200 prompt + 16 generated tokens), vocabulary
      32,000, a 2-layer width-256 model on this CPU, side by side (median of 5): 1.20x
      the time with `logprobs=5`, 4.73x with `prompt_logprobs=1` (2026-12-05).
    spec: a row carries speculative drafts (`speculative.py`): never decode_only; the
      step reads k + 1 logits per row and verifies them. Only with speculation on.
  """
  tokens: int
  rows: int
  width: int
  decode_only: bool
  all_greedy: bool = False
  prefix_light: bool = False
  prefix_admit_only: bool = False
  logprobs: bool = False
  spec: bool = False

  @property
  def step_kw(self) -> dict:
    """The step's static keywords for this bucket (T and R come with the inputs);
    `prefix_light` / `prefix_admit_only` only when set, so a step without prefix caching
    never sees them."""
    kw = dict(width=self.width, decode_only=self.decode_only, all_greedy=self.all_greedy)
    if self.prefix_light:
      kw["prefix_light"] = True
    if self.prefix_admit_only:
      kw["prefix_admit_only"] = True
    if self.logprobs:
      kw["logprobs"] = True
    if self.spec:
      kw["spec"] = True
    return kw


def _round_up(sizes: Tuple[int, ...], n: int) -> int:
  """The smallest of ascending `sizes` that holds `n`, else the largest."""
  return next((b for b in sizes if b >= n), sizes[-1])


@dataclasses.dataclass(frozen=True)
class StepBuckets:
  """The shape buckets of the step, chosen per step from what is live.

  Like the few batch sizes a serving engine captures: tokens T (a step's new
  tokens), rows R (attention rows = chunks, and sampled slots), widths W
  (block-table columns attention reads: the longest live sequence after the step,
  decode loop included). Each (T, R, W, decode_only) compiles once; a decode-only
  step (every row one new token) runs the decode kernel with T = R.
  `enabled=False` pins every step to the largest bucket (T = budget, R = S,
  W = max_blocks_per_seq, ragged attention): the unbucketed step; with `decode_shape`
  besides, a decode-only step runs on one decode shape (T = R = S, W =
  max_blocks_per_seq, the decode kernel) instead, so an unbucketed engine has two
  shapes (a paper-scale sweep's decodes then skip the budget-sized token arrays).
  With `prefix_caching` each shape also has its `prefix_light` variant, and each mixed
  shape its `prefix_admit_only` one.
  """
  tokens: Tuple[int, ...]
  rows: Tuple[int, ...]
  widths: Tuple[int, ...]
  block_size: int
  decode_steps: int
  enabled: bool = True
  prefix_caching: bool = False
  decode_shape: bool = False
  speculative: bool = False

  @classmethod
  def make(cls, *, max_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
           block_size: int, decode_steps: int, enabled: bool = True,
           prefix_caching: bool = False, decode_shape: bool = False,
           width_buckets: bool = True, speculative: bool = False) -> "StepBuckets":
    """The buckets of an engine's geometry; `decode_shape` counts only when not
    `enabled` (bucketed steps always have their decode-only shapes); `width_buckets=False`:
    one width, max_blocks_per_seq (`attention_reads_width`)."""
    if not enabled:
      return cls((max_num_batched_tokens,), (max_seqs,), (max_blocks_per_seq,), block_size,
                 decode_steps, enabled=False, prefix_caching=prefix_caching,
                 decode_shape=bool(decode_shape), speculative=speculative)
    # Tokens by 4x (a prefill chunk's cost is mostly the model's matmuls, and a
    # busy engine fills its budget); rows by 2x to 16, then 1.5x / 2x alternately (8, 16, 24,
    # 32, 48, ...: every decode step's matmuls, attention and sampling scale with R, and
    # with 2x steps a 36-42-row decode ran at R = 64, a third of it padding:
    # experiments.hf_peer_bench at 25M params); widths by 2x (attention only). The
    # smallest buckets keep small engines (tests) at one or two shapes each.
    return cls(_geometric(max_num_batched_tokens, min(16, max_num_batched_tokens), 4),
               _geometric(max_seqs, min(8, max_seqs), 2, halfway_from=16),
               (_geometric(max_blocks_per_seq, min(4, max_blocks_per_seq), 2) if width_buckets
                else (max_blocks_per_seq,)),
               block_size, decode_steps, prefix_caching=prefix_caching,
               speculative=speculative)

  @property
  def decode_shapes(self) -> bool:
    """Decode-only steps run on decode shapes (T = R, the decode kernel): bucketed, or
    unbucketed with `decode_shape`."""
    return self.enabled or self.decode_shape

  @property
  def max_variants(self) -> int:
    """Upper bound on distinct compiled steps: mixed (T, R, W) + decode-only (R, W),
    each with sampling or all-greedy (and, with prefix caching, full or light, and for
    mixed shapes admit-only too), each with or without `logprobs` (and, with speculative
    decoding, mixed shapes with or without drafts)."""
    p, sp = int(self.prefix_caching), int(self.speculative)
    return ((len(self.tokens) * (1 + 2 * p) * (1 + sp) + self.decode_shapes * (1 + p))
            * len(self.rows) * len(self.widths) * 2 * 2)

  def mixed_tokens(self, num_tokens: int) -> int:
    """T of a mixed step planning `num_tokens` new tokens (its padded token bucket)."""
    return _round_up(self.tokens, num_tokens)

  def pick(self, num_tokens: int, num_rows: int, max_len: int, decode_only: bool,
           all_greedy: bool = False, prefix_light: bool = False,
           prefix_admit_only: bool = False, logprobs: bool = False,
           spec: bool = False) -> Bucket:
    """The Bucket for a step with `num_tokens` new tokens, `num_rows` rows / sampled
    slots, and `max_len` tokens in its longest row after the step (`prefix_light`,
    `prefix_admit_only`: kept only with prefix caching; admit-only only on a mixed
    shape without `prefix_light`)."""
    rows = _round_up(self.rows, num_rows)
    if self.decode_steps > 1:
      max_len += self.decode_steps - 1          # the decode loop's tokens
    width = _round_up(self.widths, cdiv(max(max_len, 1), self.block_size))
    decode_only = decode_only and self.decode_shapes
    tokens = rows if decode_only else self.mixed_tokens(num_tokens)
    light = bool(prefix_light) and self.prefix_caching
    admit_only = bool(prefix_admit_only) and self.prefix_caching and not (light or decode_only)
    return Bucket(tokens, rows, width, decode_only, bool(all_greedy), light, admit_only,
                  bool(logprobs), bool(spec) and self.speculative and not decode_only)


def attention_reads_width(backend: str) -> bool:
  """Whether attention's cost follows the block-table width W (so W buckets pay), for a
  concrete attention spelling (`attention.resolve_step_backend`'s). The CPU kernels
  ("cpu", pallas_kernels/cpu) visit each sequence's keys up to its length whatever W is:
  on the shipped model, a churning batch ran 0.99x the time at one width
  (docs/notes/compile_budget.md, "Widths"), with fewer step shapes to compile.
  The gathering backends ("xla", "reference") read all W columns, and the GPU / TPU
  kernels size their KV splits by W: they keep the W buckets (not measured on a chip)."""
  return backend != "cpu"


def step_buckets(cache_config: CacheConfig, max_num_batched_tokens: int,
                 decode_steps_per_sync: int, shape_buckets: bool = True,
                 decode_shape: bool = False, width_buckets: bool = True,
                 speculative: bool = False) -> StepBuckets:
  """The step's shape buckets for an engine (tokens, rows, block-table widths;
  `shape_buckets` / `decode_shape`: the `EngineOptions` fields; `width_buckets`:
  `attention_reads_width` of the step's attention)."""
  return StepBuckets.make(max_seqs=cache_config.max_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_blocks_per_seq=cache_config.max_blocks_per_seq,
                          block_size=cache_config.block_size,
                          decode_steps=decode_steps_per_sync, enabled=shape_buckets,
                          prefix_caching=cache_config.enable_prefix_caching,
                          decode_shape=decode_shape, width_buckets=width_buckets,
                          speculative=speculative)


def reachable_buckets(buckets: StepBuckets, *, max_rows: int, max_len: int,
                      lanes_per_row: int = 1) -> List[Bucket]:
  """The shape buckets (T, R, W, decode_only; all_greedy False) a step can land on when
  at most `max_rows` sequences are live and none is longer than `max_len` tokens (as
  `StepBuckets.pick` would choose them), smallest first.

  `lanes_per_row` > 1 (parallel sampling: n children sample from their leader's row)
  lets the sampled lanes outnumber the chunks; with 1, a mixed step of T tokens has
  at most T - 1 rows (one chunk has >= 2 tokens), which drops (T, R) pairs with
  R > T. A frees-only step is decode_only at the smallest row bucket. Unbucketed: the
  largest shape, and with `decode_shape` the one decode shape (every run can reach it:
  a frees-only step lands there).
  """
  if max_rows < 1 or max_len < 1 or lanes_per_row < 1:
    raise ValueError(f"max_rows, max_len and lanes_per_row must be >= 1, got "
                     f"{max_rows}, {max_len}, {lanes_per_row}")
  if not buckets.enabled:   # the largest shape (and the decode shape)
    s, w = buckets.rows[-1], buckets.widths[-1]
    return [Bucket(buckets.tokens[-1], s, w, False)] + (
        [Bucket(s, s, w, True)] if buckets.decode_shape else [])
  max_rows = min(max_rows, buckets.rows[-1])
  rows = sorted({buckets.pick(1, k, 1, True).rows for k in range(1, max_rows + 1)})
  width_max = buckets.pick(1, 1, max_len, False).width
  out = []
  for w in (w for w in buckets.widths if w <= width_max):
    for r in rows:
      out.append(Bucket(r, r, w, True))
      fewest_rows = max([b for b in buckets.rows if b < r], default=0) + 1
      for t in (t for t in buckets.tokens if t >= 2):
        # A mixed step has a chunk of >= 2 tokens, so <= T - 1 chunks, each sampling
        # at most lanes_per_row slots.
        if fewest_rows <= min((t - 1) * lanes_per_row, max_rows):
          out.append(Bucket(t, r, w, False))
  return sorted(out, key=lambda b: (b.decode_only, b.tokens, b.rows, b.width))
