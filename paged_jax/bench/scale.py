"""The scale at which the harness runs the real engine: stream lengths, context, widths.

    from paged_jax.bench.scale import TINY
    TINY.max_len, TINY.divisor("sharegpt")          # 256 tokens, mean lengths / 4

What is synthetic at `TINY` (every engine experiment's default): the streams are
`workloads`' seeded ShareGPT-like / Alpaca-like lengths (the paper's Table 1 means) with
each mean divided by `divisor(dataset)` (ShareGPT 4, Alpaca 1) and clipped to `max_len`
tokens, so the shipped tiny byte-level model (4 layers, 1024 positions) serves a stream
on 2 CPU cores in seconds. Memory-only simulations (`baselines.simulate`) need no engine
and run the unscaled streams.

Another setting (the paper's: unscaled lengths, a 2,048-token context) is another
`HarnessScale`; nothing in the loops depends on which one an experiment picks.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class HarnessScale:
  """Sizes an engine experiment runs at.

  Attributes:
    name: short name recorded with results.
    length_divisor: dataset -> divisor of its Table 1 mean lengths for engine streams
      (>= 1; a dataset not named here is unscaled).
    max_len: context limit of the engine streams, tokens (prompt + output <= max_len);
      also Orca(Max)'s per-sequence reservation.
    max_beam_width: widest parallel sampling n / beam width an engine compiles its step for.
    max_num_batched_tokens: tokens one engine step may compute.
  """
  name: str
  length_divisor: Mapping[str, float] = dataclasses.field(hash=False)
  max_len: int
  max_beam_width: int
  max_num_batched_tokens: int

  def __post_init__(self):
    for dataset, d in self.length_divisor.items():
      if not d >= 1:
        raise ValueError(f"length_divisor[{dataset!r}] must be >= 1, got {d}")
    for field in ("max_len", "max_beam_width", "max_num_batched_tokens"):
      if getattr(self, field) < 1:
        raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")

  def divisor(self, dataset: str) -> float:
    """Mean-length divisor of `dataset`'s engine streams ("sharegpt-real" is ShareGPT's)."""
    return self.length_divisor.get(dataset.split("-")[0], 1.0)


# The shipped tiny model on a CPU: ShareGPT means / 4, 256-token context, one compiled
# step for every n or beam width up to 6, 256 tokens a step.
TINY = HarnessScale("tiny", {"sharegpt": 4, "alpaca": 1}, max_len=256, max_beam_width=6,
                    max_num_batched_tokens=256)
