"""bench.clocks.CpuClock and bench.calibration.RecordingCpuClock: a step costs this
process's CPU seconds since the last step or wait (a sleep costs none), waits jump ahead,
and the recording clock keeps (shape, CPU seconds) of the steps that ran."""

from __future__ import annotations

import time
import types

from paged_jax.bench import calibration
from paged_jax.bench import clocks
from paged_jax.bench.clocks import StepSample


def _burn(cpu_s: float) -> None:
  """Spins until this process has spent `cpu_s` more CPU seconds."""
  end = time.process_time() + cpu_s
  x = 0
  while time.process_time() < end:
    x += 1


def _report(ok=True):
  """What RecordingCpuClock reads of a StepReport: one 8-token prefill chunk, one decode
  row at context 20."""
  return types.SimpleNamespace(ok=ok, dispatches=1, bucket=None, prefill_chunks=((8, 8),),
                               decode_rows=((1, 20),), decode_loop_rows=(), cow_copies=0,
                               swapped_blocks=0, generated_tokens=2)


def test_cpu_clock_charges_cpu_seconds_not_sleeps():
  clock = clocks.CpuClock()
  assert isinstance(clock, clocks.Clock) and clock.name == "cpu" and not clock.virtual
  assert clock.now() == 0.0
  _burn(0.03)
  before = time.process_time()
  clock.stepped(StepSample())
  busy = clock.now()
  assert busy >= 0.03 and clock.cpu_s == [busy]
  assert busy <= 0.03 + (time.process_time() - before) + 0.05   # the burn, and no more
  time.sleep(0.06)                   # wall time passes, CPU time barely
  clock.stepped(StepSample())
  assert clock.wall_s[1] >= 0.06 and clock.cpu_s[1] < 0.03
  assert clock.now() == busy + clock.cpu_s[1]   # time moves only in stepped / wait_until
  _burn(0.02)
  assert clock.now() == busy + clock.cpu_s[1]


def test_cpu_clock_waits_jump_ahead_and_restart_the_step_span():
  clock = clocks.CpuClock()
  _burn(0.03)
  clock.wait_until(5.0)              # CPU spent before a wait is idle time, not a step's
  assert clock.now() == 5.0
  clock.wait_until(1.0)              # the past: no-op
  assert clock.now() == 5.0
  clock.stepped(StepSample())
  assert clock.cpu_s[-1] < 0.03 and clock.now() == 5.0 + clock.cpu_s[-1]
  clock.start()
  assert clock.now() == 0.0


def test_recording_cpu_clock_keeps_the_steps_that_ran():
  clock = calibration.RecordingCpuClock(16)
  _burn(0.02)
  clock.stepped(StepSample(0, report=_report()))
  clock.stepped(StepSample(0, report=_report(ok=False)))   # ran nothing: not a sample
  clock.stepped(StepSample(0, report=None))
  assert len(clock.samples) == 1 and len(clock.cpu_s) == 3
  shape, sec = clock.samples[0]
  assert sec == clock.cpu_s[0] >= 0.02
  assert shape.new_tokens == (1, 8) and shape.block_size == 16
