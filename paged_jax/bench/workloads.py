"""Seeded synthetic request streams standing in for the paper's datasets.

These are SYNTHETIC stand-ins, not the datasets: no ShareGPT or Alpaca text is
used. Prompt and output lengths are drawn from log-normal distributions (heavy
right tail, as conversation lengths are), clipped to the context limit, whose
location is calibrated so the clipped means match Table 1 of the vLLM paper
(arXiv:2309.06180): ShareGPT 161.31 input / 337.99 output tokens, Alpaca 19.31 /
58.45. The log-normal shapes (`sigma`) are our choice, not measured.

Clipping: prompt in [1, max_len - 1]; output in [1, max_len - prompt], so every
request fits the context (`prompt_len + output_len <= max_len`).

Prompt token ids are seeded uniform draws from `[0, vocab_size)`. Arrival times
(seconds) are a Poisson process at `request_rate` requests/s (`inf`: all at 0), from
`arrivals.arrival_times` with the stream's seed (the token ids do not depend on the rate).
The same seed gives the same stream; different seeds give different streams.

`scaled_requests` gives the streams the engine experiments serve: lengths divided as a
`scale.HarnessScale` says (the tiny model's `TINY` by default), byte-level token ids. The
real ShareGPT trace is `sharegpt_trace`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from paged_jax.bench import arrivals
from paged_jax.bench.scale import TINY
from paged_jax.config import check_int


@dataclasses.dataclass(frozen=True)
class LengthSpec:
  """Log-normal length distribution with a target mean (after clipping).

  Attributes:
    mean: target mean in tokens.
    sigma: log-space standard deviation (tail weight).
  """
  mean: float
  sigma: float


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  name: str
  prompt: LengthSpec
  output: LengthSpec


# Means: vLLM paper Table 1. Sigmas: our assumption (ShareGPT conversations are
# long-tailed in both directions; Alpaca instructions are short and uniform).
DATASETS: Dict[str, DatasetSpec] = {
    "sharegpt": DatasetSpec("sharegpt", LengthSpec(161.31, 1.0), LengthSpec(337.99, 1.0)),
    "alpaca": DatasetSpec("alpaca", LengthSpec(19.31, 0.6), LengthSpec(58.45, 0.9)),
}

# Few-shot translation prompts of the paper's shared-prefix experiment (Sec. 6.4).
FEW_SHOT_PREFIX_LEN = {1: 80, 5: 341}


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  Attributes:
    request_id: position in the stream (0-based).
    prompt_token_ids: i32[prompt_len] prompt tokens.
    output_len: tokens to generate (>= 1).
    arrival_time: seconds since the stream starts.
  """
  request_id: int
  prompt_token_ids: np.ndarray
  output_len: int
  arrival_time: float = 0.0

  @property
  def prompt_len(self) -> int:
    return int(self.prompt_token_ids.shape[0])

  @property
  def total_len(self) -> int:
    """Tokens held at the end: prompt plus generated output."""
    return self.prompt_len + self.output_len


def _clipped(mu: float, sigma: float, z: np.ndarray, hi: np.ndarray) -> np.ndarray:
  return np.clip(np.rint(np.exp(mu + sigma * z)), 1, hi)


def _calibrate(target: float, sigma: float, z: np.ndarray, hi: np.ndarray) -> float:
  """Log-location mu whose clipped, rounded lengths on standard normals `z` average `target`."""
  if not 1.0 < target < float(np.mean(hi)):
    raise ValueError(f"mean length {target} must be in (1, {float(np.mean(hi)):.1f})")
  lo_mu, hi_mu = -5.0, math.log(float(np.max(hi))) + 5 * sigma
  for _ in range(60):   # the clipped mean is monotone in mu: bisection
    mid = 0.5 * (lo_mu + hi_mu)
    if _clipped(mid, sigma, z, hi).mean() < target:
      lo_mu = mid
    else:
      hi_mu = mid
  return 0.5 * (lo_mu + hi_mu)


@functools.lru_cache(maxsize=32)
def _locations(prompt: LengthSpec, output: LengthSpec, max_len: int) -> Tuple[float, float]:
  """Calibrated (mu_prompt, mu_output) on a fixed 2**17-draw sample (common random numbers)."""
  z = np.random.default_rng(20230912).standard_normal((2, 1 << 17))
  mu_p = _calibrate(prompt.mean, prompt.sigma, z[0], np.full(z.shape[1], max_len - 1))
  prompts = _clipped(mu_p, prompt.sigma, z[0], max_len - 1)
  mu_o = _calibrate(output.mean, output.sigma, z[1], max_len - prompts)
  return mu_p, mu_o


def sample_lengths(spec: DatasetSpec, num_requests: int, *, seed: int = 0,
                   max_len: int = 2048) -> Tuple[np.ndarray, np.ndarray]:
  """(prompt_lens i32[n], output_lens i32[n]) of a synthetic stream; no token ids."""
  check_int("num_requests", num_requests, 0)
  check_int("max_len", max_len, 2)
  mu_p, mu_o = _locations(spec.prompt, spec.output, max_len)
  z = np.random.default_rng([seed, 1]).standard_normal((2, num_requests))
  prompts = _clipped(mu_p, spec.prompt.sigma, z[0], max_len - 1)
  outputs = _clipped(mu_o, spec.output.sigma, z[1], max_len - prompts)
  return prompts.astype(np.int32), outputs.astype(np.int32)


def synthetic(dataset: str, num_requests: int, *, seed: int = 0, max_len: int = 2048,
              vocab_size: int = 32000, request_rate: float = math.inf) -> List[Request]:
  """A ShareGPT-like or Alpaca-like stream (see module docstring).

  Args:
    dataset: "sharegpt" or "alpaca".
    num_requests: requests in the stream.
    seed: the stream's seed (lengths, token ids and arrivals).
    max_len: context limit; prompt_len + output_len <= max_len.
    vocab_size: token ids are uniform in [0, vocab_size).
    request_rate: Poisson arrival rate in requests/s (inf: all arrive at 0).
  """
  if dataset not in DATASETS:
    raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
  check_int("vocab_size", vocab_size, 1)
  prompts, outputs = sample_lengths(DATASETS[dataset], num_requests, seed=seed, max_len=max_len)
  rng = np.random.default_rng([seed, 2])
  times = arrivals.arrival_times(request_rate, seed=seed, num_requests=num_requests)
  ids = rng.integers(0, vocab_size, int(prompts.sum()), dtype=np.int32)
  starts = np.concatenate([[0], np.cumsum(prompts)])
  return [Request(i, ids[starts[i]:starts[i + 1]], int(outputs[i]), float(times[i]))
          for i in range(num_requests)]


def sharegpt(num_requests: int, **kwargs) -> List[Request]:
  """ShareGPT-like stream: mean 161.31 prompt / 337.99 output tokens."""
  return synthetic("sharegpt", num_requests, **kwargs)


def alpaca(num_requests: int, **kwargs) -> List[Request]:
  """Alpaca-like stream: mean 19.31 prompt / 58.45 output tokens."""
  return synthetic("alpaca", num_requests, **kwargs)


def shared_prefix(num_requests: int, *, num_shots: Optional[int] = 1,
                  prefix_len: Optional[int] = None, suffix: LengthSpec = LengthSpec(30.0, 0.5),
                  output: LengthSpec = LengthSpec(30.0, 0.5), seed: int = 0,
                  max_len: int = 2048, vocab_size: int = 32000,
                  request_rate: float = math.inf) -> Tuple[np.ndarray, List[Request]]:
  """One shared system prompt followed by distinct suffixes (few-shot translation).

  The prefix length is `FEW_SHOT_PREFIX_LEN[num_shots]` (1-shot 80, 5-shot 341
  tokens, as in the paper) unless `prefix_len` is given. Suffix (the sentence to
  translate) and output lengths are log-normal with the given means (our
  assumption: about 30 tokens each).

  Returns:
    (prefix i32[prefix_len], requests) where every request's prompt starts with
    `prefix`.
  """
  if prefix_len is None:
    if num_shots not in FEW_SHOT_PREFIX_LEN:
      raise ValueError(f"num_shots must be one of {sorted(FEW_SHOT_PREFIX_LEN)} "
                       f"(or pass prefix_len), got {num_shots}")
    prefix_len = FEW_SHOT_PREFIX_LEN[num_shots]
  check_int("prefix_len", prefix_len, 1, max_len - 2)
  check_int("vocab_size", vocab_size, 1)
  rest = max_len - prefix_len
  spec = DatasetSpec("shared_prefix", suffix, output)
  suffixes, outputs = sample_lengths(spec, num_requests, seed=seed, max_len=rest)
  rng = np.random.default_rng([seed, 3])
  prefix = rng.integers(0, vocab_size, prefix_len, dtype=np.int32)
  times = arrivals.arrival_times(request_rate, seed=seed, num_requests=num_requests)
  requests = []
  for i in range(num_requests):
    tail = rng.integers(0, vocab_size, int(suffixes[i]), dtype=np.int32)
    requests.append(Request(i, np.concatenate([prefix, tail]), int(outputs[i]),
                            float(times[i])))
  return prefix, requests


def scaled_requests(dataset: str, num_requests: int, *, seed: int = 0,
                    max_len: int = TINY.max_len, scale: Optional[float] = None
                    ) -> List[Request]:
  """A synthetic stream whose mean lengths are Table 1's divided by `scale`.

  Args:
    dataset: "sharegpt" or "alpaca".
    num_requests: requests (>= 1).
    seed: stream seed.
    max_len: context limit; prompt + output <= max_len.
    scale: mean divisor (default `TINY.divisor(dataset)`: the tiny model's streams).
  Returns:
    Request list, all arriving at t = 0, token ids in [0, 256) (byte-level).
  """
  if dataset not in DATASETS:
    raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {dataset!r}")
  scale = TINY.divisor(dataset) if scale is None else scale
  if not scale >= 1:
    raise ValueError(f"scale must be >= 1, got {scale}")
  base = DATASETS[dataset]
  spec = DatasetSpec(f"{dataset}/{scale:g}",
                     LengthSpec(base.prompt.mean / scale, base.prompt.sigma),
                     LengthSpec(base.output.mean / scale, base.output.sigma))
  prompts, outputs = sample_lengths(spec, num_requests, seed=seed, max_len=max_len)
  rng = np.random.default_rng([seed, 7])
  return [Request(i, rng.integers(0, 256, int(p), dtype=np.int32), int(o))
          for i, (p, o) in enumerate(zip(prompts, outputs))]
