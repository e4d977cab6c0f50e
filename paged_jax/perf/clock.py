"""ModelClock: virtual serving time that advances by the device-time model's figure per step.

It implements the serving clocks' protocol (`paged_jax.bench`'s Clock: name, virtual,
start(), now(), wait_until(t), stepped(sample)) without importing the harness: waiting
jumps ahead, and each engine step costs what `DeviceTimeModel.step_seconds` says its work
takes on the named GPU. `stepped` takes the loop's step sample (its `.report`), the
engine's StepReport itself (`Engine.last_step`), or a StepShape. Deterministic unless
`host_time=True`, which adds the host time measured between steps (the engine's scheduling
and bookkeeping on this machine) on top of the device time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

from paged_jax import config as pj_config
from paged_jax.perf.roofline import PARTS, DeviceTimeModel
from paged_jax.perf.step import StepShape


class ModelClock:
  """Virtual time from a DeviceTimeModel.

  Args:
    device_model: the deployment whose step times the clock charges.
    block_size: the engine's tokens per KV block (sizes a report's copies and swaps).
    padding: charge a report's padded shape bucket (StepShape.from_report).
    to_step: turns what `stepped` receives into a StepShape, instead of
      StepShape.from_report (for other engines' reports).
    host_time: also charge the wall time since the previous step (or wait) ended.
    timer: the wall clock `host_time` reads (seconds).
  """

  name = "model"

  def __init__(self, device_model: DeviceTimeModel, *, block_size: int = 16,
               padding: bool = False,
               to_step: Optional[Callable[[Any], StepShape]] = None, host_time: bool = False,
               timer: Callable[[], float] = time.perf_counter):
    if not isinstance(device_model, DeviceTimeModel):
      raise TypeError(f"device_model must be a DeviceTimeModel, got "
                      f"{type(device_model).__name__}")
    pj_config.check_block_size(block_size)
    self.device_model, self._to_step = device_model, to_step
    self.block_size, self.padding = block_size, bool(padding)
    self.host_time, self._timer = bool(host_time), timer
    self._theta = device_model.theta
    self.start()

  @property
  def virtual(self) -> bool:
    """Time moves only by the model's figures (no wall-clock reads) unless host_time."""
    return not self.host_time

  def start(self) -> None:
    """Time 0 is now; the totals restart."""
    self._t = 0.0
    self.num_steps = 0
    self.device_s = 0.0
    self.host_s = 0.0
    self.by_part = dict.fromkeys(PARTS, 0.0)
    self._mark = self._timer()

  def now(self) -> float:
    return self._t

  def wait_until(self, t: float) -> None:
    """Jumps ahead to `t` (an arrival); never goes back."""
    if not math.isfinite(t):
      raise ValueError(f"wait_until needs a finite time, got {t}")
    self._t = max(self._t, float(t))
    self._mark = self._timer()

  def stepped(self, step: Any = None, *, host_s: Optional[float] = None,
              swapped_tokens: int = 0) -> float:
    """Charges one engine step; returns the seconds charged.

    Args:
      step: the step's StepShape; the engine's StepReport; or the serve loop's step
        sample holding it as `.report`.
      host_s: host seconds to charge with host_time=True (None: measured since the
        previous step or wait ended).
      swapped_tokens: accepted for the older clocks' call; the swap cost comes from the
        step's own `swapped_blocks`.
    """
    del swapped_tokens
    step = self.shape_of(step)
    parts = self.device_model.work(step).by_part(self._theta)
    device = float(sum(parts.values()))
    host = 0.0
    if self.host_time:
      host = float(host_s) if host_s is not None else self._timer() - self._mark
      if not (math.isfinite(host) and host >= 0):
        raise ValueError(f"host_s must be a finite number >= 0, got {host}")
    for part, seconds in parts.items():
      self.by_part[part] += seconds
    self.num_steps += 1
    self.device_s += device
    self.host_s += host
    self._t += device + host
    self._mark = self._timer()
    return device + host

  def shape_of(self, step: Any) -> StepShape:
    """The StepShape `stepped` charges for `step` (see there); one-line errors."""
    if step is not None and not isinstance(step, StepShape) and hasattr(step, "report") \
        and not hasattr(step, "prefill_chunks"):
      step = step.report          # the loop's step sample
      if step is None:
        raise ValueError("ModelClock needs the engine's step report: the step sample's "
                         "report is None (an engine without Engine.last_step)")
    if step is None:
      raise ValueError("ModelClock.stepped needs the step's work: a StepShape, the "
                       "engine's StepReport, or a step sample holding it")
    if isinstance(step, StepShape):
      return step
    if self._to_step is not None:
      return self._to_step(step)
    if not hasattr(step, "prefill_chunks"):
      raise TypeError(f"ModelClock.stepped got a {type(step).__name__}; pass a StepShape, "
                      f"a StepReport, or build the clock with to_step=")
    return StepShape.from_report(step, block_size=self.block_size, padding=self.padding)

  def totals(self) -> dict:
    """Steps charged and seconds by kind since start()."""
    return {"num_steps": self.num_steps, "device_s": self.device_s, "host_s": self.host_s,
            "by_part_s": dict(self.by_part)}

  def as_dict(self) -> dict:
    """The clock's settings and every constant of its device model."""
    return {"name": self.name, "host_time": self.host_time, "block_size": self.block_size,
            "padding": self.padding, "device_model": self.device_model.as_dict()}
