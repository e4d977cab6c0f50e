"""Request-rate sweeps of serving systems at equal KV memory (the paper's Fig. 12 / 14).

    sizes = system_sizes("orca_oracle", requests, kv_budget_tokens=2048, block_size=16)
    point = run_point("paged", requests, kv_budget_tokens=2048, block_size=16)
    point["summary"]["normalized_latency_s_per_token"]

Systems (one `paged_jax.engine.Engine` each, same model, block size, kernels and
per-step token budget; only admission differs):

  paged         vLLM: requests enter on arrival, the engine's paged pool of
                `kv_budget_tokens` slots allocates blocks on demand (preempts when
                it runs short).
  orca_max      an `OrcaGate` over a `kv_budget_tokens`-slot contiguous arena in
  orca_pow2     front of the engine: a request enters once its reservation (max
  orca_oracle   length / next pow2 of its final length / its final length, times
                its sequences) fits first-fit, and holds it until it finishes.
                The engine's own pool gets `max_seqs * block_size` extra slots of
                block-rounding slack so it never binds: the arena alone limits
                concurrency, exactly as the reservations allow.

Sizing `max_seqs` (the engine's slot count; the step runs on shape buckets of what is
live, so `max_seqs` bounds the row buckets, and the shapes warm-up compiles): each system gets
`headroom` x the concurrency its KV memory holds for the stream's MEAN request,
rounded up to a multiple of 4: paged `budget / mean(prompt + output / 2 + block/2)`
(the tokens a request holds on average over its life), Orca `budget / mean(reservation)`;
Orca(Max) exactly `budget // (max_len * sequences)` (its reservation is fixed), all
capped at `max_seqs_cap`. So no system gets slots its memory cannot fill.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from paged_jax.bench import serving
from paged_jax.bench.baselines import gate as gate_lib

SYSTEMS = ("paged", "orca_max", "orca_pow2", "orca_oracle")
LABELS = {"paged": "vLLM (paged)", "orca_max": "Orca (Max)", "orca_pow2": "Orca (Pow2)",
          "orca_oracle": "Orca (Oracle)"}


def check_system(system: str) -> str:
  if system not in SYSTEMS:
    raise ValueError(f"unknown system {system!r}; choose from {','.join(SYSTEMS)}")
  return system


def system_sizes(system: str, requests: Sequence, *, kv_budget_tokens: int, block_size: int,
                 max_len: int = serving.ENGINE_MAX_LEN, num_seqs: int = 1,
                 headroom: float = 1.5, max_seqs_cap: int = 64) -> Dict:
  """{"max_seqs", "pool_tokens", "memory_concurrency"} of `system` (module docstring).

  Args:
    requests: the stream (prompt_len / output_len / total_len), to size from its means.
    num_seqs: sequences per request (n or beam width).
  """
  check_system(system)
  if kv_budget_tokens % block_size or kv_budget_tokens < max_len:
    raise ValueError(f"kv_budget_tokens must be a multiple of block_size={block_size} and "
                     f">= max_len={max_len}, got {kv_budget_tokens}")
  if system == "paged":
    held = np.mean([r.prompt_len + num_seqs * (r.output_len / 2 + block_size / 2)
                    for r in requests])
    conc = kv_budget_tokens / held
  elif system == "orca_max":
    conc = kv_budget_tokens // (max_len * num_seqs)
    if conc < 1:
      raise ValueError(f"Orca(Max) cannot hold one request of {num_seqs} x {max_len} tokens "
                       f"in {kv_budget_tokens}")
  else:
    g = gate_lib.make_gate(system, kv_budget_tokens, max_len)
    conc = kv_budget_tokens / np.mean([g.reservation(r.total_len, num_seqs) for r in requests])
  if system == "orca_max":
    max_seqs = int(conc) * num_seqs
  else:
    max_seqs = 4 * math.ceil(headroom * conc * num_seqs / 4)
  max_seqs = max(num_seqs, min(max_seqs, max_seqs_cap))
  pool = kv_budget_tokens if system == "paged" else kv_budget_tokens + max_seqs * block_size
  return {"max_seqs": int(max_seqs), "pool_tokens": int(pool),
          "memory_concurrency": float(conc)}


def run_point(system: str, requests: Sequence, *, kv_budget_tokens: int, block_size: int,
              max_len: int = serving.ENGINE_MAX_LEN, sizes: Optional[Dict] = None,
              params_fn: Callable = serving.greedy, clock=None, progress=None,
              attention_backend: str = "auto", max_num_batched_tokens: int = 256,
              preemption_mode: str = "recompute") -> Dict:
  """One system at one arrival stream: a fresh warmed-up engine, `serve_online`.

  On the wall clock every step shape the stream can reach is compiled before serving
  (`serving.warm_up`); on a `serving.StepClock` nothing is (virtual time does not see
  compile time), and shapes compile on first use.
  Returns `serve_online`'s dict plus "max_seqs", "pool_tokens", "warm_up_compiled"
  (shapes compiled for this point) and "warm_up_shapes" (shapes in its reachable set).
  """
  sizes = sizes or system_sizes(system, requests, kv_budget_tokens=kv_budget_tokens,
                                block_size=block_size, max_len=max_len)
  engine = serving.make_engine(block_size=block_size, kv_budget_tokens=sizes["pool_tokens"],
                               max_seqs=sizes["max_seqs"], max_len=max_len,
                               attention_backend=attention_backend,
                               max_num_batched_tokens=max_num_batched_tokens,
                               preemption_mode=preemption_mode)
  warm = ({"compiled": 0, "shapes": 0} if isinstance(clock, serving.StepClock) else
          serving.warm_up(engine, requests, params_fn))
  gate = gate_lib.make_gate(system, kv_budget_tokens, max_len)
  res = serving.serve_online(engine, requests, gate, params_fn, clock=clock, progress=progress)
  res.update(max_seqs=sizes["max_seqs"], pool_tokens=sizes["pool_tokens"],
             warm_up_compiled=warm["compiled"], warm_up_shapes=warm["shapes"])
  return res


CURVE_KEYS = ("normalized_latency_s_per_token", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
              "tpot_p99_s", "throughput_req_s")


def curve(rates: Sequence[float], points: Sequence[Dict]) -> Dict:
  """One system's contract entry: {"rates", each of CURVE_KEYS: [...], extras: [...]}."""
  out = {"rates": [float(r) for r in rates]}
  for k in CURVE_KEYS:
    out[k] = [p["summary"][k] for p in points]
  out["requests"] = [p["summary"]["requests"] for p in points]
  out["mean_latency_s"] = [p["summary"]["mean_latency_s"] for p in points]
  out["throughput_tok_s"] = [p["summary"]["throughput_tok_s"] for p in points]
  out["mean_running"] = [p["mean_running"] for p in points]
  out["max_running"] = [p["max_running"] for p in points]
  out["preemptions"] = [p["preemptions"] for p in points]
  out["swaps"] = [p.get("swaps", 0) for p in points]
  out["swapped_blocks"] = [p.get("swapped_blocks", 0) for p in points]
  out["steps"] = [p["steps"] for p in points]
  for k in ("step_traces_in_run", "engine_step_s", "device_s", "warm_up_compiled",
            "warm_up_shapes"):
    out[k] = [p.get(k) for p in points]
  out["max_seqs"] = points[0]["max_seqs"] if points else None
  out["pool_tokens"] = points[0]["pool_tokens"] if points else None
  return out
