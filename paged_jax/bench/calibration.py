"""The device-time model fitted to this machine: measured engine steps of the tiny model.

    samples = calibration.measure_steps(lambda: engines.make_engine(block_size=16,
                                                                    kv_budget_tokens=2048))
    fit = calibration.fit_cpu(engines.tiny_model()[0], samples)
    fit.model.step_seconds(shape)        # this CPU's seconds for a step of that shape

The same `perf.DeviceTimeModel` that prices a GPU step prices a CPU one when given the
CPU's nominal peaks (`CPU`: round figures, not measurements) and efficiencies fitted to
measured steps: wall seconds of `Engine.step()` against the work its `StepReport` says
it did, padding included (`StepShape.from_report(padding=True)`: a CPU step costs its
shape bucket's tokens). Three ways to measure: `measure_steps` (batches stepped in a tight
loop), `RecordingWallClock` (the steps of a wall-clock serve loop, each charged what the
loop paid between step ends: what a serving sweep on this machine pays) and
`RecordingCpuClock` (the same span in this process's CPU seconds: what a sweep on
`clocks.CpuClock` pays, and what other tenants of the machine barely move).
`perf_validation` predicts a wall-clock serving sweep from the fit and runs it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from paged_jax import perf
from paged_jax.bench.clocks import CpuClock, StepSample, WallClock

# Nominal peaks of a 2-core x86 machine (assumed round figures: one AVX2 core does ~50
# GFLOP/s f32 peak, a laptop-class memory system ~20 GB/s). The fit scales each by an
# efficiency, so only their ratio to the measured times matters.
CPU = perf.GpuSpec(name="cpu", hbm_bytes=24 << 30, hbm_bandwidth=20e9, tensor_flops=100e9,
                   nvlink_bandwidth=10e9, pcie_bandwidth=10e9,
                   source="nominal: 2 cores x ~50 GFLOP/s f32 (AVX2 FMA), ~20 GB/s DRAM; "
                   "efficiencies fitted to measured engine steps")

# (requests, prompt tokens, output tokens) of the calibration batches: one request to
# dozens, short and long prompts, so the steps span decode batches of 1-48 rows at
# contexts 16-250 and prefill chunks of 16-256 tokens.
BATCHES = ((1, 200, 24), (2, 24, 40), (4, 120, 24), (8, 40, 32), (16, 90, 24), (24, 16, 48),
           (32, 60, 16), (48, 24, 24))

Sample = Tuple[perf.StepShape, float]


def measure_steps(make_engine: Callable, batches: Sequence[Tuple[int, int, int]] = BATCHES, *,
                  seed: int = 0, progress=None) -> List[Sample]:
  """(StepShape with padding, wall seconds of `Engine.step()`) of every step of each batch.

  Each batch (all requests at t = 0, greedy, run to their output length) first runs
  untimed on a twin of the engine (`fresh_copy`: the same compiled step), so every shape
  the timed run meets is compiled before it."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng([seed, 5])
  samples: List[Sample] = []
  for n, prompt_len, out_len in batches:
    engine = make_engine()
    prompts = [rng.integers(0, 256, prompt_len).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0)
    engine.fresh_copy().generate(prompts, params)
    for p in prompts:
      engine.add_request(p, params)
    bs = engine.cache_config.block_size
    while engine.has_unfinished():
      t0 = time.perf_counter()
      engine.step()
      dt = time.perf_counter() - t0
      report = engine.last_step
      if report.dispatches == 1 and report.ok:
        samples.append((perf.StepShape.from_report(report, block_size=bs, padding=True), dt))
    engine.flush()
    if progress is not None:
      progress.update(1)
  return samples


class RecordingWallClock(WallClock):
  """The wall clock of a serve loop that also records each step's cost as the loop paid it:
  (StepShape with padding, seconds from the end of the previous step or wait to the end
  of this step: the engine step plus the loop's own work), and how late each wait woke."""

  def __init__(self, block_size: int):
    self.block_size = block_size
    self.samples: List[Sample] = []
    self.wake_late_s: List[float] = []
    super().__init__()

  def start(self) -> None:
    super().start()
    self._mark = time.perf_counter()

  def stepped(self, step: StepSample) -> None:
    now = time.perf_counter()
    report = step.report
    if report is not None and report.dispatches == 1 and report.ok:
      shape = perf.StepShape.from_report(report, block_size=self.block_size, padding=True)
      self.samples.append((shape, now - self._mark))
    self._mark = now

  def wait_until(self, t: float) -> None:
    super().wait_until(t)
    self.wake_late_s.append(max(0.0, self.now() - t))
    self._mark = time.perf_counter()


class RecordingCpuClock(CpuClock):
  """`clocks.CpuClock` that also records each step as (StepShape with padding, CPU seconds
  from the end of the previous step or wait to the end of this step), as
  `RecordingWallClock` does on the wall clock."""

  def __init__(self, block_size: int):
    self.block_size = block_size
    self.samples: List[Sample] = []
    self.wake_late_s: List[float] = []   # waits are jumps on this clock: never late
    super().__init__()

  def stepped(self, step: StepSample) -> None:
    super().stepped(step)
    report = step.report
    if report is not None and report.dispatches == 1 and report.ok:
      shape = perf.StepShape.from_report(report, block_size=self.block_size, padding=True)
      self.samples.append((shape, self.cpu_s[-1]))


class WallClockWithCpu(WallClock):
  """The wall clock, keeping each step's wall and CPU seconds (`wall_s`, `cpu_s`) as
  `clocks.CpuClock` does."""

  def start(self) -> None:
    super().start()
    self._both = CpuClock()

  @property
  def wall_s(self) -> List[float]:
    return self._both.wall_s

  @property
  def cpu_s(self) -> List[float]:
    return self._both.cpu_s

  def stepped(self, step: StepSample) -> None:
    self._both.stepped(step)

  def wait_until(self, t: float) -> None:
    super().wait_until(t)
    self._both.wait_until(0.0)   # restarts the step span


TRUTHS = ("cpu", "wall")


def _check_truth(truth: str) -> None:
  if truth not in TRUTHS:
    raise ValueError(f"truth must be one of {TRUTHS}, got {truth!r}")


def truth_clock(truth: str):
  """A fresh clock of a measured serving run keeping wall_s / cpu_s per step: "cpu"
  (`clocks.CpuClock`) or "wall" (`WallClockWithCpu`)."""
  _check_truth(truth)
  return CpuClock() if truth == "cpu" else WallClockWithCpu()


def recording_clock(truth: str, block_size: int):
  """A fresh calibration clock on that truth, recording (shape, seconds) per step."""
  _check_truth(truth)
  return (RecordingCpuClock if truth == "cpu" else RecordingWallClock)(block_size)


def _groups(samples: Sequence[Sample], context_quantum: int) -> List[List[Sample]]:
  """Samples by like steps (same padded tokens, rows and real tokens, total context within
  `context_quantum`), in order of first appearance."""
  groups: Dict[tuple, List[Sample]] = {}
  for shape, sec in samples:
    key = (shape.bucket_tokens, shape.num_rows, shape.num_tokens,
           sum(shape.context_lens) // context_quantum)
    groups.setdefault(key, []).append((shape, sec))
  return list(groups.values())


def grouped(samples: Sequence[Sample], context_quantum: int = 256, stat: str = "median"
            ) -> List[Sample]:
  """One (shape, seconds) per group of like steps: same padded tokens, rows and real
  tokens, total context within `context_quantum`; seconds the group's median (resists a
  loaded machine's outliers) or mean (what a run of such steps pays, outliers included)."""
  if stat not in ("median", "mean"):
    raise ValueError(f"stat must be 'median' or 'mean', got {stat!r}")
  out = []
  for members in _groups(samples, context_quantum):
    times = [s for _, s in members]
    med = statistics.median(times)
    value = med if stat == "median" else statistics.fmean(times)
    out.append((min(members, key=lambda m: abs(m[1] - med))[0], value))
  return out


def group_sizes(samples: Sequence[Sample], context_quantum: int = 256) -> List[int]:
  """Steps in each of `grouped`'s groups, in its order."""
  return [len(m) for m in _groups(samples, context_quantum)]


def samples_as_dicts(samples: Sequence[Sample]) -> List[dict]:
  """JSON-ready samples: [{"shape": StepShape fields, "seconds": s}, ...]."""
  return [{"shape": shape.as_dict(), "seconds": float(sec)} for shape, sec in samples]


def samples_from_dicts(rows: Sequence[dict]) -> List[Sample]:
  """Inverse of samples_as_dicts."""
  return [(perf.StepShape(**row["shape"]), float(row["seconds"])) for row in rows]


def bucketed_step(buckets, block_size: int) -> Callable:
  """A ModelClock `to_step` for an engine run WITHOUT shape buckets that charges each
  step the padded shape the bucketed engine (`buckets`, its `StepBuckets`) would have
  run: the same `StepBuckets.pick` over the same rows, tokens and longest row (greedy
  requests, n = 1: a step's rows are its chunks). A stand-in engine with one compiled
  shape then prices steps as the tiny model's bucketed engine pays them."""

  def to_step(report) -> perf.StepShape:
    shape = perf.StepShape.from_report(report, block_size=block_size, padding=False)
    ran = bool(getattr(report, "ok", True)) and getattr(report, "dispatches", 1) > 0
    if getattr(report, "bucket", None) is None or not ran:
      return shape
    new, ctx = shape.new_tokens, shape.context_lens   # no rows: a frees-only step
    b = buckets.pick(shape.num_tokens, shape.num_rows, max(ctx, default=0),
                     all(n == 1 for n in new))
    return dataclasses.replace(shape, bucket_tokens=b.tokens, bucket_rows=b.rows)
  return to_step


def cpu_model(model_config) -> perf.DeviceTimeModel:
  """The tiny model on `CPU` with the catalog's default efficiencies (the fit's start)."""
  spec = perf.ModelSpec.from_model_config(model_config, name="tiny-byte-llama")
  return perf.DeviceTimeModel(model=spec, gpu=CPU)


def load_factor(model: perf.DeviceTimeModel, samples: Sequence[Sample]) -> float:
  """Measured over predicted seconds, summed over `samples` (steps measured close in time):
  how much slower than the fit the machine ran then (a loaded machine's share of the CPU
  moves by minutes). 1.0 without samples."""
  if not samples:
    return 1.0
  predicted = sum(model.step_seconds(shape) for shape, _ in samples)
  return sum(sec for _, sec in samples) / predicted if predicted > 0 else 1.0


def median_load_factor(model: perf.DeviceTimeModel, runs: Sequence[Sequence[Sample]]
                       ) -> float:
  """The median over `runs` (each a serving run's steps) of each run's `load_factor`:
  the machine's speed as its typical run saw it. Pooling the steps lets one run the
  machine was taken from set the speed of all (perf_validation one_thread_3: one of six
  paged runs at 28 ms a step against 3-4 ms moved the pooled factor to 1.74; the median
  of the runs' factors stays with the other five). 1.0 without runs."""
  factors = [load_factor(model, r) for r in runs if r]
  return float(np.median(factors)) if factors else 1.0


def scaled(model: perf.DeviceTimeModel, factor: float) -> perf.DeviceTimeModel:
  """`model` with every step `factor` x as long (the time is homogeneous in theta: each
  1 / efficiency and each latency scaled by `factor`)."""
  from paged_jax.perf import roofline  # pylint: disable=g-import-not-at-top
  if not (factor > 0 and np.isfinite(factor)):
    raise ValueError(f"factor must be a finite number > 0, got {factor}")
  eff = roofline.efficiency_of(model.theta * factor,
                               f"{model.efficiency.source}, x {factor:.3f} (load)")
  return model.replace(efficiency=eff)


WEIGHINGS = ("steps", "groups")


def fit_cpu(model_config, samples: Sequence[Sample], stat: str = "median",
            weigh: str = "steps") -> perf.FitResult:
  """The device-time model fitted to `samples` grouped (`grouped`, by `stat`).

  weigh: "steps" (each group's relative error weighs as many steps as it holds: the fit
  minimises every recorded step's error, the grouping only compresses) or "groups" (each
  group once, the rule before: a shape seen in 2 steps weighs as much as one seen in
  2,000). Measured on perf_validation's committed calibration (23,653 steps, 710 groups):
  weighed by groups, the fitted step is 5% dear at 0-3 rows and 10% cheap at 16-19 rows
  against the same run's steps; by steps, 1% dear and 3% cheap.
  """
  if weigh not in WEIGHINGS:
    raise ValueError(f"weigh must be one of {WEIGHINGS}, got {weigh!r}")
  steps = grouped(samples, stat=stat)
  weights = group_sizes(samples) if weigh == "steps" else None
  return perf.fit_efficiency(cpu_model(model_config), [s for s, _ in steps],
                             [t for _, t in steps], weights=weights)

