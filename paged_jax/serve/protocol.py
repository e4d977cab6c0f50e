"""OpenAI request bodies -> engine requests: parsing and validation, nothing else.

Every check here runs before a request is queued, so a bad request is an HTTP 400 with
a one-line message naming the field (`RequestError`), as the OpenAI API and vLLM answer
it, and never reaches the engine. Fields follow OpenAI's completions / chat completions;
`top_k`, `stop_token_ids`, `ignore_eos` and `cache_salt` are vLLM's extensions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from paged_jax.engine import MAX_STOP_IDS, SamplingParams
from paged_jax.engine.params import MAX_LOGPROBS

MAX_STOP_STRINGS = 4          # OpenAI's bound on `stop`
MAX_PROMPTS = 64              # prompts in one /v1/completions request (a list of prompts)


class RequestError(ValueError):
  """A client error: HTTP 400 with `message`; `param` names the offending field."""

  def __init__(self, message: str, param: Optional[str] = None):
    super().__init__(message)
    self.message, self.param = message, param


@dataclasses.dataclass
class EngineRequest:
  """One prompt of a request, ready for `Engine.add_request`.

  Attributes:
    prompt_ids: the prompt's token ids.
    params: the engine's SamplingParams (stop ids already merged in).
    stop: stop strings, matched on the decoded text (host side; the match and what
      follows it are cut, finish reason "stop").
    stream: answer as server-sent events.
    echo: the prompt's text is put before each completion (completions only).
    include_usage: a final usage chunk when streaming (`stream_options`).
    logprobs: None, or report each token's log-probability with this many top
      alternatives (completions `logprobs=k`, chat `logprobs` + `top_logprobs=k`); with
      echo, the prompt's tokens too (`SamplingParams.prompt_logprobs`).
  """
  prompt_ids: List[int]
  params: SamplingParams
  stop: List[str]
  stream: bool = False
  echo: bool = False
  include_usage: bool = False
  logprobs: Optional[int] = None


def _get(body: Dict[str, Any], name: str, kinds, default=None, *, lo=None, hi=None):
  """body[name] checked against `kinds` and [lo, hi] (None: unbounded)."""
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) and bool not in kinds:
    raise RequestError(f"{name} must be {kinds[0].__name__}, got {v!r}", name)
  if not isinstance(v, kinds):
    raise RequestError(f"{name} must be {kinds[0].__name__}, got {type(v).__name__}", name)
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    raise RequestError(f"{name} must be in [{lo}, {hi}], got {v!r}", name)
  return v


def _stop_strings(body) -> List[str]:
  stop = body.get("stop")
  if stop is None:
    return []
  stops = [stop] if isinstance(stop, str) else stop
  if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
      or not all(isinstance(s, str) and s for s in stops)):
    raise RequestError(f"stop must be a non-empty string or a list of at most "
                       f"{MAX_STOP_STRINGS} non-empty strings, got {stop!r}", "stop")
  return stops


def prompts_of(body: Dict[str, Any], encode, vocab_size: int) -> List[List[int]]:
  """`prompt` of /v1/completions as id lists: a string, a list of strings, a list of ids
  or a list of id lists (OpenAI's four forms)."""
  p = body.get("prompt")
  form = "a string, a list of strings, a list of token ids or a list of such lists"
  if isinstance(p, str):
    items = [p]
  elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
    items = [p]
  elif isinstance(p, list) and p and all(isinstance(t, (str, list)) for t in p):
    items = p
  else:
    raise RequestError(f"prompt must be {form}, got {type(p).__name__}", "prompt")
  if len(items) > MAX_PROMPTS:
    raise RequestError(f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS}", "prompt")
  out = []
  for i, item in enumerate(items):
    ids = encode(item) if isinstance(item, str) else item
    if not ids:
      raise RequestError(f"prompt {i} is empty", "prompt")
    for t in ids:
      if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
        raise RequestError(f"prompt {i} holds {t!r}, not a token id in [0, {vocab_size})",
                           "prompt")
    out.append(list(ids))
  return out


def sampling_params(body: Dict[str, Any], *, prompt_len: int, max_model_len: int,
                    default_max_tokens: Optional[int], stop_ids: Sequence[int],
                    seed: int, logprobs: Optional[int] = None,
                    echo: bool = False) -> SamplingParams:
  """SamplingParams of a request body. `default_max_tokens` None: up to the context
  (chat); `seed` is used when the body has none (the server draws one per request);
  `logprobs` (`logprobs_wanted`) with `echo` scores the prompt too."""
  room = max_model_len - prompt_len
  if room < 1:
    raise RequestError(f"the prompt has {prompt_len} tokens; this model's context is "
                       f"{max_model_len}, so at most {max_model_len - 1}", "prompt")
  name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
  max_tokens = _get(body, name, (int,), None, lo=1, hi=room)
  if max_tokens is None:   # not given: the default, cut to the room the context leaves
    max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
  extra = _get(body, "stop_token_ids", (list,), [])
  ignore_eos = _get(body, "ignore_eos", (bool,), False)
  ids = list(dict.fromkeys(([] if ignore_eos else list(stop_ids)) + list(extra)))
  if len(ids) > MAX_STOP_IDS:
    raise RequestError(f"stop_token_ids: at most {MAX_STOP_IDS} ids with the model's own",
                       "stop_token_ids")
  kw = dict(max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", (int, float), 1.0, lo=0, hi=2)),
            top_p=float(_get(body, "top_p", (int, float), 1.0, lo=0, hi=1)),
            top_k=_get(body, "top_k", (int,), -1, lo=-1),
            n=_get(body, "n", (int,), 1, lo=1, hi=16),
            seed=_get(body, "seed", (int,), seed, lo=0, hi=2**31 - 4097),
            stop_token_ids=tuple(ids), cache_salt=_get(body, "cache_salt", (str,), None),
            logprobs=logprobs or 0, prompt_logprobs=logprobs if echo else None)
  if kw["top_p"] == 0:
    raise RequestError("top_p must be in (0, 1], got 0", "top_p")
  try:
    return SamplingParams(**kw)
  except ValueError as e:
    raise RequestError(str(e), str(e).split(" ", 1)[0]) from None


def logprobs_wanted(body: Dict[str, Any], chat: bool) -> Optional[int]:
  """None when the body asks for no logprobs, else the number of top alternatives per
  token: completions `logprobs=k` (0: the sampled token's own only), chat
  `logprobs=true` with `top_logprobs=k` (0 or absent: none)."""
  if chat:
    want = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
      raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    return (top or 0) if want else None
  return _get(body, "logprobs", (int,), None, lo=0, hi=MAX_LOGPROBS)


def reject_unsupported(body: Dict[str, Any]) -> None:
  """Fields the engine cannot honour yet are refused by name, not ignored."""
  if body.get("best_of") not in (None, 1):
    raise RequestError("best_of is not supported by this server (only 1)", "best_of")
  for name in ("suffix", "logit_bias", "tools", "functions", "response_format"):
    if body.get(name):
      raise RequestError(f"{name} is not supported by this server", name)
  for name in ("presence_penalty", "frequency_penalty"):
    if body.get(name) not in (None, 0, 0.0):
      raise RequestError(f"{name} is not supported by this server (only 0)", name)


def completion_requests(body, *, encode, vocab_size, max_model_len, stop_ids,
                        seed) -> List[EngineRequest]:
  """The engine requests of a /v1/completions body (one per prompt)."""
  if not isinstance(body, dict):
    raise RequestError("the body must be a JSON object")
  reject_unsupported(body)
  stream, echo = _get(body, "stream", (bool,), False), _get(body, "echo", (bool,), False)
  usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
  stops, logprobs = _stop_strings(body), logprobs_wanted(body, chat=False)
  out = []
  for ids in prompts_of(body, encode, vocab_size):
    sp = sampling_params(body, prompt_len=len(ids), max_model_len=max_model_len,
                         default_max_tokens=16, stop_ids=stop_ids, seed=seed,
                         logprobs=logprobs, echo=echo)
    out.append(EngineRequest(ids, sp, stops, stream, echo, usage, logprobs))
  return out


def chat_request(body, *, render, encode, max_model_len, stop_ids, seed) -> EngineRequest:
  """The engine request of a /v1/chat/completions body; `render(messages) -> str`
  applies the checkpoint's chat template."""
  if not isinstance(body, dict):
    raise RequestError("the body must be a JSON object")
  reject_unsupported(body)
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise RequestError("messages must be a non-empty list of {role, content}", "messages")
  for i, m in enumerate(msgs):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
        or not isinstance(m.get("content"), (str, list)):
      raise RequestError(f"messages[{i}] must be an object with a string role and content",
                         "messages")
    if isinstance(m["content"], list):   # content parts: text only
      if not all(isinstance(p, dict) and p.get("type") == "text" for p in m["content"]):
        raise RequestError(f"messages[{i}].content: only text parts are supported",
                           "messages")
      m = dict(m, content="".join(p.get("text", "") for p in m["content"]))
      msgs[i] = m
  try:
    ids = encode(render(msgs))
  except ValueError as e:   # the chat template refused the messages (raise_exception)
    raise RequestError(str(e), "messages") from None
  stream = _get(body, "stream", (bool,), False)
  usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
  logprobs = logprobs_wanted(body, chat=True)
  sp = sampling_params(body, prompt_len=len(ids), max_model_len=max_model_len,
                       default_max_tokens=None, stop_ids=stop_ids, seed=seed,
                       logprobs=logprobs)
  return EngineRequest(ids, sp, _stop_strings(body), stream, False, usage, logprobs)
