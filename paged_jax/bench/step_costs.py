"""What the parts of an engine step cost on this machine: attention, a decode step, a
preemption; and a fit of step time to the work a run's steps did.

    step_costs.attention_ms([16, 64], batch=8, context=512)       # {block_size: ms}
    step_costs.decode_step_seconds(engine, 4, short=8, long=40, seed=0)
    step_costs.time_per_preemption(16, seq_len=200)               # swap vs recompute ms
    step_costs.step_cost_fit(throughput_results)                  # a, b of a*calls + b*tokens

Timings keep the fastest (or median) of several interleaved calls: the machine is shared.
"""

from __future__ import annotations

import functools
import time
from typing import Dict, Optional, Sequence

import numpy as np

from paged_jax.bench import engines


def attention_ms(block_sizes: Sequence[int], *, batch: int = 8, context: int = 512,
                 num_q_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64,
                 repeats: int = 7, seed: int = 0, backend: str = "auto") -> Dict[int, float]:
  """{block_size: fastest ms of one jitted decode paged-attention call}.

  Every sequence holds `context` tokens in `context / block_size` pages placed in
  a random permutation of the pool (fresh random K/V, the same values for every
  block size; their outputs must agree, else RuntimeError). All block sizes compile
  first; then the timed calls go round-robin over the block sizes, so load on a shared
  machine hits them alike.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax import attention  # pylint: disable=g-import-not-at-top
  for bs in block_sizes:
    if context % bs:
      raise ValueError(f"attn context {context} must be a multiple of block_size={bs}")
  rng = np.random.default_rng(seed)
  k_dense = rng.standard_normal((num_kv_heads, batch * context, head_dim), np.float32)
  v_dense = rng.standard_normal((num_kv_heads, batch * context, head_dim), np.float32)
  q = jax.numpy.asarray(rng.standard_normal((batch, num_q_heads, head_dim), np.float32))
  lengths = jax.numpy.full((batch,), context, jax.numpy.int32)
  fn = jax.jit(functools.partial(attention.paged_attention, backend=backend))
  calls, first = {}, None
  for bs in block_sizes:
    num_blocks = batch * context // bs
    perm = rng.permutation(num_blocks)
    k = k_dense.reshape(num_kv_heads, num_blocks, bs, head_dim)
    v = v_dense.reshape(num_kv_heads, num_blocks, bs, head_dim)
    # Logical block j of the pool sits at physical perm[j]: scatter the pages there.
    k_pages = np.empty_like(k)
    v_pages = np.empty_like(v)
    k_pages[:, perm] = k
    v_pages[:, perm] = v
    tables = perm.reshape(batch, context // bs).astype(np.int32)
    args = (q, jax.numpy.asarray(k_pages), jax.numpy.asarray(v_pages),
            jax.numpy.asarray(tables), lengths)
    out = np.asarray(fn(*args))
    if first is None:
      first = out
    elif not np.allclose(out, first, rtol=1e-4, atol=1e-4):   # the same logical cache
      raise RuntimeError(f"paged attention at block_size={bs} disagrees with "
                         f"block_size={block_sizes[0]}: max diff {np.abs(out - first).max()}")
    calls[bs] = args
  times = {bs: [] for bs in block_sizes}
  for _ in range(repeats):
    for bs in block_sizes:
      t0 = time.perf_counter()
      fn(*calls[bs]).block_until_ready()
      times[bs].append(time.perf_counter() - t0)
  # The machine is shared: the fastest call is the stable statistic.
  return {bs: 1e3 * float(np.min(t)) for bs, t in times.items()}


def decode_step_seconds(engine, num_live: int, short: int, long: int, seed: int
                        ) -> Dict[str, float]:
  """Seconds per decode step with `num_live` sequences decoding on `engine`, by difference.

  Generates `short` then `long` greedy tokens for the same `num_live` seeded 16-token
  prompts; prefill and warm-up cancel in the difference.
  Returns {"step_s": wall s / step, "device_s": the engine's device s / step, "steps":
  decode steps the two runs differ by}.
  """
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, 256, 16).tolist() for _ in range(num_live)]
  out = {}
  for n in (short, long):
    engine.timing.clear()
    steps0 = engine.stats["steps"]
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))
    out[n] = (time.perf_counter() - t0, engine.timing["device_s"], engine.stats["steps"] - steps0)
  steps = out[long][2] - out[short][2]
  return {"step_s": (out[long][0] - out[short][0]) / steps,
          "device_s": (out[long][1] - out[short][1]) / steps, "steps": steps}


def warm_swaps(engine, slot: int = 0) -> None:
  """Compiles swap_out / swap_in for every power-of-two block count they may pad to."""
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import swap  # pylint: disable=g-import-not-at-top
  c = engine.cache_config
  width = 1
  while True:
    tokens = min(width, c.max_blocks_per_seq) * c.block_size
    blocks, _ = bm.allocate(engine.state.blocks, slot, tokens)
    state = engine.state.with_full(blocks=blocks)
    saved = swap.swap_out(state, slot, tokens)
    blocks, _ = bm.free(state.blocks, slot)
    state, _ = swap.swap_in(state.with_full(blocks=blocks), slot, saved)
    blocks, _ = bm.free(state.blocks, slot)
    engine.state = state.with_full(blocks=blocks)
    if width >= c.max_blocks_per_seq:
      break
    width *= 2


def time_per_preemption(block_size: int, *, seq_len: int = 256, repeats: int = 5,
                        kv_budget_tokens: int = 512, seed: int = 0) -> Dict:
  """{"swap_out_ms", "swap_in_ms", "swap_ms", "recompute_ms"} for one seq_len-token sequence."""
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import SamplingParams, swap  # pylint: disable=g-import-not-at-top
  engine = engines.make_engine(block_size=block_size, kv_budget_tokens=kv_budget_tokens)
  if seq_len > engine.max_model_len - 1:
    raise ValueError(f"seq_len must be < {engine.max_model_len}, got {seq_len}")
  warm_swaps(engine)   # the recompute timing below keeps the fastest of `repeats` runs
  slot = 0
  outs, ins = [], []
  for _ in range(repeats):
    blocks, status = bm.allocate(engine.state.blocks, slot, seq_len)
    if int(status) != 0:
      raise RuntimeError(f"allocate failed with status {int(status)}")
    state = engine.state.with_full(blocks=blocks)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    saved = swap.swap_out(state, slot, seq_len)
    t1 = time.perf_counter()
    blocks, _ = bm.free(state.blocks, slot)
    state = state.with_full(blocks=jax.block_until_ready(blocks))
    t2 = time.perf_counter()
    state, status = swap.swap_in(state, slot, saved)
    jax.block_until_ready(state)
    t3 = time.perf_counter()
    blocks, _ = bm.free(state.blocks, slot)
    engine.state = state.with_full(blocks=blocks)
    outs.append(t1 - t0)
    ins.append(t3 - t2)
  prompt = list(np.random.default_rng(seed).integers(0, 256, seq_len))
  # Compiles the prefill shape untimed: with repeats=1 the one timed run measured it.
  engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
  recompute = []
  for _ in range(repeats):
    # Timed here: Engine.generate drives the engine without step(), so timing["step_s"]
    # does not see it.
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    recompute.append(time.perf_counter() - t0)   # one prefill step (+ the free)
  ms = lambda xs: 1e3 * float(np.min(xs))
  return {"swap_out_ms": ms(outs), "swap_in_ms": ms(ins),
          "swap_ms": ms(np.array(outs) + np.array(ins)), "recompute_ms": ms(recompute),
          "swap_bytes": int(saved.nbytes)}


def step_cost_fit(results: Dict) -> Optional[Dict]:
  """Where the wall / step gap comes from, measured: a least-squares fit of every run's
  device seconds to `a * device_steps + b * bucket_tokens` (a fixed cost per jitted call
  and a cost per token its shape computes, padding included), over all workloads and
  configurations of the run. A GPU decode step is memory-bound (b ~ 0: wall / step -> 1);
  on this CPU the tokens' matmuls make b large, so twice the rows cost up to twice the
  time. Per workload: the fit's a, b, each config's fixed share a * steps / device_s, the
  wall / step ratio the fit predicts, and the one it gives without recomputation (paged's
  bucket tokens scaled by Orca(Max)'s computed tokens over its own). None with fewer
  points than unknowns.

  Args:
    results: {workload: {"paged": serving.serve result, "orca_max": the same,
      "speedup_tokens_per_step": paged's tokens per step over Orca(Max)'s}} (the
      `experiments.throughput` run).
  """
  configs = ("orca_max", "paged")
  runs = [row[c] for row in results.values() for c in configs]
  if len(runs) < 3 or any("bucket_tokens" not in r for r in runs):
    return None
  x = np.array([[r["device_steps"], r["bucket_tokens"]] for r in runs], float)
  y = np.array([r["device_s"] for r in runs], float)
  (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
  cost = lambda steps, tokens: a * steps + b * tokens
  out = {}
  for name, row in results.items():
    p, o = row["paged"], row["orca_max"]
    step_ratio = row["speedup_tokens_per_step"]
    # Wall time follows device time plus host time per step (kept as measured).
    wall = lambda r, dev: dev + r["host_s"]
    predicted = (wall(o, cost(o["device_steps"], o["bucket_tokens"]))
                 / wall(p, cost(p["device_steps"], p["bucket_tokens"])))
    no_recompute = p["bucket_tokens"] * o["computed_tokens"] / max(p["computed_tokens"], 1)
    predicted_nr = (wall(o, cost(o["device_steps"], o["bucket_tokens"]))
                    / wall(p, cost(p["device_steps"], no_recompute)))
    out[name] = {"ms_per_step": 1e3 * a, "us_per_bucket_token": 1e6 * b,
                 "fixed_share": {c: a * row[c]["device_steps"] / row[c]["device_s"]
                                 for c in configs},
                 "predicted_wall_over_step": predicted / step_ratio,
                 "predicted_wall_over_step_without_recompute": predicted_nr / step_ratio,
                 "recomputed_tokens": p["computed_tokens"] - o["computed_tokens"]}
  return out
