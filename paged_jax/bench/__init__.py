"""The measuring harness: what the experiments drive the engine with, and what they time.

Not part of the serving path: nothing under `paged_jax.engine` imports it. What only one
experiment uses lives beside that experiment in experiments/ (its runners, figures,
scheduler), not here.

  scale           HarnessScale: the sizes engine experiments run at (TINY: the CPU model)
  workloads       Request; seeded ShareGPT-like / Alpaca-like streams, scaled, shared-prefix
  sharegpt_trace  the real ShareGPT trace (optional extra) as request streams
  arrivals        the one seeded Poisson arrival generator
  clocks          the Clock protocol: wall time, a fixed cost per step, CPU seconds
  engines         the tiny-model engine on a KV budget; warm-up of its step shapes
  recorder        EngineLike (what the loops drive) and the one loop recorder
  serving         serve (all at t = 0) and serve_online (arrivals into a running engine)
  sweep           request-rate sweeps over systems at equal KV memory (Fig. 12 / 14)
  latency         normalized latency, TTFT / TPOT percentiles, the max rate under an SLO
  rate_search     each system's rate at the SLO found by bracketing and bisection
  paper_scale     the paper's deployments: stand-in engine, model clock, KV budget
  calibration     step-time recordings for fitting the device-time model
  validation      a measured sweep beside its prediction: medians, censoring, errors
  memory          where the KV budget goes (utilization, fragmentation, sharing, tables)
  baselines/      Orca Max / Pow2 / Oracle: contiguous arena, admission gates, simulation
  timing          interleaved timing samples, copy bandwidth
  step_costs      attention call, decode step, preemption costs; a step-cost fit
  prefix_blocks   prefix-cache hit rates and lookup / eviction costs, block level
  prefix_serving  prefix caching on vs off on the same engine and requests
"""
