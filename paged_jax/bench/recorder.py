"""What a serve loop drives (`EngineLike`) and records (`LoopRecorder`), step by step.

    rec = LoopRecorder(engine, clocks.WallClock(), progress=bar)   # counters read, clock at 0
    while engine.has_unfinished():
      for out in rec.step():          # one engine step; clock advanced; tokens timestamped
        ...
    totals = rec.close()              # the run's counters (engine deltas), then flush

Both loops of `paged_jax.bench.serving` (all requests at t = 0, and arrivals into a running
engine) keep their books here, so a step is timed, counted and timestamped one way.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Protocol, Tuple, runtime_checkable

from paged_jax.bench.clocks import Clock, StepSample


@runtime_checkable
class EngineLike(Protocol):
  """The engine surface the serve loops use: `paged_jax.engine.Engine`'s (tests script a
  stand-in with the same attributes).

  Attributes:
    cache_config: its `CacheConfig` (`block_size` prices swapped blocks in tokens).
    stats: counters since the engine was made; the loops read "steps",
      "generated_tokens", "device_steps", "computed_tokens", "bucket_tokens" and
      "swapped_blocks" (blocks copied out or in), a missing one counting 0.
    timing: wall seconds since the engine was made: "step_s" (inside `step()`) and
      "device_s" (its jitted calls until their outputs were on the host).
    num_preemptions: preemptions so far; num_swaps: those done by swapping.
    last_step: what the last `step()` did (`paged_jax.engine.report.StepReport`): the
      loops read `first_token_ids`, `num_running_groups`, `num_running_seqs` and
      `swapped_blocks`; a clock may read the rest (the step's work).
  """
  cache_config: Any
  stats: Mapping[str, int]
  timing: Mapping[str, float]
  num_preemptions: int
  num_swaps: int
  last_step: Any

  def add_request(self, prompt, params=None, request_id=None) -> Any:
    """Queues a request; returns its id."""

  def step(self) -> List[Any]:
    """One step; the outputs (with `request_id`) that finished since the last call."""

  def has_unfinished(self) -> bool:
    """Requests queued or running, or outputs not yet returned."""

  def flush(self) -> None:
    """Applies pending frees now."""


COUNTERS = ("steps", "generated_tokens", "device_steps", "computed_tokens", "bucket_tokens",
            "swapped_blocks")


def _traces() -> int:
  from paged_jax.engine import step as step_lib  # pylint: disable=g-import-not-at-top
  return sum(step_lib.TRACE_COUNT.values())


class LoopRecorder:
  """Steps an engine on a clock and keeps a serve loop's books (module docstring).

  Attributes:
    engine, clock: what it drives and times on.
    first_token: {request_id: time of the step after which its first token was out}.
    finish: {request_id: time of the step that returned its output}.
    loop_steps: engine steps run through `step()`.
  """

  def __init__(self, engine: EngineLike, clock: Clock, progress=None):
    if not isinstance(engine, EngineLike):
      raise TypeError(f"engine must have EngineLike's surface, got {type(engine).__name__}")
    if not isinstance(clock, Clock):
      raise TypeError(f"clock must follow the Clock protocol, got {type(clock).__name__}")
    self.engine, self.clock, self._progress = engine, clock, progress
    self._base = self._counters()
    self.first_token: Dict[Any, float] = {}
    self.finish: Dict[Any, float] = {}
    self.loop_steps = 0
    self._running = [0, 0]   # sum over steps, max: requests
    self._seqs = [0, 0]      # ... sequences
    clock.start()

  def _counters(self) -> Dict[str, float]:
    e = self.engine
    out = {k: e.stats.get(k, 0) for k in COUNTERS}
    out.update(step_s=e.timing.get("step_s", 0.0), device_s=e.timing.get("device_s", 0.0),
               preemptions=e.num_preemptions, swaps=e.num_swaps, traces=_traces())
    return out

  def step(self) -> List[Any]:
    """One engine step: advances the clock by it, timestamps first tokens and finished
    outputs at the clock's time after it; returns the finished outputs."""
    done = self.engine.step()
    report = self.engine.last_step
    swapped = report.swapped_blocks * self.engine.cache_config.block_size   # out and in
    self.clock.stepped(StepSample(swapped, report=report))
    t = self.clock.now()
    self.loop_steps += 1
    for acc, n in ((self._running, report.num_running_groups),
                   (self._seqs, report.num_running_seqs)):
      acc[0] += n
      acc[1] = max(acc[1], n)
    for rid in report.first_token_ids:
      self.first_token.setdefault(rid, t)
    for out in done:
      self.first_token.setdefault(out.request_id, t)   # finished in its first token's step
      self.finish[out.request_id] = t
    if self._progress is not None and done:
      self._progress.update(len(done))
    return done

  def close(self) -> Dict[str, Any]:
    """The run's totals (read before the engine's pending frees are flushed, then flushed):
    {"seconds" (clock time), "loop_steps", each of COUNTERS (engine deltas; "steps"
    counts device steps that ran, "loop_steps" calls), "preemptions", "swaps",
    "step_traces_in_run" (step traces inside the run: 0 after a complete warm-up),
    "engine_step_s" / "device_s" (wall s inside engine.step / its jitted calls),
    "mean_running" / "max_running" (requests), "mean_running_seqs" / "max_running_seqs"}."""
    now, end = self.clock.now(), self._counters()
    d = {k: end[k] - self._base[k] for k in end}
    self.engine.flush()
    steps = max(self.loop_steps, 1)
    return {"seconds": now, "loop_steps": self.loop_steps,
            **{k: int(d[k]) for k in COUNTERS}, "preemptions": int(d["preemptions"]),
            "swaps": int(d["swaps"]), "step_traces_in_run": int(d["traces"]),
            "engine_step_s": d["step_s"], "device_s": d["device_s"],
            "mean_running": self._running[0] / steps, "max_running": int(self._running[1]),
            "mean_running_seqs": self._seqs[0] / steps, "max_running_seqs": int(self._seqs[1])}

  def timestamps(self, request_ids) -> Tuple[List[float], List[float]]:
    """(first_token, finish) times of `request_ids`, in order; RuntimeError naming how many
    never finished."""
    missing = [i for i in request_ids if i not in self.finish]
    if missing:
      raise RuntimeError(f"{len(missing)} requests never finished")
    return ([self.first_token.get(i, math.nan) for i in request_ids],
            [self.finish[i] for i in request_ids])

