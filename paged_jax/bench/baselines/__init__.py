"""Contiguous-reservation baselines (Orca Max / Pow2 / Oracle) and the
continuous-batching memory simulation that compares them with paged blocks."""

from paged_jax.bench.baselines.arena import ContiguousArena
from paged_jax.bench.baselines.orca import POLICIES, OrcaAllocator, reservation_tokens
