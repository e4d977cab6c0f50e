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


class _Report:
  """A StepReport's fields by name (perf reads the engine's report duck-typed)."""

  def __init__(self, **kw):
    base = dict(ok=True, dispatches=1, bucket=None, prefill_chunks=(), decode_rows=(),
                decode_loop_rows=(), cow_copies=0, swapped_blocks=0, generated_tokens=0)
    self.__dict__.update({**base, **kw})


class _Bucket:
  tokens, rows = 1024, 16   # 1,024 tokens: compute-bound, so padding shows


def test_from_report_rows_sampling_padding_loops_and_failed_steps():
  # Two decode rows and two chunks, of which only one ends its prompt (3 tokens appended).
  rep = _Report(prefill_chunks=((32, 32), (16, 48)), decode_rows=((1, 100), (1, 7)),
                generated_tokens=3, cow_copies=2, swapped_blocks=5, bucket=_Bucket())
  s = perf.StepShape.from_report(rep, block_size=8)
  assert s.new_tokens == (1, 1, 32, 16) and s.context_lens == (100, 7, 32, 48)
  assert s.sampled_rows == 3 and s.decode_iterations == 1 and s.loop_rows is None
  assert (s.cow_blocks, s.swapped_blocks, s.block_size, s.bucket_tokens) == (2, 5, 8, 0)
  padded = perf.StepShape.from_report(rep, block_size=8, padding=True)
  assert (padded.bucket_tokens, padded.bucket_rows) == (1024, 16)
  dm = _dm()
  assert dm.step_seconds(padded) > dm.step_seconds(s)
  # Multi-step: 2 + 2 + 1 tokens in the loop, 2 in the first pass (every row sampled).
  loop = _Report(decode_rows=((1, 40), (1, 60)), decode_loop_rows=(2, 2, 1),
                 generated_tokens=7)
  s = perf.StepShape.from_report(loop, block_size=8)
  assert s.decode_iterations == 4 and s.loop_rows == (2, 2, 1) and s.sampled_rows is None
  by_hand = sum(dm.step_seconds(perf.StepShape.decode(c)) for c in
                ([40, 60], [51, 51], [52, 52], [53]))
  assert dm.step_seconds(s) == pytest.approx(by_hand, rel=1e-12)
  # A failed reservation ran nothing; its swap-out still costs PCIe time.
  failed = _Report(ok=False, prefill_chunks=((32, 32),), swapped_blocks=4)
  s = perf.StepShape.from_report(failed, block_size=16)
  assert s.num_rows == 0 and s.swapped_blocks == 4
  assert dm.breakdown(s)["total"] == dm.breakdown(s)["swap"] > 0
  clock = perf.ModelClock(dm, block_size=16)
  assert clock.virtual and not perf.ModelClock(dm, host_time=True).virtual
  assert clock.stepped(failed) == pytest.approx(dm.step_seconds(s))
  with pytest.raises(ValueError, match="block_size"):
    perf.ModelClock(dm, block_size=3)
