"""Serving engine: host scheduler + one jitted device step (see engine.py).

    from paged_jax.engine import Engine, EngineOptions, SamplingParams
"""

from paged_jax.engine.buckets import Bucket, StepBuckets, reachable_buckets
from paged_jax.engine.compile import release_compiled, step_for_compile
from paged_jax.engine.engine import Engine
from paged_jax.engine.options import PREEMPTION_MODES, EngineOptions
from paged_jax.engine.params import MAX_STOP_IDS, RequestOutput, SamplingParams
from paged_jax.engine.report import StepReport
from paged_jax.engine.scheduler import Scheduler

__all__ = ["Bucket", "Engine", "EngineOptions", "MAX_STOP_IDS", "PREEMPTION_MODES",
           "RequestOutput", "SamplingParams", "Scheduler", "StepBuckets", "StepReport",
           "reachable_buckets", "release_compiled", "step_for_compile"]
