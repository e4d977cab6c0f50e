"""ModelClock: virtual time charged by the device-time model, deterministic by default."""

import pytest

from paged_jax import perf


def _dm():
  return perf.DeviceTimeModel.named("opt-13b", "a100-40gb")


STEPS = [perf.StepShape.prefill([300, 40]), perf.StepShape.decode([301, 41]),
         perf.StepShape.decode([302, 42], swapped_blocks=3),
         perf.StepShape.from_rows([(1, 303), (16, 16)], cow_blocks=1)]


class FakeTimer:
  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def test_time_advances_by_each_steps_model_seconds_and_waits_jump_ahead():
  dm, clock = _dm(), perf.ModelClock(_dm())
  expected = 0.0
  for step in STEPS:
    charged = clock.stepped(step)
    assert charged == pytest.approx(dm.step_seconds(step), rel=1e-12)
    expected += charged
    assert clock.now() == pytest.approx(expected, rel=1e-12)
  clock.wait_until(clock.now() + 5.0)
  assert clock.now() == pytest.approx(expected + 5.0)
  clock.wait_until(1e-9)                         # never goes back
  assert clock.now() == pytest.approx(expected + 5.0)
  totals = clock.totals()
  assert totals["num_steps"] == 4 and totals["host_s"] == 0.0
  assert totals["device_s"] == pytest.approx(expected)
  assert sum(totals["by_part_s"].values()) == pytest.approx(expected)
  assert totals["by_part_s"]["swap"] > 0 and totals["by_part_s"]["copy_on_write"] > 0
  clock.start()
  assert clock.now() == 0.0 and clock.totals()["num_steps"] == 0


def test_deterministic_across_clocks_and_independent_of_the_wall_clock():
  timer = FakeTimer()
  a, b = perf.ModelClock(_dm(), timer=timer), perf.ModelClock(_dm())
  for step in STEPS:
    timer.t += 3.0                               # wall time passes; not charged by default
    a.stepped(step)
    b.stepped(step)
  assert a.now() == b.now()


def test_host_time_adds_the_time_between_steps_but_not_waits():
  timer = FakeTimer()
  clock = perf.ModelClock(_dm(), host_time=True, timer=timer)
  timer.t += 0.25                                 # the engine's host work for step 1
  charged = clock.stepped(STEPS[0])
  assert charged == pytest.approx(_dm().step_seconds(STEPS[0]) + 0.25)
  timer.t += 7.0                                  # a wait: the loop slept until an arrival
  clock.wait_until(clock.now() + 1.0)
  timer.t += 0.5
  clock.stepped(STEPS[1], host_s=0.125)           # an explicit figure wins
  assert clock.totals()["host_s"] == pytest.approx(0.375)


def test_to_step_adapts_the_engines_report_and_bad_calls_fail_in_one_line():
  report = {"rows": [(1, 50), (1, 60)]}
  clock = perf.ModelClock(_dm(), to_step=lambda r: perf.StepShape.from_rows(r["rows"]))
  assert clock.stepped(report) == pytest.approx(
      _dm().step_seconds(perf.StepShape.decode([50, 60])))
  with pytest.raises(ValueError, match="needs the step's work"):
    clock.stepped()
  with pytest.raises(TypeError, match="to_step"):
    perf.ModelClock(_dm()).stepped(report)
  with pytest.raises(ValueError, match="finite"):
    clock.wait_until(float("nan"))
  with pytest.raises(TypeError, match="DeviceTimeModel"):
    perf.ModelClock("opt-13b")
  assert clock.as_dict()["device_model"]["model"]["name"] == "opt-13b"
