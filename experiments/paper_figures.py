"""The paper's ablations and batch counts at its scale: Fig. 13, 18, 19 (Fig. 12, 14 and 16
are `experiments.serving_benchmark --clock=model` sweeps).

    setting = paper_scale.setting("opt-13b", "a100-40gb")
    rows = paper_figures.block_size_points(setting, "sharegpt", rate=3.0,
                                           block_sizes=(8, 16, 64), num_requests=200)
    rows = paper_figures.preemption_points(setting, rate=3.0, block_sizes=(16, 64),
                                           num_requests=200)
    rows = paper_figures.kv_budget_points(setting, "sharegpt", rate=3.0,
                                          kv_fractions=(0.5, 1.0), num_requests=200)
    paper_figures.swap_vs_recompute(setting, block_sizes=(1, 16, 256), tokens=1024)
    paper_figures.batched_requests(serving_benchmark_result)

Every point is the real engine on the stand-in forward and the model clock
(`paper_scale`), paged system only, one seeded stream at a fixed request rate, the KV
budget of the setting in whole blocks of each block size. A part of
experiments/paper_scale.py (through paper_scale_parts) and of its notebook (no command
line of its own).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from paged_jax import perf
from paged_jax.bench import paper_scale
from paged_jax.bench import sweep


def _point(setting: paper_scale.PaperSetting, workload: str, rate: float, block_size: int,
           num_requests: int, seed: int, preemption_mode: str, progress,
           kv_fraction: float = 1.0) -> Dict:
  scale = setting.scale
  reqs = sweep.rate_stream(workload, rate, None, seed, setting.max_len, num_requests, scale)
  kv = int(kv_fraction * setting.kv_budget_tokens(block_size)) // block_size * block_size
  if kv < setting.max_len:
    raise ValueError(f"kv_fraction={kv_fraction:g} leaves {kv} KV slots, less than one "
                     f"{setting.max_len}-token context")
  sizes = sweep.system_sizes("paged", reqs, kv_budget_tokens=kv, block_size=block_size,
                             max_len=setting.max_len, max_seqs_cap=paper_scale.MAX_NUM_SEQS)
  bar = progress or (lambda total, desc: contextlib.nullcontext())
  with bar(len(reqs), f"{workload} block {block_size} {preemption_mode}") as b:
    p = sweep.run_point("paged", reqs, kv_budget_tokens=kv, block_size=block_size,
                        max_len=setting.max_len, sizes=sizes, clock=setting.clock(block_size),
                        progress=b, preemption_mode=preemption_mode,
                        engine_fn=setting.make_engine,
                        max_num_batched_tokens=scale.max_num_batched_tokens)
  s = p["summary"]
  return {"block_size": block_size, "preemption_mode": preemption_mode, "rate": rate,
          "kv_budget_tokens": kv, "kv_fraction": kv_fraction, "requests": s["requests"],
          "normalized_latency_s_per_token": s["normalized_latency_s_per_token"],
          "throughput_req_s": s["throughput_req_s"], "ttft_p50_s": s["ttft_p50_s"],
          "mean_running": p["mean_running"], "max_seqs": sizes["max_seqs"],
          "preemptions": p["preemptions"], "swaps": p["swaps"],
          "swapped_blocks": p["swapped_blocks"], "steps": p["steps"]}


def default_requests(setting: paper_scale.PaperSetting, workload: str, seed: int = 0,
                     block_size: int = paper_scale.BLOCK_SIZE) -> int:
  """Requests of a fixed-rate point: rate_search's rule (REQUESTS_PER_SLOT x the requests
  the paged KV memory holds of the stream, at least MIN_REQUESTS)."""
  from paged_jax.bench import rate_search  # pylint: disable=g-import-not-at-top
  sample = sweep.rate_stream(workload, 1.0, None, seed, setting.max_len,
                             rate_search.MIN_REQUESTS, setting.scale)
  conc = sweep.system_sizes("paged", sample, kv_budget_tokens=setting.kv_budget_tokens(
      block_size), block_size=block_size, max_len=setting.max_len)["memory_concurrency"]
  return max(rate_search.MIN_REQUESTS, int(-(-rate_search.REQUESTS_PER_SLOT * conc // 1)))


def block_size_points(setting: paper_scale.PaperSetting, workload: str, *, rate: float,
                      block_sizes: Sequence[int], num_requests: int, seed: int = 0,
                      preemption_mode: str = "auto", progress: Optional[Callable] = None
                      ) -> list:
  """Fig. 18b: the paged system's normalized latency at one request rate per block size."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  rows = []
  for bs in block_sizes:
    rows.append(_point(setting, workload, rate, bs, num_requests, seed, preemption_mode,
                       progress))
    release_compiled()     # every block size is another geometry
  return rows


def kv_budget_points(setting: paper_scale.PaperSetting, workload: str, *, rate: float,
                     kv_fractions: Sequence[float], num_requests: int,
                     block_size: int = paper_scale.BLOCK_SIZE, seed: int = 0,
                     preemption_mode: str = "auto", progress: Optional[Callable] = None
                     ) -> list:
  """The paged system at one request rate with `kv_fractions` of the setting's KV budget
  (what a smaller gpu_memory_utilization or a larger model would leave)."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  rows = []
  for frac in kv_fractions:
    rows.append(_point(setting, workload, rate, block_size, num_requests, seed,
                       preemption_mode, progress, kv_fraction=frac))
    release_compiled()
  return rows


def preemption_points(setting: paper_scale.PaperSetting, *, rate: float,
                      block_sizes: Sequence[int], num_requests: int, seed: int = 0,
                      workload: str = "sharegpt", progress: Optional[Callable] = None) -> list:
  """Fig. 19b: recompute vs swap preemption, end to end, per block size."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  rows = []
  for bs in block_sizes:
    for mode in ("recompute", "swap"):
      rows.append(_point(setting, workload, rate, bs, num_requests, seed, mode, progress))
    release_compiled()
  return rows


def swap_vs_recompute(setting: paper_scale.PaperSetting, *, block_sizes: Sequence[int],
                      tokens: int = 1024) -> list:
  """Fig. 19a from the device-time model: seconds to swap `tokens` tokens of K/V out (or
  in) over PCIe in blocks of each size (one copy per block, layer and K/V) against
  recomputing them as one prefill (independent of the block size)."""
  dm = setting.device_model
  recompute = dm.step_seconds(perf.StepShape.prefill([tokens]))
  rows = []
  for bs in block_sizes:
    blocks = -(-tokens // bs)
    swap = dm.breakdown(perf.StepShape(swapped_blocks=blocks, block_size=bs))["swap"]
    rows.append({"block_size": bs, "tokens": tokens, "swap_s": swap, "recompute_s": recompute,
                 "recompute_over_swap": recompute / swap})
  return rows


def batched_at_rate(setting: paper_scale.PaperSetting, panel: Dict, workload: str, *,
                    rate: float, seed: int = 0, progress: Optional[Callable] = None) -> Dict:
  """Fig. 13 as the paper reads it: every system of a Fig. 12 `panel` (its serving_benchmark
  JSON: the same systems, engine sizes and requests) serving one stream at ONE request
  rate, past every system's knee; per system the mean and max requests batched a step,
  the mean over the steps while requests wait (`saturated_batch`), both per-step counts,
  and paged's means over each system's ("paged_over", "paged_over_while_waiting")."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  scale = setting.scale
  reqs = sweep.rate_stream(workload, rate, None, seed, setting.max_len, panel["num_requests"],
                           scale)
  kv = panel["kv_budget_tokens"]
  bar = progress or (lambda total, desc: contextlib.nullcontext())
  out = {}
  for system in panel["systems"]:
    with bar(len(reqs), f"fig13 {workload} {system} {rate:.3g} req/s") as b:
      p = sweep.run_point(system, reqs, kv_budget_tokens=kv, block_size=paper_scale.BLOCK_SIZE,
                          max_len=setting.max_len, sizes=panel["sizes"][system],
                          clock=setting.clock(), progress=b, preemption_mode="auto",
                          engine_fn=setting.make_engine,
                          max_num_batched_tokens=scale.max_num_batched_tokens)
    release_compiled()   # the next system's engine has another geometry
    s = p["summary"]
    out[system] = {"rate": rate, "mean_running": p["mean_running"],
                   "max_running": p["max_running"], "requests": s["requests"],
                   "normalized_latency_s_per_token": s["normalized_latency_s_per_token"],
                   "throughput_req_s": s["throughput_req_s"], "steps": p["steps"],
                   "preemptions": p["preemptions"],
                   **saturated_batch(p["running_per_step"], p["waiting_per_step"]),
                   "running_per_step": p["running_per_step"].tolist(),
                   "waiting_per_step": p["waiting_per_step"].tolist()}
  if "paged" in out:
    for v in out.values():
      v["paged_over"] = out["paged"]["mean_running"] / v["mean_running"]
      v["paged_over_while_waiting"] = (out["paged"]["mean_running_while_waiting"]
                                       / v["mean_running_while_waiting"])
  return out


def saturated_batch(running, waiting) -> Dict:
  """The batch while requests wait (the saturated regime, past ramp-up and before the
  drain): {"mean_running_while_waiting" (mean of `running` over the steps whose
  `waiting` > 0; nan when none), "steps_waiting" (those steps), "mean_waiting" (over
  every step)}. running / waiting: i32[steps], requests in each step's batch / arrived
  and not in it (`serving.serve_online`'s per-step counts)."""
  running, waiting = np.asarray(running), np.asarray(waiting)
  busy = waiting > 0
  return {"mean_running_while_waiting": float(running[busy].mean()) if busy.any() else math.nan,
          "steps_waiting": int(busy.sum()),
          "mean_waiting": float(waiting.mean()) if waiting.size else 0.0}


def batched_requests(result: Dict) -> Dict:
  """Fig. 13: per system, the mean requests batched a step at its highest rate run (past
  its knee: the batch its KV memory allows), and paged's over each other system's."""
  out = {}
  for name, c in result["systems"].items():
    k = max(range(len(c["rates"])), key=lambda i: c["rates"][i])
    out[name] = {"rate": c["rates"][k], "mean_running": c["mean_running"][k],
                 "max_running": c["max_running"][k]}
  if "paged" in out:
    for name, v in out.items():
      v["paged_over"] = out["paged"]["mean_running"] / v["mean_running"]
  return out
