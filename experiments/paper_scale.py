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

The figures' independent parts (Fig. 12 / 16 panels, Fig. 13 panels, Fig. 14 modes, Fig. 18
points, Fig. 19 block sizes: `experiments.paper_scale_parts`) run in --jobs worker processes
(default: this machine's cores), longest first, a part that reads a Fig. 12 panel after it
(`experiments.task_graph`); --jobs=1 runs them one after another in this process. The
results do not depend on --jobs (virtual time); a line a part reports its progress.

Writes DIR/fig12/<model>-<workload>/serving_benchmark.json (the contract JSON, with
"device_model"), DIR/fig16/<fewshot-k>/serving_benchmark.json, DIR/fig13.json,
DIR/fig14.json, DIR/fig18.json, DIR/fig19.json, DIR/summary.json (ours beside the paper's
figures, seconds per figure and per part, jobs, the machine's load) and one PNG per
figure; each panel, Fig. 14 mode and whole figure is written as soon as its parts finish
(a failed or stopped run keeps them). A figure not in
--figs is read back from DIR when an earlier run wrote it (the suite may run in parts:
Fig. 13 / 18 / 19 take their rates from the Fig. 12 panels in DIR), and summary.json
covers every figure in DIR, each with the seconds and load of the run that made it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Dict, Tuple

from experiments import common
from experiments import configs
from experiments import paper_scale_parts as parts
from experiments import paper_scale_plots as plots
from experiments import provenance
from experiments import task_graph
from paged_jax.bench import sweep as serving_sweep

FIGS = ("12", "13", "14", "16", "18", "19")
GPU_OF = parts.GPU_OF


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
  jobs: int = configs.flag(0, "worker processes running the figures' parts side by side "
                           "(0: this machine's cores, at most 8; 1: one after another in "
                           "this process)", lower=0)
  out: str = configs.flag("results/paper_scale", "output directory")

  def check(self) -> None:
    if self.systems[:1] != ("paged",):
      raise ValueError(f"--systems must start with paged (its unloaded latency sets the SLO "
                       f"and its answer starts the others' searches), got {self.systems}")


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


# A worker whose memory maps stay above this after a part (its compiled steps dropped)
# is replaced by a fresh process (Linux's vm.max_map_count is 65,530; one compiled step
# shape maps ~650).
RETIRE_MAPS = 20_000


def _write(out, f: Config, part: str, results: Dict, before: Dict, written: set) -> None:
  """Writes what the part `part` finished: its panel, Fig. 14 with its mode, or its figure
  once every part of it is done."""
  fig = parts.figure_of(part)
  if fig in ("fig12", "fig16"):
    common.write_json(out / fig / part.split("/", 1)[1] / "serving_benchmark.json",
                      results[part])
    return
  figures = parts.figures(f, results, before.get("fig14"))
  if fig in figures and (fig == "fig14" or fig not in written):
    common.write_json(out / f"{fig}.json", figures[fig])
    written.add(fig)


def recorded_costs(out) -> Dict[str, float]:
  """CPU seconds of each part as the runs in out/summary.json measured it (the latest)."""
  path = out / "summary.json"
  if not path.exists():
    return {}
  costs = {}
  for r in _read(path).get("runs", []):
    costs.update({k: v["cpu_s"] for k, v in r.get("parts", {}).items() if "cpu_s" in v})
  return costs


def run(f: Config, out) -> Dict:
  """Runs the parts of `f.figs` in `f.jobs` processes into `out` (each panel, Fig. 14 mode
  and whole figure written as it completes). Returns {"results": {figure: result},
  "seconds": {figure: its parts' wall seconds summed}, "parts": {part: {"seconds",
  "cpu_s", "start_s", "end_s" (from the run's start), "worker", "load_avg_end"}},
  "jobs": processes used, "wall_s": the run's seconds}. A failed part raises
  task_graph.TaskFailed naming it; the parts done by then are written."""
  from paged_jax import compile_cache  # pylint: disable=g-import-not-at-top
  before = committed(out)
  jobs = f.jobs or task_graph.default_jobs()
  tasks = parts.tasks(f, before.get("fig12", {}), recorded_costs(out))
  results, record, written = {}, {}, set()
  t0 = time.time()

  def event(kind, name, info):
    now = time.time() - t0
    if kind == "start":
      record[name] = {"worker": info["worker"], "start_s": now}
      print(f"[{now / 60:5.1f} min] start {name} (worker {info['worker']})", file=sys.stderr,
            flush=True)
      return
    results[name] = info["result"]
    record[name].update(seconds=info["seconds"], cpu_s=info["cpu_s"], end_s=now,
                        load_avg_end=info["load_avg_end"])
    _write(out, f, name, results, before, written)
    print(f"[{now / 60:5.1f} min] done  {name}: {info['seconds']:.0f} s wall, "
          f"{info['cpu_s']:.0f} s CPU (worker {info['worker']}; {len(results)}/{len(tasks)} "
          f"parts; load {info['load_avg_end']:.1f})", file=sys.stderr, flush=True)

  cache = compile_cache.directory()
  task_graph.run(tasks, jobs, init=parts.worker_init,
                 init_args=(cache or "none", provenance.code_version()),
                 after_part=parts.after_part, on_event=event, retire_maps=RETIRE_MAPS)
  figures = parts.figures(f, results, before.get("fig14"))
  seconds = {}
  for name, r in record.items():
    fig = parts.figure_of(name)
    seconds[fig] = seconds.get(fig, 0.0) + r["seconds"]
  return {"results": figures, "seconds": seconds, "parts": record,
          "jobs": min(jobs, len(tasks)) or 1, "wall_s": time.time() - t0}



def main(f: Config, out):
  start, load0 = time.time(), os.getloadavg()[0]
  try:
    r = run(f, out)
  except task_graph.TaskFailed as e:
    sys.exit(f"error: {common.one_line(e)} (the parts finished before it are in {out})")
  except KeyboardInterrupt:
    sys.exit(f"interrupted: workers stopped; the parts finished before it are in {out}")
  res = dict(committed(out), **r["results"])
  rows = plots.summary_rows(res)
  loads = [p["load_avg_end"] for p in r["parts"].values()]
  load = {"start": load0, "end": os.getloadavg()[0], "max_at_part_end": max(loads, default=0.0),
          "cores": os.cpu_count()}
  this_run = {"figs": list(f.figs), "seconds": time.time() - start, "jobs": r["jobs"],
              "parts": r["parts"], "load_avg": load, "flags": f.flags()}
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
  print(f"{this_run['seconds']:.0f} s this run in {r['jobs']} process(es), "
        f"{sum(p['cpu_s'] for p in r['parts'].values()):.0f} CPU s over "
        f"{len(r['parts'])} parts ({summary['total_seconds']:.0f} s for every figure in "
        f"{out}), load {load0:.1f} -> {load['end']:.1f} on {os.cpu_count()} cores; wrote "
        f"{out / 'summary.json'} and {len(pngs)} plots")


if __name__ == "__main__":
  common.run_app(main, Config)
