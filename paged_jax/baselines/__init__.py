"""Contiguous-reservation baselines (Orca Max / Pow2 / Oracle) and the
continuous-batching memory simulation that compares them with paged blocks."""

from paged_jax.baselines.arena import ContiguousArena
from paged_jax.baselines.orca import POLICIES, OrcaAllocator, reservation_tokens
