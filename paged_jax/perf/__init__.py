"""paged_jax.perf: how long one engine step takes on a named GPU, without the GPU.

    from paged_jax import perf
    dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
    dm.step_seconds(perf.StepShape.decode([512] * 32))      # seconds of one decode step
    dm.kv_budget().kv_slots                                   # 15.8K: the paper's Table 1 15.7K
    perf.fit_efficiency(dm, steps, measured_s).model          # efficiencies fitted to a device
    clock = perf.ModelClock(dm, block_size=16)                # a serve loop's clock:
    clock.stepped(engine.last_step)                           # charges the engine's report

Modules: specs (GpuSpec, ModelSpec, Efficiency), catalog (every named GPU, model and
constant with its source), step (StepShape, and StepShape.from_report: the engine's
StepReport read by attribute name), roofline (DeviceTimeModel), budget (KvBudget),
fit (fit_efficiency), clock (ModelClock). Imports only paged_jax.config, numpy and the
standard library.
"""

from paged_jax.perf.budget import KvBudget, kv_budget
from paged_jax.perf.catalog import DEFAULT_EFFICIENCY, GPUS, MODELS, gpu_spec, model_spec
from paged_jax.perf.clock import ModelClock
from paged_jax.perf.fit import FitResult, fit_efficiency, predict, relative_errors
from paged_jax.perf.roofline import PARAMS, PARTS, DeviceTimeModel
from paged_jax.perf.specs import Efficiency, GpuSpec, ModelSpec
from paged_jax.perf.step import StepShape

__all__ = [
    "DEFAULT_EFFICIENCY", "DeviceTimeModel", "Efficiency", "FitResult", "GPUS", "GpuSpec",
    "KvBudget", "MODELS", "ModelClock", "ModelSpec", "PARAMS", "PARTS", "StepShape",
    "fit_efficiency", "gpu_spec", "kv_budget", "model_spec", "predict", "relative_errors",
]
