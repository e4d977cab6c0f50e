"""ModelClock: virtual serving time that advances by the device-time model's figure per step.

It implements the serving clocks' protocol (start(), now(), wait_until(t), stepped(...))
without importing the harness: waiting jumps ahead, and each engine step costs what
`DeviceTimeModel.step_seconds` says its work takes on the named GPU. Deterministic unless
`host_time=True`, which adds the host time measured between steps (the engine's scheduling
and bookkeeping on this machine) on top of the device time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

from paged_jax.perf.roofline import PARTS, DeviceTimeModel
from paged_jax.perf.step import StepShape


class ModelClock:
  """Virtual time from a DeviceTimeModel.

  Args:
    device_model: the deployment whose step times the clock charges.
    to_step: turns what `stepped` receives (e.g. the engine's per-step report) into a
      StepShape; None: `stepped` takes StepShapes only.
    host_time: also charge the wall time since the previous step (or wait) ended.
    timer: the wall clock `host_time` reads (seconds).
  """

  name = "model"

  def __init__(self, device_model: DeviceTimeModel, *,
               to_step: Optional[Callable[[Any], StepShape]] = None, host_time: bool = False,
               timer: Callable[[], float] = time.perf_counter):
    if not isinstance(device_model, DeviceTimeModel):
      raise TypeError(f"device_model must be a DeviceTimeModel, got "
                      f"{type(device_model).__name__}")
    self.device_model, self._to_step = device_model, to_step
    self.host_time, self._timer = bool(host_time), timer
    self._theta = device_model.theta
    self.start()

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
      step: the step's StepShape, or what `to_step` converts (the engine's report).
      host_s: host seconds to charge with host_time=True (None: measured since the
        previous step or wait ended).
      swapped_tokens: accepted for the older clocks' call; the swap cost comes from the
        step's own `swapped_blocks`.
    """
    del swapped_tokens
    if step is None:
      raise ValueError("ModelClock.stepped needs the step's work: a StepShape, or the "
                       "engine's step report with to_step=")
    if not isinstance(step, StepShape):
      if self._to_step is None:
        raise TypeError(f"ModelClock.stepped got a {type(step).__name__}; pass a StepShape "
                        f"or build the clock with to_step=")
      step = self._to_step(step)
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

  def totals(self) -> dict:
    """Steps charged and seconds by kind since start()."""
    return {"num_steps": self.num_steps, "device_s": self.device_s, "host_s": self.host_s,
            "by_part_s": dict(self.by_part)}

  def as_dict(self) -> dict:
    """The clock's settings and every constant of its device model."""
    return {"name": self.name, "host_time": self.host_time,
            "device_model": self.device_model.as_dict()}
