"""The clocks a serve loop runs on: what one engine step costs in (real or virtual) seconds.

    clock = clocks.WallClock()              # real time: perf_counter, waiting sleeps
    clock = clocks.StepClock(0.01)          # virtual: 10 ms per step whatever it holds
    clock = clocks.CpuClock()               # this process's CPU seconds per step
    clock.start(); ...; clock.stepped(clocks.StepSample(swapped_tokens=32)); clock.now()

Every clock follows the `Clock` protocol, so a loop (`paged_jax.bench.serving`) never asks
which one it has. A clock whose time advances by a device-time model's figure per step is
one more class beside these two: it reads what the step did from `StepSample.report`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class StepSample:
  """What one engine step did, as far as a clock needs it.

  Attributes:
    swapped_tokens: tokens of K/V the step copied out to or in from host memory (whole
      blocks times block_size).
    report: the engine's own report of the step (`Engine.last_step` where the engine has
      one, else None): a clock that prices a step by its work reads it from here.
  """
  swapped_tokens: int = 0
  report: Any = None


@runtime_checkable
class Clock(Protocol):
  """Seconds since `start()` on one time line: real, or virtual (advanced by the loop).

  Attributes:
    name: short name recorded in results ("wall", "step", ...).
    virtual: True when time moves only through `stepped` / `wait_until` (no wall-clock
      reads): such a clock does not see compile time, so a loop need not warm up first.
  """
  name: str
  virtual: bool

  def start(self) -> None:
    """Time 0 is now (called when serving starts, after the engine compiled)."""

  def now(self) -> float:
    """Seconds since `start()`."""

  def stepped(self, step: StepSample) -> None:
    """Called after every engine step, with what the step did."""

  def wait_until(self, t: float) -> None:
    """Idles until time `t` (the next arrival); no-op if `t` has passed."""


class WallClock:
  """Real time since `start()` (s); waiting sleeps; a step costs what it took."""

  name = "wall"
  virtual = False

  def __init__(self):
    self.start()

  def start(self) -> None:
    self._t0 = time.perf_counter()

  def now(self) -> float:
    return time.perf_counter() - self._t0

  def stepped(self, step: StepSample) -> None:
    del step   # real time moved by itself, copies included

  def wait_until(self, t: float) -> None:
    time.sleep(max(0.0, t - self.now()))


# Swap traffic on the step clock, per token moved one way: the paper's OPT-13B holds
# 800 KB of K/V per token (arXiv:2309.06180 sec. 3), over PCIe 4.0 x16 at ~25 GB/s
# achieved (32 GB/s peak) between an A100 and pinned host memory.
OPT13B_SWAP_S_PER_TOKEN = 800e3 / 25e9


class StepClock:
  """Virtual time: every engine step costs `step_s` seconds whatever its batch (the
  memory-bound GPU regime, where a decode step's time barely grows with the batch),
  plus `swap_s_per_token` per token of K/V the step swapped out or in; waiting jumps
  ahead. Deterministic: no wall-clock reads."""

  name = "step"
  virtual = True

  def __init__(self, step_s: float, swap_s_per_token: float = OPT13B_SWAP_S_PER_TOKEN):
    if not (math.isfinite(step_s) and step_s > 0):
      raise ValueError(f"step_s must be a finite number > 0, got {step_s}")
    if not (math.isfinite(swap_s_per_token) and swap_s_per_token >= 0):
      raise ValueError(f"swap_s_per_token must be a finite number >= 0, got {swap_s_per_token}")
    self.step_s, self.swap_s_per_token, self._t = step_s, swap_s_per_token, 0.0

  def start(self) -> None:
    self._t = 0.0

  def now(self) -> float:
    return self._t

  def stepped(self, step: StepSample) -> None:
    self._t += self.step_s + step.swapped_tokens * self.swap_s_per_token

  def wait_until(self, t: float) -> None:
    self._t = max(self._t, t)


class CpuClock:
  """Time that advances by the CPU seconds THIS process spent (`time.process_time`: every
  thread of it, XLA's included) from the end of the previous step or wait to the end of
  each step; waiting jumps ahead, as on the step clock.

  Other tenants of a shared machine take wall time from a step (the process waits for a
  core) but little of its CPU time, so a run on this clock repeats where a wall-clock run
  does not. On a machine to itself it reads what the wall clock reads for a process that
  keeps one core busy per thread it runs; it reads MORE than the wall clock where a step
  runs threads in parallel (two cores busy: twice its wall seconds) and LESS where the
  process waits on something else (sleeps, I/O). `experiments.perf_validation` measures
  the ratio on this machine. It is not virtual: it sees compile time, so a loop warms up
  first. `wall_s` / `cpu_s` keep both clocks' seconds of every step.

  Attributes:
    wall_s: wall seconds of each step (same span as its CPU seconds).
    cpu_s: CPU seconds of each step.
  """

  name = "cpu"
  virtual = False

  def __init__(self):
    self.wall_s: list = []
    self.cpu_s: list = []
    self.start()

  def start(self) -> None:
    self._t = 0.0
    self._mark()

  def _mark(self) -> None:
    self._cpu0, self._wall0 = time.process_time(), time.perf_counter()

  def now(self) -> float:
    return self._t

  def stepped(self, step: StepSample) -> None:
    cpu, wall = time.process_time() - self._cpu0, time.perf_counter() - self._wall0
    self._t += cpu
    self.cpu_s.append(cpu)
    self.wall_s.append(wall)
    self._mark()

  def wait_until(self, t: float) -> None:
    self._t = max(self._t, t)
    self._mark()
