"""Request-rate sweeps of serving systems at equal KV memory (the paper's Fig. 12 / 14).

    sizes = system_sizes("orca_oracle", requests, kv_budget_tokens=2048, block_size=16)
    point = run_point("paged", requests, kv_budget_tokens=2048, block_size=16)
    point["summary"]["normalized_latency_s_per_token"]
    swept = sweep_systems(["paged", "orca_max"], [4.0, 8.0], workload="sharegpt",
                          duration_s=10.0, seed=0, kv_budget_tokens=2048, block_size=16)
    swept["systems"]["paged"]["normalized_latency_s_per_token"]   # one per rate

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
(the tokens a request holds on average over its life; with a prefix every request shares
and paged caches, the prefix's whole blocks are held once: `(budget - shared) /
mean(prompt - shared + ...)`), Orca `budget / mean(reservation)`;
Orca(Max) exactly `budget // (max_len * sequences)` (its reservation is fixed), all
capped at `max_seqs_cap`. So no system gets slots its memory cannot fill.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from paged_jax.bench import arrivals
from paged_jax.bench import engines
from paged_jax.bench import serving
from paged_jax.bench import sharegpt_trace
from paged_jax.bench import workloads
from paged_jax.bench.baselines import gate as gate_lib
from paged_jax.bench.clocks import WallClock
from paged_jax.bench.scale import TINY, HarnessScale

SYSTEMS = ("paged", "orca_max", "orca_pow2", "orca_oracle")
LABELS = {"paged": "vLLM (paged)", "orca_max": "Orca (Max)", "orca_pow2": "Orca (Pow2)",
          "orca_oracle": "Orca (Oracle)"}


def check_system(system: str) -> str:
  if system not in SYSTEMS:
    raise ValueError(f"unknown system {system!r}; choose from {','.join(SYSTEMS)}")
  return system


def system_sizes(system: str, requests: Sequence, *, kv_budget_tokens: int, block_size: int,
                 max_len: int = TINY.max_len, num_seqs: int = 1,
                 headroom: float = 1.5, max_seqs_cap: int = 64,
                 shared_prefix_tokens: int = 0) -> Dict:
  """{"max_seqs", "pool_tokens", "memory_concurrency"} of `system` (module docstring).

  Args:
    requests: the stream (prompt_len / output_len / total_len), to size from its means.
    num_seqs: sequences per request (n or beam width).
    shared_prefix_tokens: a prompt prefix every request shares that paged's prefix cache
      holds once (its whole blocks); 0: none. Orca systems never share.
  """
  check_system(system)
  if kv_budget_tokens % block_size or kv_budget_tokens < max_len:
    raise ValueError(f"kv_budget_tokens must be a multiple of block_size={block_size} and "
                     f">= max_len={max_len}, got {kv_budget_tokens}")
  if system == "paged":
    shared = (shared_prefix_tokens // block_size) * block_size
    held = np.mean([r.prompt_len - shared + num_seqs * (r.output_len / 2 + block_size / 2)
                    for r in requests])
    conc = (kv_budget_tokens - shared) / held
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
              max_len: int = TINY.max_len, sizes: Optional[Dict] = None,
              params_fn: Callable = engines.greedy, clock=None, progress=None,
              attention_backend: str = "auto",
              max_num_batched_tokens: int = TINY.max_num_batched_tokens,
              preemption_mode: str = "recompute",
              engine_fn: Callable = engines.make_engine) -> Dict:
  """One system at one arrival stream: a fresh warmed-up engine, `serve_online`.

  `engine_fn` builds the engine (`engines.make_engine`'s keywords): the tiny model by
  default, `paper_scale.PaperSetting.make_engine` for a paper-scale deployment.

  On the wall clock every step shape the stream can reach is compiled before serving
  (`engines.warm_up`); on a virtual clock (`clock.virtual`: the step clock) nothing is
  (virtual time does not see compile time), and shapes compile on first use.
  Returns `serve_online`'s dict plus "max_seqs", "pool_tokens", "warm_up_compiled"
  (shapes compiled for this point) and "warm_up_shapes" (shapes in its reachable set).
  """
  sizes = sizes or system_sizes(system, requests, kv_budget_tokens=kv_budget_tokens,
                                block_size=block_size, max_len=max_len)
  clock = clock or WallClock()
  engine = engine_fn(block_size=block_size, kv_budget_tokens=sizes["pool_tokens"],
                     max_seqs=sizes["max_seqs"], max_len=max_len,
                     attention_backend=attention_backend,
                     max_num_batched_tokens=max_num_batched_tokens,
                     preemption_mode=preemption_mode)
  warm = ({"compiled": 0, "shapes": 0} if clock.virtual else
          engines.warm_up(engine, requests, params_fn))
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


# Sampling modes of the paper's Fig. 14 (parallel sampling n, beam width), keyed by name.
FIG14_MODES = {"n2": dict(n=2), "n4": dict(n=4), "n6": dict(n=6), "beam2": dict(beam_width=2),
               "beam4": dict(beam_width=4), "beam6": dict(beam_width=6)}


def sampling(mode: Dict) -> Callable:
  """request -> SamplingParams for a mode ({} greedy, {"n": k} k samples at temperature 1
  seeded by the request id, {"beam_width": k} beam search), output_len tokens each."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  temp = 1.0 if mode.get("n", 1) > 1 else 0.0
  return lambda r: SamplingParams(max_tokens=r.output_len, temperature=temp,
                                  seed=r.request_id % 1000, **mode)


# Few-shot translation streams (the paper's Fig. 16): every prompt starts with one shared
# 1-shot (80-token) or 5-shot (341-token) prefix; `workloads.shared_prefix`.
FEW_SHOT = {"fewshot-1": 1, "fewshot-5": 5}


def shared_prefix_tokens(workload: str) -> int:
  """Tokens every request of `workload` begins with (FEW_SHOT's prefix), else 0."""
  return workloads.FEW_SHOT_PREFIX_LEN[FEW_SHOT[workload]] if workload in FEW_SHOT else 0


def rate_stream(workload: str, rate: float, duration_s: Optional[float], seed: int,
                max_len: int, num_total: int, scale: HarnessScale = TINY
                ) -> List[workloads.Request]:
  """The arrivals within `duration_s` at `rate` of one `num_total`-request stream
  (duration_s None: all `num_total` of them).

  Lengths and ids come from one seeded stream of `num_total` requests for every rate
  (common random numbers); a rate's arrival count picks its prefix. Lengths are divided
  by `scale.divisor(workload)` (TINY: the tiny model's; the paper's scale: unscaled);
  "sharegpt-real" is the real trace at ShareGPT's divisor; FEW_SHOT's are unscaled.
  """
  times = (arrivals.arrival_times(rate, duration_s, seed) if duration_s is not None else
           arrivals.arrival_times(rate, seed=seed, num_requests=num_total))
  if workload == "sharegpt-real":
    base = sharegpt_trace.requests(num_total, seed=seed, max_len=max_len,
                                   scale=scale.divisor(workload))
  elif workload in FEW_SHOT:   # the paper's Fig. 16 translation prompts, one shared prefix
    _, base = workloads.shared_prefix(num_total, num_shots=FEW_SHOT[workload], seed=seed,
                                      max_len=max_len, vocab_size=256)
  else:
    base = workloads.scaled_requests(workload, num_total, seed=seed, max_len=max_len,
                                     scale=scale.divisor(workload))
  return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(base, times)]


def engine_for(engine_fn, system: str) -> Callable:
  """`engine_fn` itself, or its entry for `system` when it is a {system: fn} dict."""
  return engine_fn[system] if isinstance(engine_fn, dict) else engine_fn


def sweep_systems(systems: Sequence[str], rates: Sequence[float], *, workload: str,
                  duration_s: float, seed: int, kv_budget_tokens: int, block_size: int,
                  max_len: int = TINY.max_len, mode: Optional[Dict] = None,
                  clock_fn: Callable = WallClock, headroom: float = 1.5,
                  max_seqs_cap: int = 64, preemption_mode: str = "recompute",
                  progress: Optional[Callable] = None, scale: HarnessScale = TINY,
                  engine_fn=engines.make_engine, shared_prefix_tokens: int = 0) -> Dict:
  """Every system at every rate: {"systems": {NAME: curve(...)}, "sizes": {NAME: sizes}}.

  Args:
    mode: sampling mode (`sampling`; default greedy).
    clock_fn: () -> a fresh clock for each point.
    headroom, max_seqs_cap, shared_prefix_tokens: `system_sizes`' (sized on the highest
      rate's stream).
    progress: (total, desc) -> a context manager with `update(n)` (a tqdm bar), per point.
    scale: stream lengths and the step's token budget (`HarnessScale`).
    engine_fn: builds each point's engine (`run_point`); or {system: fn}.
  """
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  mode = mode or {}
  rates = list(rates)
  num_total = max(arrivals.arrival_times(r, duration_s, seed).size for r in rates)
  num_seqs = max(mode.get("n", 1), mode.get("beam_width", 1))
  streams = {r: rate_stream(workload, r, duration_s, seed, max_len, num_total, scale)
             for r in rates}
  bar = progress or (lambda total, desc: contextlib.nullcontext())
  curves, sizes = {}, {}
  for system in systems:
    sizes[system] = system_sizes(system, streams[max(rates)], kv_budget_tokens=kv_budget_tokens,
                                 block_size=block_size, max_len=max_len, num_seqs=num_seqs,
                                 headroom=headroom, max_seqs_cap=max_seqs_cap,
                                 shared_prefix_tokens=shared_prefix_tokens)
    points = []
    for r in rates:
      with bar(len(streams[r]), f"{system} {r:g} req/s") as b:
        points.append(run_point(system, streams[r], kv_budget_tokens=kv_budget_tokens,
                                block_size=block_size, max_len=max_len, sizes=sizes[system],
                                params_fn=sampling(mode), clock=clock_fn(), progress=b,
                                preemption_mode=preemption_mode,
                                engine_fn=engine_for(engine_fn, system),
                                max_num_batched_tokens=scale.max_num_batched_tokens))
    curves[system] = curve(rates, points)
    release_compiled()   # the next system's engine has other shapes
  return {"systems": curves, "sizes": sizes}
