"""Serving engine: host scheduler + one jitted device step (see engine.py)."""

from paged_jax.engine.engine import Engine, RequestOutput, SamplingParams
from paged_jax.engine.scheduler import Scheduler

__all__ = ["Engine", "RequestOutput", "SamplingParams", "Scheduler"]
