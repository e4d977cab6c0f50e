"""One engine, one asyncio loop: requests in, token deltas out.

The engine is not thread-safe and its step blocks (the jitted call), so every engine call
(add_request, step, abort, metrics) runs on ONE worker thread, in order, while the event
loop keeps serving HTTP. The loop `_run` is the server's whole schedule:

    while requests are unfinished:  step() on the worker -> hand each request its new
                                    tokens (text deltas, stop strings) -> finished ones end

Concurrent requests therefore batch into the same engine steps exactly as
`Engine.generate` batches a list. A client that goes away calls `abort`, which frees the
request's blocks at once (`Engine.abort`).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import dataclasses
import itertools
import time
from typing import Any, Dict, List, Optional, Tuple

from paged_jax.serve.protocol import EngineRequest, RequestError

# (sample index, new text, finish reason or None, first and end token of the new text)
Delta = Tuple[int, str, Optional[str], int, int]


@dataclasses.dataclass
class Tracker:
  """The server's view of one engine request.

  Attributes:
    request_id: the engine's id.
    request: what was asked (prompt ids, params, stop strings).
    texts: per sample, the text sent so far (stop string cut).
    tokens: per sample, the ids generated so far.
    logprobs: per sample, each generated id's log-probability under the model.
    top_logprobs: per sample, each generated id's best (id, log-prob) alternatives
      (`SamplingParams.logprobs` of them; empty without).
    decoded: per sample, `Detokenizer` state: the text of `tokens` decoded so far, one
      window of new ids per step (no re-decoding of the whole output).
    num_sent: per sample, how many of `tokens` the text sent so far covers (a stop
      string cuts the text; logprobs are reported for these tokens).
    finish: per sample, "stop" / "length" / "abort" once done.
    prompt_scores: the RequestOutput's (prompt_logprobs, prompt_top_logprobs) once the
      engine has them (echo with logprobs), else None.
    events: lists of Deltas as they come; None after the last.
    t_submit, t_first: perf_counter seconds at submit and at the first token.
    cut_early: a stop string ended a sample the engine is still running.
  """
  request_id: Any
  request: EngineRequest
  texts: List[str]
  tokens: List[List[int]]
  logprobs: List[List[float]]
  top_logprobs: List[List[tuple]]
  decoded: List["Detokenizer"]
  num_sent: List[int]
  finish: List[Optional[str]]
  events: asyncio.Queue
  t_submit: float
  t_first: Optional[float] = None
  cut_early: bool = False
  prompt_scores: Optional[tuple] = None
  echo_offsets: Optional[List[int]] = None

  def prompt_offsets(self, decode) -> List[int]:
    """The echoed prompt's text offsets, as its tokens' own pieces add up (one more
    entry: its whole length); decoded once per request, not once per streamed chunk."""
    if self.echo_offsets is None:
      lens = [len(decode([i])) for i in self.request.prompt_ids]
      self.echo_offsets = list(itertools.accumulate([0] + lens))
    return self.echo_offsets

  @classmethod
  def new(cls, request_id, request: EngineRequest, decode, now: float) -> "Tracker":
    n = request.params.n
    return cls(request_id, request, [""] * n, [[] for _ in range(n)], [[] for _ in range(n)],
               [[] for _ in range(n)], [Detokenizer(decode) for _ in range(n)], [0] * n,
               [None] * n, asyncio.Queue(), now)

  @property
  def done(self) -> bool:
    return all(f is not None for f in self.finish)

  @property
  def num_generated(self) -> int:
    return sum(len(t) for t in self.tokens)


class EngineRunner:
  """Drives `engine` from the running event loop (`start` inside it).

  Args:
    engine: a paged_jax Engine.
    decode: ids -> text (the checkpoint's tokenizer).
    on_step: called on the loop after each step with (engine.metrics(), finished
      trackers): the server's Prometheus gauges and histograms.
  """

  def __init__(self, engine, decode, on_step=None):
    self.engine, self._decode, self.on_step = engine, decode, on_step
    self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
    self._trackers: Dict[Any, Tracker] = {}
    self._ids = itertools.count()
    self._wake: Optional[asyncio.Event] = None
    self._task: Optional[asyncio.Task] = None
    self._pending = set()    # abort_soon tasks, held until done
    self.accepting = True
    self.last_metrics: Dict[str, Any] = engine.metrics()

  # ---- lifecycle ----------------------------------------------------------------------
  async def start(self) -> None:
    self._wake = asyncio.Event()
    self._task = asyncio.get_running_loop().create_task(self._run())

  async def shutdown(self, drain_s: float) -> None:
    """Stops taking requests, lets running ones finish for up to `drain_s` seconds,
    aborts the rest (their clients get finish reason "abort"), stops the loop."""
    self.accepting = False
    deadline = time.monotonic() + drain_s
    while self._trackers and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    for rid in list(self._trackers):
      await self.abort(rid)
    if self._task is not None:
      self._task.cancel()
      try:
        await self._task
      except asyncio.CancelledError:
        pass
    self._worker.shutdown(wait=True)

  async def _call(self, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

  # ---- requests -----------------------------------------------------------------------
  async def submit(self, requests: List[EngineRequest]) -> List[Tracker]:
    """Queues all of `requests` or none (the engine's own check, e.g. a prompt the
    cache could never hold, is a RequestError -> HTTP 400)."""
    if not self.accepting:
      raise RequestError("the server is shutting down")
    ids = [f"cmpl-{next(self._ids)}" for _ in requests]

    def add_all():
      done = []
      try:
        for rid, r in zip(ids, requests):
          self.engine.add_request(r.prompt_ids, r.params, request_id=rid)
          done.append(rid)
      except ValueError as e:
        for rid in done:
          self.engine.abort(rid)
        raise RequestError(str(e)) from None

    await self._call(add_all)
    now = time.perf_counter()
    out = []
    for rid, r in zip(ids, requests):
      t = Tracker.new(rid, r, self._decode, now)
      self._trackers[rid] = t
      out.append(t)
    self._wake.set()
    return out

  async def abort(self, request_id) -> None:
    """Ends a request now and frees its blocks; its tracker ends with "abort"."""
    t = self._trackers.pop(request_id, None)
    await self._call(self.engine.abort, request_id)
    if t is not None:
      self._end(t, [(j, "", "abort", t.num_sent[j], t.num_sent[j])
                    for j, f in enumerate(t.finish) if f is None])
      self.last_metrics = metrics = await self._call(self.engine.metrics)
      if self.on_step is not None:
        self.on_step(metrics, [t])

  def abort_soon(self, request_id) -> None:
    """`abort` as a task of its own: for a handler being cancelled (a dropped stream),
    whose own awaits would be cancelled before the abort ran."""
    task = asyncio.get_running_loop().create_task(self.abort(request_id))
    self._pending.add(task)
    task.add_done_callback(self._pending.discard)

  # ---- the loop -----------------------------------------------------------------------
  def _step(self):
    """On the worker: one engine step; finished outputs, partial ids, metrics."""
    finished = self.engine.step()
    partial = {rid: self.engine.partial_outputs(rid) for rid in list(self._trackers)}
    return finished, partial, self.engine.metrics()

  async def _run(self) -> None:
    while True:
      if not self._trackers:
        self._wake.clear()
        await self._wake.wait()
        continue
      finished, partial, metrics = await self._call(self._step)
      self.last_metrics = metrics
      ended = []
      for out in list(partial.values()) + finished:
        t = None if out is None else self._trackers.get(out.request_id)
        if t is not None:
          self._advance(t, out)
      for rid, t in list(self._trackers.items()):
        if t.done:
          del self._trackers[rid]
          ended.append(t)
          if t.cut_early:   # a stop string ended it before the engine did
            await self._call(self.engine.abort, rid)
      if self.on_step is not None:
        self.on_step(metrics, ended)

  def _advance(self, t: Tracker, out) -> None:
    """A RequestOutput (partial: finish reasons None) -> each sample's text deltas; stop
    strings cut the text and end the sample."""
    deltas: List[Delta] = []
    if out.prompt_logprobs is not None:
      t.prompt_scores = (out.prompt_logprobs, out.prompt_top_logprobs)
    lps = out.logprobs or [[]] * len(out.outputs)
    tops = out.top_logprobs or [[]] * len(out.outputs)
    for j, ids in enumerate(out.outputs):
      if j >= len(t.finish) or t.finish[j] is not None:
        continue
      if len(ids) > len(t.tokens[j]) and t.t_first is None:
        t.t_first = time.perf_counter()
      t.tokens[j], t.logprobs[j], t.top_logprobs[j] = list(ids), list(lps[j]), list(tops[j])
      finish = out.finish_reasons[j]
      d = t.decoded[j]
      text = d.update(t.tokens[j], whole=finish is not None)
      whole = finish is not None
      for s in t.request.stop:
        cut = text.find(s, max(0, len(t.texts[j]) - len(s) + 1))
        if cut >= 0:
          text, finish, whole = text[:cut], "stop", False
          t.cut_early = t.cut_early or out.finish_reasons[j] is None
      if finish is None:   # hold back what may still change: a stop string's start
        text = _held_back(text, t.request.stop)
      delta = text[len(t.texts[j]):]
      t.texts[j] = t.texts[j] + delta
      start = t.num_sent[j]
      t.num_sent[j] = len(ids) if whole else d.tokens_within(len(t.texts[j]))
      if delta or finish is not None:
        deltas.append((j, delta, finish, start, t.num_sent[j]))
      t.finish[j] = finish
    if deltas:
      t.events.put_nowait(deltas)
    if t.done:
      t.events.put_nowait(None)

  def _end(self, t: Tracker, deltas: List[Delta]) -> None:
    for j, _, f, _, _ in deltas:
      t.finish[j] = f
    if deltas:
      t.events.put_nowait(deltas)
    t.events.put_nowait(None)


def _held_back(text: str, stops: List[str]) -> str:
  """`text` less its longest tail that begins one of `stops` (it may yet become a stop
  string, which would be cut: text sent to a client cannot be taken back)."""
  keep = len(text)
  for s in stops:
    for k in range(min(len(s) - 1, len(text)), 0, -1):
      if text.endswith(s[:k]):
        keep = min(keep, len(text) - k)
        break
  return text[:keep]


class Detokenizer:
  """One sample's text, decoded incrementally: each update decodes only the ids since
  the last one plus the window before them (context for tokenizers whose pieces depend
  on their neighbour, e.g. SentencePiece's leading space), as vLLM's incremental
  detokenizer does, so a long output costs O(new ids) per step, not O(length).

  Attributes:
    text: the text of the ids read so far.
    ends: per read id, the length of `text` up to and including its piece.
  """

  def __init__(self, decode):
    self._decode = decode
    self._prefix, self._read = 0, 0     # ids[prefix:read]: the window already in `text`
    self.text, self.ends = "", []

  def update(self, ids: List[int], whole: bool = False) -> str:
    """`text` after reading `ids` (the whole output so far; only appended to). Ids whose
    text ends in a partial UTF-8 sequence wait for the next ones, unless `whole`."""
    if len(ids) > self._read:
      before = self._decode(ids[self._prefix:self._read])
      after = self._decode(ids[self._prefix:])
      if whole or not after.endswith("\ufffd"):
        base, end = len(self.text) - len(before), len(self.text) + len(after) - len(before)
        # Each new id's end: the window decoded up to it (a few ids: one decode step's).
        for m in range(self._read + 1, len(ids)):
          e = base + len(self._decode(ids[self._prefix:m]))
          self.ends.append(min(max(e, self.ends[-1] if self.ends else 0), end))
        self.ends.append(end)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(ids)
    return self.text

  def tokens_within(self, num_chars: int) -> int:
    """How many leading read ids have all their text within the first `num_chars`
    characters (those a cut text reports logprobs for)."""
    return bisect.bisect_right(self.ends, num_chars)
