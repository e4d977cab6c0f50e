"""Compatibility shim: the serving harness moved to `paged_jax.serving` (library code).

Experiments import it as `from paged_jax import serving`; this module re-exports the
names older scripts and notebooks used.
"""

from paged_jax.serving import (ENGINE_MAX_LEN, MAX_BEAM_WIDTH, STREAM_SCALE,  # noqa: F401
                               generate_text, greedy, make_engine, scaled_requests, serve,
                               tiny_model, warm_up)

__all__ = ["ENGINE_MAX_LEN", "MAX_BEAM_WIDTH", "STREAM_SCALE", "generate_text", "greedy",
           "make_engine", "scaled_requests", "serve", "tiny_model", "warm_up"]
