r"""The paper's serving experiments at the paper's scale: Fig. 12, 13, 14, 16, 18, 19.

    python -m experiments.paper_scale --out=experiments/results/paper_scale
    python -m experiments.paper_scale --figs=12 --fig12_models=opt-13b --fig12_workloads=sharegpt

Every figure runs the real engine (scheduler, jitted block manager, prefix cache, swapping,
sampling) and the Orca admission gates with the model's forward replaced by a stand-in, on
virtual time from the device-time model of the named model and GPUs, at the paper's KV
budgets (Table 1), a 2,048-token context and unscaled stream lengths
(`paged_jax.bench.paper_scale`):

  Fig. 12  `serving_benchmark --clock=model --rates=auto` for OPT-13B / 66B (A100-40GB x1 /
           x4) and OPT-175B (A100-80GB x8), ShareGPT-like and Alpaca-like: every system's
           max request rate at one normalized-latency SLO;
  Fig. 13  mean requests batched a step, read off Fig. 12's points past each system's knee;
  Fig. 14  OPT-13B Alpaca-like, parallel sampling n = 2, 4, 6 and beam width 2, 4, 6:
           paged vs Orca(Oracle);
  Fig. 16  LLaMA-13B, one shared 1-shot / 5-shot translation prefix: paged with prefix
           caching vs Orca(Oracle);
  Fig. 18  OPT-13B, the paged system at a fixed rate (--fixed_load x its Fig. 12 max rate)
           for block sizes 1-256, both streams;
  Fig. 19  OPT-13B ShareGPT-like at that rate, recompute vs swap preemption per block size;
           and (a) the device-time model's swap and recompute seconds per block size.

Writes DIR/fig12/<model>-<workload>/serving_benchmark.json (the contract JSON, with
"device_model"), DIR/fig16/<fewshot-k>/serving_benchmark.json, DIR/fig13.json,
DIR/fig14.json, DIR/fig18.json, DIR/fig19.json, DIR/summary.json (ours beside the paper's
figures, seconds per figure, the machine's load) and one PNG per figure. A figure not in
--figs is read back from DIR when an earlier run wrote it (the suite may run in parts:
Fig. 13 / 18 / 19 take their rates from the Fig. 12 panels in DIR), and summary.json
covers every figure in DIR, each with the seconds and load of the run that made it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from typing import Dict, Tuple

from experiments import common
from experiments import configs
from experiments import paper_scale_plots as plots
from experiments import provenance
from experiments import serving_benchmark as sb
from paged_jax.bench import latency
from paged_jax.bench import paper_figures
from paged_jax.bench import paper_scale
from paged_jax.bench import sweep as serving_sweep

FIGS = ("12", "13", "14", "16", "18", "19")
GPU_OF = {"opt-13b": "a100-40gb", "opt-66b": "a100-40gb", "opt-175b": "a100-80gb"}   # Table 1
FALLBACK_RATE = {"sharegpt": 4.0, "alpaca": 80.0}   # Fig. 18 / 19 without a Fig. 12 panel


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.paper_scale."""
  figs: Tuple[str, ...] = configs.flag(FIGS, "figures to run", choices=FIGS)
  fig12_models: Tuple[str, ...] = configs.flag(tuple(GPU_OF), "Fig. 12 models",
                                               choices=tuple(GPU_OF))
  fig12_workloads: Tuple[str, ...] = configs.flag(("sharegpt", "alpaca"), "Fig. 12 streams",
                                                  choices=("sharegpt", "alpaca"))
  systems: Tuple[str, ...] = configs.flag(serving_sweep.SYSTEMS, "Fig. 12 systems (paged first)",
                                          choices=serving_sweep.SYSTEMS)
  num_requests: int = configs.flag(0, "requests per point (0: 4 x what a KV memory holds)",
                                   lower=0)
  max_points: int = configs.flag(6, "points run per system's rate search", lower=2)
  fig14_modes: Tuple[str, ...] = configs.flag(("n2", "n4", "n6", "beam2", "beam4", "beam6"),
                                              "Fig. 14 sampling modes",
                                              choices=tuple(serving_sweep.FIG14_MODES))
  fig14_preemption: str = configs.flag(
      "recompute", "Fig. 14 preemption mode ('auto': vLLM V0's swap for groups of several "
      "sequences; the committed figure ran recompute: see docs/paper_scale.md)",
      choices=("recompute", "swap", "auto"))
  fig18_block_sizes: Tuple[int, ...] = configs.flag((1, 2, 4, 8, 16, 32, 64, 128, 256),
                                                    "Fig. 18 block sizes", lower=1)
  fig19_block_sizes: Tuple[int, ...] = configs.flag((8, 16, 32, 64, 128, 256),
                                                    "Fig. 19 block sizes", lower=1)
  fig13_load: float = configs.flag(1.5, "Fig. 13 rate: this x paged's Fig. 12 max rate at the "
                                   "SLO (past every system's knee; 0: each system's highest "
                                   "Fig. 12 point)", lower=0.0)
  fig13_panels: Tuple[str, ...] = configs.flag(("opt-13b-sharegpt", "opt-13b-alpaca"),
                                               "Fig. 12 panels Fig. 13 runs at one rate "
                                               "(the paper's Fig. 13a / b)")
  fixed_load: float = configs.flag(0.9, "Fig. 18 / 19 rate: this x paged's Fig. 12 max rate",
                                   lower=0.0, lower_open=True)
  slo_factor: float = configs.flag(3.0, "SLO = factor x the unloaded normalized latency",
                                   lower=1.0)
  seed: int = configs.flag(0, "stream and arrival seed")
  out: str = configs.flag("results/paper_scale", "output directory")

  def check(self) -> None:
    if self.systems[:1] != ("paged",):
      raise ValueError(f"--systems must start with paged (its unloaded latency sets the SLO "
                       f"and its answer starts the others' searches), got {self.systems}")


def _sb(f: Config, **kw) -> sb.Config:
  return sb.Config(clock="model", rates=("auto",), num_requests=f.num_requests,
                   max_points=f.max_points,
                   slo_factor=f.slo_factor, seed=f.seed, preemption_mode="auto",
                   out=f.out, **kw)


def fig12(f: Config, out) -> Dict:
  panels = {}
  for model in f.fig12_models:
    for workload in f.fig12_workloads:
      name = f"{model}-{workload}"
      res = sb.run(_sb(f, model=model, gpu=GPU_OF[model], workload=workload,
                       systems=f.systems))
      common.write_json(out / "fig12" / name / "serving_benchmark.json", res)
      panels[name] = res
  return panels


def fig13(f: Config, panels: Dict, progress) -> Dict:
  """Fig. 13: requests batched a step, every system of a panel at ONE rate, fig13_load x
  paged's max rate at the SLO (past every system's knee, paged's the highest), as the
  paper reads its Fig. 13 at one rate; with fig13_load 0, each system's highest Fig. 12
  point (just past its own knee) of every panel."""
  if not f.fig13_load:
    return {k: paper_figures.batched_requests(v) for k, v in panels.items()}
  missing = [p for p in f.fig13_panels if p not in panels]
  if missing:
    raise ValueError(f"--fig13_panels {', '.join(missing)} have no Fig. 12 run: add 12 to "
                     f"--figs or run them into --out first")
  out = {}
  for name in f.fig13_panels:
    res = panels[name]
    model, workload = name.rsplit("-", 1)
    knee = res["max_rate_at_slo_interpolated"].get("paged") or res["max_rate_at_slo"]["paged"]
    rate = f.fig13_load * knee
    out[name] = paper_figures.batched_at_rate(paper_scale.setting(model, GPU_OF[model]), res,
                                              workload, rate=rate, seed=f.seed,
                                              progress=progress)
    for v in out[name].values():
      v["rate_rule"] = (f"{f.fig13_load:g} x paged's Fig. 12 max rate at the SLO "
                        f"({knee:.3g} req/s), every system at this one rate")
  return out


def fig14(f: Config, out=None) -> Dict:
  """Fig. 14: paged vs Orca(Oracle) max rate at the SLO per sampling mode, OPT-13B
  Alpaca-like. Every engine of the figure has one of two geometries (the KV pool: paged's
  budget or Orca's with its slack; max_seqs 256, the cap, in every mode; one compiled
  step for n and beam width up to 6), so the compiled steps stay across systems and modes
  and are dropped once at the end. Each mode records its wall and CPU seconds; with
  `out`, fig14.json is written after each mode (a stopped run keeps the modes done), and
  the modes it already holds that this run does not redo are kept (the figure may run in
  parts: --fig14_modes=n2,n4,n6, then beam2,beam4,beam6)."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(_sb(f, model="opt-13b", gpu=GPU_OF["opt-13b"], workload="alpaca"),
                            preemption_mode=f.fig14_preemption)
  before = committed(out).get("fig14", {}) if out is not None else {}
  modes = {m: v for m, v in before.items() if m not in f.fig14_modes}
  try:
    for mode in f.fig14_modes:
      kw = serving_sweep.FIG14_MODES[mode]
      t0, c0 = time.time(), time.process_time()
      res = sb.rated(sb.sweep(cfg, ["paged", "orca_oracle"], ("auto",), 0.0, kw,
                              release=False), cfg, ())
      res["paged_rate_ratio"] = latency.rate_ratios(res["max_rate_at_slo"])
      points = sum(len(c["rates"]) for c in res["systems"].values())
      res["cost"] = {"wall_s": time.time() - t0, "cpu_s": time.process_time() - c0,
                     "points": points, "load_avg_end": os.getloadavg()[0]}
      modes[mode] = dict(res, mode=kw)
      order = list(serving_sweep.FIG14_MODES)
      modes = dict(sorted(modes.items(), key=lambda kv: order.index(kv[0])))
      if out is not None:
        common.write_json(out / "fig14.json", modes)
  finally:
    release_compiled()
  return modes


def fig16(f: Config, out) -> Dict:
  runs = {}
  for workload in serving_sweep.FEW_SHOT:
    # system_sizes counts paged's cached prefix once (its slots and the requests a point
    # serves: 4 x what its memory holds with the prefix shared).
    res = sb.run(_sb(f, model="llama-13b", gpu="a100-40gb", workload=workload,
                     prefix_caching=True, systems=("paged", "orca_oracle")))
    common.write_json(out / "fig16" / workload / "serving_benchmark.json", res)
    runs[workload] = res
  return runs


def fixed_rate(panels: Dict, workload: str, load: float) -> float:
  """Fig. 18 / 19's rate: `load` x paged's OPT-13B max rate from Fig. 12 when it ran."""
  res = panels.get(f"opt-13b-{workload}")
  if res is None:
    return FALLBACK_RATE[workload]
  r = res["max_rate_at_slo_interpolated"].get("paged") or res["max_rate_at_slo"]["paged"]
  return load * r


def _read(path) -> Dict:
  return json.loads(pathlib.Path(path).read_text())


def committed(out) -> Dict:
  """The figures an earlier run wrote to `out` ({} for those it did not)."""
  res = {}
  for fig in ("fig12", "fig16"):
    base = out / fig
    if base.is_dir():
      res[fig] = {p.parent.name: _read(p)
                  for p in sorted(base.glob("*/serving_benchmark.json"))}
  for name in ("fig13", "fig14", "fig18", "fig19"):
    if (out / f"{name}.json").exists():
      res[name] = _read(out / f"{name}.json")
  return {k: v for k, v in res.items() if v}


def run(f: Config, out) -> Dict:
  setting = paper_scale.setting("opt-13b", GPU_OF["opt-13b"])
  progress = lambda total, desc: common.progress(total=total, desc=desc)
  n = f.num_requests or None
  seconds, results = {}, {}

  def timed(name, fn):
    t0 = time.time()
    results[name] = fn()
    seconds[name] = time.time() - t0

  if "12" in f.figs:
    timed("fig12", lambda: fig12(f, out))
  panels = dict(committed(out).get("fig12", {}), **results.get("fig12", {}))
  if "13" in f.figs:
    if not panels:
      raise ValueError("--figs=13 reads Fig. 12's points: add 12 to --figs or run it into "
                       "--out first")
    timed("fig13", lambda: fig13(f, panels, progress))
  if "14" in f.figs:
    timed("fig14", lambda: fig14(f, out))
  if "16" in f.figs:
    timed("fig16", lambda: fig16(f, out))
  if "18" in f.figs:
    timed("fig18", lambda: {w: paper_figures.block_size_points(
        setting, w, rate=fixed_rate(panels, w, f.fixed_load),
        block_sizes=f.fig18_block_sizes, seed=f.seed,
        num_requests=n or paper_figures.default_requests(setting, w, f.seed),
        progress=progress) for w in ("sharegpt", "alpaca")})
  if "19" in f.figs:
    timed("fig19", lambda: {
        "microbenchmark": paper_figures.swap_vs_recompute(
            setting, block_sizes=f.fig18_block_sizes),
        "end_to_end": paper_figures.preemption_points(
            setting, rate=fixed_rate(panels, "sharegpt", f.fixed_load),
            block_sizes=f.fig19_block_sizes,
            num_requests=n or paper_figures.default_requests(setting, "sharegpt", f.seed),
            seed=f.seed, progress=progress)})
  return {"results": results, "seconds": seconds}


def main(f: Config, out):
  start, load0 = time.time(), os.getloadavg()[0]
  r = run(f, out)
  for name in ("fig13", "fig14", "fig18", "fig19"):
    if name in r["results"]:
      common.write_json(out / f"{name}.json", r["results"][name])
  res = dict(committed(out), **r["results"])
  rows = plots.summary_rows(res)
  load = {"start": load0, "end": os.getloadavg()[0], "cores": os.cpu_count()}
  this_run = {"figs": list(f.figs), "seconds": time.time() - start, "load_avg": load,
              "flags": f.flags()}
  before = _read(out / "summary.json") if (out / "summary.json").exists() else {}
  # A figure's last run counts; earlier runs of only figures run again drop out.
  # (Fig. 14 may run in parts by mode: a run of other modes stays.)
  runs = [p for p in before.get("runs", []) if set(p["figs"]) - set(f.figs) or (
      p["figs"] == ["14"] and set(p["flags"].get("fig14_modes", ())) - set(f.fig14_modes))]
  runs.append(this_run)
  summary = {"rows": rows, "seconds": dict(before.get("seconds", {}), **r["seconds"]),
             "total_seconds": sum(p["seconds"] for p in runs), "runs": runs,
             "load_avg": {"start": min(p["load_avg"]["start"] for p in runs),
                          "end": max(p["load_avg"]["end"] for p in runs),
                          "cores": os.cpu_count()},
             "flags": f.flags(), "versions": provenance.versions(),
             "machine": provenance.machine(), "code": provenance.code_version()}
  common.write_json(out / "summary.json", summary)
  pngs = plots.plot_all(res, out)
  print(common.table(rows, ["figure", "ours", "paper"]))
  print(f"{this_run['seconds']:.0f} s this run ({summary['total_seconds']:.0f} s for every "
        f"figure in {out}), load {load0:.1f} -> {load['end']:.1f} on {os.cpu_count()} cores; "
        f"wrote {out / 'summary.json'} and {len(pngs)} plots")


if __name__ == "__main__":
  common.run_app(main, Config)
