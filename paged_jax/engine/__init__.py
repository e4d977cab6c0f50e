"""Serving engine: host scheduler + one jitted device step (see engine.py).

    from paged_jax.engine import Engine, SamplingParams
"""

from paged_jax.engine.compiled import step_for_compile
from paged_jax.engine.engine import Engine
from paged_jax.engine.params import MAX_STOP_IDS, RequestOutput, SamplingParams
from paged_jax.engine.scheduler import Scheduler

__all__ = ["Engine", "MAX_STOP_IDS", "RequestOutput", "SamplingParams", "Scheduler",
           "step_for_compile"]
