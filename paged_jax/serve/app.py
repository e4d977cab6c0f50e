"""The HTTP surface: OpenAI's routes over one `EngineRunner` (Starlette, ASGI).

    /v1/models  /v1/completions  /v1/chat/completions  /health  /metrics

Response bodies follow the OpenAI API (and vLLM's server) so the `openai` package, load
generators and evaluation harnesses work unchanged. Errors are OpenAI's error object
with HTTP 400 (bad request), 404 (unknown route) or 503 (shutting down); an exception
inside one request answers 500 for that request only.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Callable, Dict, List

import prometheus_client as prom
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from paged_jax.serve import protocol
from paged_jax.serve.runner import EngineRunner, Tracker


def error(status: int, message: str, param=None) -> JSONResponse:
  kind = "invalid_request_error" if status == 400 else "server_error"
  return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}, status_code=status)


class Metrics:
  """Prometheus series (names as vLLM's, prefix `paged_jax:`), on a registry of its own."""

  def __init__(self):
    self.registry = r = prom.CollectorRegistry()
    g = lambda n, d: prom.Gauge(f"paged_jax:{n}", d, registry=r)
    self.kv_usage = g("kv_cache_usage_perc", "KV blocks in use (not free, not evictable), 0-1")
    self.running = g("num_requests_running", "requests in the running batch")
    self.waiting = g("num_requests_waiting", "requests waiting (or swapped out)")
    self.hit_rate = g("prefix_cache_hit_rate", "prefix-cache hit blocks / queried blocks")
    buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
    h = lambda n, d: prom.Histogram(f"paged_jax:{n}", d, buckets=buckets, registry=r)
    self.ttft = h("time_to_first_token_seconds", "arrival to first token, s")
    self.tpot = h("time_per_output_token_seconds", "after the first token, s per token")
    self.e2e = h("e2e_request_latency_seconds", "arrival to last token, s")
    c = lambda n, d: prom.Counter(f"paged_jax:{n}", d, registry=r)
    self.prompt_tokens = c("prompt_tokens", "prompt tokens of finished requests")
    self.generation_tokens = c("generation_tokens", "generated tokens of finished requests")
    self.finished = prom.Counter("paged_jax:request_success", "finished requests by reason",
                                 ["finished_reason"], registry=r)

  def on_step(self, m: Dict[str, Any], ended: List[Tracker]) -> None:
    used = m["num_blocks"] - m["num_free_blocks"] - m["num_evictable_blocks"]
    self.kv_usage.set(used / max(1, m["num_blocks"]))
    self.running.set(m["num_running"])
    self.waiting.set(m["num_waiting"] + m["num_swapped"])
    self.hit_rate.set(m["prefix_hit_rate"])
    now = time.perf_counter()
    for t in ended:
      n = t.num_generated
      if t.t_first is not None:
        self.ttft.observe(t.t_first - t.t_submit)
        if n > 1:
          self.tpot.observe((now - t.t_first) / (n - 1))
      self.e2e.observe(now - t.t_submit)
      self.prompt_tokens.inc(len(t.request.prompt_ids))
      self.generation_tokens.inc(n)
      for f in t.finish:
        self.finished.labels(f or "abort").inc()


def _usage(trackers: List[Tracker]) -> Dict[str, int]:
  p = sum(len(t.request.prompt_ids) for t in trackers)
  c = sum(t.num_generated for t in trackers)
  return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(runner: EngineRunner, *, model_name: str, encode: Callable, decode: Callable,
              render_chat: Callable, stop_ids, vocab_size: int, max_model_len: int,
              seed: int = 0, drain_s: float = 30.0, metrics: Metrics = None) -> Starlette:
  """The Starlette app. `encode` / `decode`: the tokenizer; `render_chat(messages)`: the
  chat template; `stop_ids`: the model's EOS ids; `seed`: seeds the per-request seeds of
  requests that give none (reproducible per server run); `drain_s`: how long shutdown
  lets running requests finish before aborting them."""
  import random  # pylint: disable=g-import-not-at-top
  seeds = random.Random(seed)
  created = int(time.time())
  limits = dict(max_model_len=max_model_len, stop_ids=stop_ids)

  async def run(request: Request, reqs: List[protocol.EngineRequest], chat: bool) -> Response:
    try:
      trackers = await runner.submit(reqs)
    except protocol.RequestError as e:
      return error(503 if not runner.accepting else 400, e.message, e.param)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    obj = "chat.completion" if chat else "text_completion"
    head = {"id": rid, "created": int(time.time()), "model": model_name}

    def choice(index, text, finish, delta, t=None, j=0, span=(0, 0), echo=False):
      lp = None
      if t is not None and t.request.logprobs is not None:
        lp = _logprobs(t, j, span, decode, chat, echo)
      if chat:
        key = "delta" if delta else "message"
        return {"index": index, key: {"role": "assistant", "content": text},
                "logprobs": lp, "finish_reason": finish}
      return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    n = reqs[0].params.n
    if reqs[0].stream:
      async def events():
        try:
          for k, t in enumerate(trackers):
            deltas = ...
            if t.request.echo:
              if t.request.logprobs is not None:   # the prompt's scores come with the
                deltas = await t.events.get()      # first tokens
              for j in range(n):
                yield _sse({**head, "object": obj, "choices": [
                    choice(k * n + j, decode(t.request.prompt_ids), None, True, t, j,
                           (0, 0), echo=True)]})
            if deltas is ...:
              deltas = await t.events.get()
            while deltas is not None:
              yield _sse({**head, "object": obj + (".chunk" if chat else ""), "choices": [
                  choice(k * n + j, text, f, True, t, j, (a, b))
                  for j, text, f, a, b in deltas]})
              deltas = await t.events.get()
          if reqs[0].include_usage:
            yield _sse({**head, "object": obj, "choices": [], "usage": _usage(trackers)})
          yield "data: [DONE]\n\n"
        finally:   # the client went away (or we are done): nothing may keep running
          for t in trackers:
            if not t.done:
              runner.abort_soon(t.request_id)
      return StreamingResponse(events(), media_type="text/event-stream")

    waiter = asyncio.ensure_future(asyncio.gather(*[_drain(t) for t in trackers]))
    while not waiter.done():   # a client that disconnects aborts its requests
      await asyncio.wait([waiter], timeout=0.25)
      if not waiter.done() and await request.is_disconnected():
        for t in trackers:
          await runner.abort(t.request_id)
    choices = []
    for k, t in enumerate(trackers):
      echo = decode(t.request.prompt_ids) if t.request.echo else ""
      choices += [choice(k * n + j, echo + t.texts[j], t.finish[j], False, t, j,
                         (0, t.num_sent[j]), echo=t.request.echo) for j in range(n)]
    return JSONResponse({**head, "object": obj, "choices": choices, "usage": _usage(trackers)})

  async def body_of(request: Request):
    try:
      return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
      raise protocol.RequestError("the body is not valid JSON") from None

  def route(parse, chat: bool):
    """A POST route: the body parsed into engine requests (a 400 on any RequestError),
    then run."""
    async def handle(request: Request) -> Response:
      try:
        reqs = parse(await body_of(request), seed=seeds.randrange(2**31 - 4097))
      except protocol.RequestError as e:
        return error(400, e.message, e.param)
      return await run(request, reqs, chat=chat)
    return handle

  completions = route(lambda body, seed: protocol.completion_requests(
      body, encode=encode, vocab_size=vocab_size, seed=seed, **limits), chat=False)
  chat_completions = route(lambda body, seed: [protocol.chat_request(
      body, render=render_chat, encode=encode, seed=seed, **limits)], chat=True)

  async def models(_: Request) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": model_name, "object": "model", "created": created, "owned_by": "paged_jax",
         "max_model_len": max_model_len}]})

  async def health(_: Request) -> Response:
    return Response(status_code=200 if runner.accepting else 503)

  async def prometheus(_: Request) -> Response:
    return PlainTextResponse(prom.generate_latest(metrics.registry).decode(),
                             media_type=prom.CONTENT_TYPE_LATEST)

  metrics = metrics or Metrics()
  runner.on_step = metrics.on_step

  async def lifespan(_app):
    await runner.start()
    yield
    await runner.shutdown(drain_s)

  async def server_error(_request, exc):
    return error(500, f"{type(exc).__name__}: {exc}")

  return Starlette(routes=[
      Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
      Route("/v1/chat/completions", chat_completions, methods=["POST"]),
      Route("/health", health), Route("/metrics", prometheus)],
      lifespan=lifespan, exception_handlers={500: server_error})


def _logprobs(t: Tracker, j: int, span, decode, chat: bool, echo: bool = False):
  """OpenAI's logprobs object for generated tokens span[0]:span[1] of sample j, after
  the prompt's tokens when `echo` (completions: the first prompt token has no logprob).
  Each token's text is its own decoded piece; completions' text_offset counts from the
  start of the choice's text (echo included), as the pieces add up."""
  k = t.request.logprobs
  a, b = span
  ids, lps = t.tokens[j][a:b], t.logprobs[j][a:b]
  tops = t.top_logprobs[j][a:b] if k else [()] * len(ids)
  piece = lambda i: decode([i])
  if chat:
    entry = lambda s, lp: {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return {"content": [dict(entry(piece(i), lp), top_logprobs=[
        entry(piece(x), v) for x, v in top]) for i, lp, top in zip(ids, lps, tops)]}
  prompt = t.request.prompt_ids if echo else []
  scores, prompt_tops = t.prompt_scores or ([None] * len(prompt), [None] * len(prompt))
  texts = [piece(i) for i in list(prompt) + list(ids)]
  echo_offsets = t.prompt_offsets(decode) if t.request.echo else [0]
  head = echo_offsets[-1]    # the echoed prompt's length, as its pieces add up
  ends = t.decoded[j].ends
  offsets = echo_offsets[:len(prompt)]
  offsets += [head + (ends[m - 1] if m else 0) for m in range(a, b)]
  top_dicts = None
  if k:
    as_dict = lambda top, own: None if top is None else {
        **{piece(x): v for x, v in top}, **({} if own is None else {own[0]: own[1]})}
    top_dicts = [as_dict(top, None if lp is None else (texts[m], lp)) for m, (top, lp)
                 in enumerate(zip(prompt_tops[:len(prompt)], scores[:len(prompt)]))]
    top_dicts += [as_dict(top, (piece(i), lp)) for i, lp, top in zip(ids, lps, tops)]
  return {"tokens": texts, "token_logprobs": list(scores[:len(prompt)]) + list(lps),
          "top_logprobs": top_dicts, "text_offset": offsets}


async def _drain(t: Tracker) -> None:
  while await t.events.get() is not None:
    pass
