"""The measuring harness: what the experiments drive the engine with.

Not part of the serving path: nothing under `paged_jax.engine` imports it.

  serving     engines of the shipped model, the `serve` / `serve_online` loops
  sweep       request-rate sweeps over systems at equal KV memory (Fig. 12 / 14)
  arrivals    Poisson arrivals and the clocks (wall, step)
  latency     normalized latency, TTFT / TPOT percentiles, the max rate under an SLO
  workloads   seeded ShareGPT-like / Alpaca-like streams, the real ShareGPT trace
  memory      where the KV budget goes (utilization, fragmentation, sharing)
  baselines/  Orca Max / Pow2 / Oracle: contiguous arena, admission gates, simulation
"""
