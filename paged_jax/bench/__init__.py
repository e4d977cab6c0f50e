"""The measuring harness: what the experiments drive the engine with.

Not part of the serving path: nothing under `paged_jax.engine` imports it.

  scale           HarnessScale: the sizes engine experiments run at (TINY: the CPU model)
  workloads       Request; seeded ShareGPT-like / Alpaca-like streams, scaled, shared-prefix
  sharegpt_trace  the real ShareGPT trace (optional extra) as request streams
  arrivals        the one seeded Poisson arrival generator
  clocks          the Clock protocol: wall time, a fixed cost per step
  engines         the tiny-model engine on a KV budget; warm-up of its step shapes
  recorder        EngineLike (what the loops drive) and the one loop recorder
  serving         serve (all at t = 0) and serve_online (arrivals into a running engine)
  sweep           request-rate sweeps over systems at equal KV memory (Fig. 12 / 14)
  latency         normalized latency, TTFT / TPOT percentiles, the max rate under an SLO
  memory          where the KV budget goes (utilization, fragmentation, sharing)
  baselines/      Orca Max / Pow2 / Oracle: contiguous arena, admission gates, simulation
"""
