"""The parts of `experiments.paper_scale`: each figure split where its points are
independent, as a task graph (`experiments.task_graph`) the suite runs in --jobs
worker processes.

    tasks = paper_scale_parts.tasks(config, committed_panels)     # [task_graph.Task]
    results = task_graph.run(tasks, jobs=2, init=paper_scale_parts.worker_init, ...)
    figures = paper_scale_parts.figures(config, results)         # {"fig12": ..., "fig18": ...}

Parts (names): fig12/<model>-<workload> (one `serving_benchmark --rates=auto` panel),
fig13/<panel> (every system of a Fig. 12 panel at one rate; `fig13` alone with
--fig13_load=0), fig14/<mode>, fig16/<fewshot-k>, fig18/<workload>/<block size> (one
point), fig19/<block size> (recompute and swap). Fig. 13, 18 and 19 read paged's max
rate of the OPT-13B Fig. 12 panels: a panel this run makes is an input of the part (it
waits for it), else the panel an earlier run wrote to --out is an argument.

Every result is virtual time (the model clock) and the same whichever process runs a
part and in what order; only measured host seconds and compile counts differ.
`PART_COST_S` are the parts' expected seconds, for the schedule only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, List, Optional

from experiments import common
from experiments import paper_figures
from experiments import serving_benchmark as sb
from experiments import task_graph
from paged_jax.bench import latency
from paged_jax.bench import paper_scale
from paged_jax.bench import sweep as serving_sweep

GPU_OF = {"opt-13b": "a100-40gb", "opt-66b": "a100-40gb", "opt-175b": "a100-80gb"}   # Table 1
FALLBACK_RATE = {"sharegpt": 4.0, "alpaca": 80.0}   # Fig. 18 / 19 without a Fig. 12 panel

# Expected wall seconds of each part on this 2-core machine, alone (the schedule's
# priorities; a summary.json in --out with measured part seconds overrides them). From the
# quiet serial timing of 2026-12-03 (`paper_scale/suite_timing/`: Fig. 12 1,140 s, 13
# 115, 14 743, 16 109, 18 313, 19 183), each figure's seconds shared out by its parts'
# committed seconds (Fig. 12 / 16 panels, Fig. 14 modes' CPU seconds) or engine steps
# (Fig. 13 panels, Fig. 18 / 19 points). docs/paper_scale.md: the 2-worker estimate.
PART_COST_S = {
    "fig12/opt-13b-sharegpt": 203.0, "fig12/opt-13b-alpaca": 164.0,
    "fig12/opt-66b-sharegpt": 148.0, "fig12/opt-66b-alpaca": 134.0,
    "fig12/opt-175b-sharegpt": 336.0, "fig12/opt-175b-alpaca": 155.0,
    "fig13/opt-13b-sharegpt": 77.0, "fig13/opt-13b-alpaca": 38.0, "fig13": 1.0,
    "fig14/n2": 175.0, "fig14/n4": 113.0, "fig14/n6": 126.0,
    "fig14/beam2": 128.0, "fig14/beam4": 97.0, "fig14/beam6": 104.0,
    "fig16/fewshot-1": 48.0, "fig16/fewshot-5": 61.0,
    **{f"fig18/sharegpt/{b}": s for b, s in ((1, 27.3), (2, 27.3), (4, 27.3), (8, 27.3),
                                             (16, 27.4), (32, 27.5), (64, 27.5),
                                             (128, 28.1), (256, 30.0))},
    **{f"fig18/alpaca/{b}": s for b, s in ((1, 6.6), (2, 6.6), (4, 6.6), (8, 6.6), (16, 6.6),
                                           (32, 6.6), (64, 6.6), (128, 6.9), (256, 10.2))},
    **{f"fig19/{b}": s for b, s in ((8, 30.2), (16, 30.3), (32, 30.4), (64, 30.4),
                                    (128, 31.0), (256, 33.0))},
}
DEFAULT_COST_S = 30.0


def sb_config(f, **kw) -> sb.Config:
  """The serving_benchmark settings of a suite panel (`f`: paper_scale.Config)."""
  return sb.Config(clock="model", rates=("auto",), num_requests=f.num_requests,
                   max_points=f.max_points, slo_factor=f.slo_factor, seed=f.seed,
                   preemption_mode="auto", out=f.out, **kw)


def fixed_rate(panel: Optional[Dict], workload: str, load: float) -> float:
  """Fig. 18 / 19's rate: `load` x paged's OPT-13B max rate from its Fig. 12 panel (None:
  the figure's fallback rate)."""
  return FALLBACK_RATE[workload] if panel is None else load * latency.max_rate(panel, "paged")


# The parts (module-level: a spawned worker imports them).

def fig12_panel(f, model: str, workload: str) -> Dict:
  return sb.run(sb_config(f, model=model, gpu=GPU_OF[model], workload=workload,
                          systems=f.systems))


def fig13_panel(f, name: str, panel: Dict) -> Dict:
  """Fig. 13 of one panel: every system at ONE rate, fig13_load x paged's max rate at the
  SLO (past every system's knee), as the paper reads its Fig. 13."""
  model, workload = name.rsplit("-", 1)
  knee = latency.max_rate(panel, "paged")
  out = paper_figures.batched_at_rate(paper_scale.setting(model, GPU_OF[model]), panel,
                                      workload, rate=f.fig13_load * knee, seed=f.seed,
                                      progress=_progress)
  for v in out.values():
    v["rate_rule"] = (f"{f.fig13_load:g} x paged's Fig. 12 max rate at the SLO "
                      f"({knee:.3g} req/s), every system at this one rate")
  return out


def fig13_highest(committed_panels: Dict, **panels) -> Dict:
  """Fig. 13 with fig13_load 0: each system's highest Fig. 12 point of every panel."""
  every = dict(committed_panels, **panels)
  return {k: paper_figures.batched_requests(v) for k, v in sorted(every.items())}


def fig14_mode(f, mode: str) -> Dict:
  """Fig. 14, one sampling mode: paged vs Orca(Oracle) max rate at the SLO, OPT-13B
  Alpaca-like, preempting by --fig14_preemption. Its two systems' engines share two
  geometries, so the compiled steps stay between them (dropped after the part)."""
  cfg = dataclasses.replace(sb_config(f, model="opt-13b", gpu=GPU_OF["opt-13b"],
                                      workload="alpaca"), preemption_mode=f.fig14_preemption)
  kw = serving_sweep.FIG14_MODES[mode]
  t0, c0 = time.time(), time.process_time()
  res = sb.rated(sb.sweep(cfg, ["paged", "orca_oracle"], ("auto",), 0.0, kw, release=False),
                 cfg, ())
  res["paged_rate_ratio"] = latency.rate_ratios(res["max_rate_at_slo"])
  points = sum(len(c["rates"]) for c in res["systems"].values())
  res["cost"] = {"wall_s": time.time() - t0, "cpu_s": time.process_time() - c0,
                 "points": points, "load_avg_end": os.getloadavg()[0]}
  return dict(res, mode=kw)


def fig16_panel(f, workload: str) -> Dict:
  # system_sizes counts paged's cached prefix once (its slots and the requests a point
  # serves: 4 x what its memory holds with the prefix shared).
  return sb.run(sb_config(f, model="llama-13b", gpu="a100-40gb", workload=workload,
                          prefix_caching=True, systems=("paged", "orca_oracle")))


def _requests(f, setting, workload: str) -> int:
  return f.num_requests or paper_figures.default_requests(setting, workload, f.seed)


def fig18_point(f, workload: str, block_size: int, panel: Optional[Dict] = None) -> Dict:
  """Fig. 18, one block size: paged at fixed_load x its Fig. 12 max rate."""
  setting = paper_scale.setting("opt-13b", GPU_OF["opt-13b"])
  return paper_figures.block_size_points(
      setting, workload, rate=fixed_rate(panel, workload, f.fixed_load),
      block_sizes=(block_size,), seed=f.seed, num_requests=_requests(f, setting, workload),
      progress=_progress)[0]


def fig19_points(f, block_size: int, panel: Optional[Dict] = None) -> List[Dict]:
  """Fig. 19b, one block size: recompute and swap preemption, ShareGPT-like."""
  setting = paper_scale.setting("opt-13b", GPU_OF["opt-13b"])
  return paper_figures.preemption_points(
      setting, rate=fixed_rate(panel, "sharegpt", f.fixed_load), block_sizes=(block_size,),
      num_requests=_requests(f, setting, "sharegpt"), seed=f.seed, progress=_progress)


def _progress(total, desc):
  return common.progress(total=total, desc=desc)


def worker_init(compilation_cache: str, code: Dict) -> None:
  """A spawned worker's set-up: the parent's compilation cache and code reading, no
  progress bars (the parent prints a line a part)."""
  import threading  # pylint: disable=g-import-not-at-top
  import tqdm  # pylint: disable=g-import-not-at-top
  from experiments import provenance  # pylint: disable=g-import-not-at-top
  # tqdm's default lock holds a multiprocessing semaphore, which a terminated worker
  # leaves behind (the resource tracker warns at exit): a thread lock does here.
  tqdm.tqdm.set_lock(threading.RLock())
  common.PROGRESS_BARS = False
  common.use_compilation_cache(compilation_cache)
  provenance.remember_code_as(code)


def after_part() -> None:
  """Drops every compiled executable after a part (each part starts bare: a worker holds
  at most one part's shapes, as the serial suite holds one figure's)."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  release_compiled()


def tasks(f, committed_panels: Dict, costs: Optional[Dict[str, float]] = None
          ) -> List[task_graph.Task]:
  """The parts of `f.figs` (`f`: paper_scale.Config); `committed_panels`: the Fig. 12
  panels already in --out ({name: serving_benchmark JSON}); `costs`: measured part
  seconds overriding PART_COST_S."""
  cost = dict(PART_COST_S, **(costs or {}))
  out: List[task_graph.Task] = []

  def add(name, fn, *args, inputs=None, **kw):
    out.append(task_graph.Task(name, fn, args=(f,) + args, kwargs=kw, inputs=inputs or {},
                               cost=cost.get(name, DEFAULT_COST_S)))

  made = set()
  if "12" in f.figs:
    for model in f.fig12_models:
      for workload in f.fig12_workloads:
        add(f"fig12/{model}-{workload}", fig12_panel, model, workload)
        made.add(f"{model}-{workload}")
  known = made | set(committed_panels)

  def panel_arg(name):
    """(inputs, kwargs) handing the panel `name` to a part: waited for, or as read."""
    if name in made:
      return {"panel": f"fig12/{name}"}, {}
    return {}, {"panel": committed_panels.get(name)}

  if "13" in f.figs:
    if not known:
      raise ValueError("--figs=13 reads Fig. 12's points: add 12 to --figs or run it into "
                       "--out first")
    if not f.fig13_load:
      out.append(task_graph.Task(
          "fig13", fig13_highest, args=(
              {k: v for k, v in committed_panels.items() if k not in made},),
          inputs={p: f"fig12/{p}" for p in sorted(made)},
          cost=cost.get("fig13", 1.0)))
    else:
      missing = [p for p in f.fig13_panels if p not in known]
      if missing:
        raise ValueError(f"--fig13_panels {', '.join(missing)} have no Fig. 12 run: add 12 "
                         f"to --figs or run them into --out first")
      for name in f.fig13_panels:
        inputs, kw = panel_arg(name)
        add(f"fig13/{name}", fig13_panel, name, inputs=inputs, **kw)
  if "14" in f.figs:
    for mode in f.fig14_modes:
      add(f"fig14/{mode}", fig14_mode, mode)
  if "16" in f.figs:
    for workload in serving_sweep.FEW_SHOT:
      add(f"fig16/{workload}", fig16_panel, workload)
  if "18" in f.figs:
    for workload in ("sharegpt", "alpaca"):
      inputs, kw = panel_arg(f"opt-13b-{workload}")
      for bs in f.fig18_block_sizes:
        add(f"fig18/{workload}/{bs}", fig18_point, workload, bs, inputs=inputs, **kw)
  if "19" in f.figs:
    inputs, kw = panel_arg("opt-13b-sharegpt")
    for bs in f.fig19_block_sizes:
      add(f"fig19/{bs}", fig19_points, bs, inputs=inputs, **kw)
  return out


def figure_of(part: str) -> str:
  """'fig18/sharegpt/16' -> 'fig18'."""
  return part.split("/", 1)[0]


def figures(f, results: Dict[str, Dict], before_fig14: Optional[Dict] = None) -> Dict:
  """The figures' results from their parts' ({part: result}); a figure whose parts are
  not all in `results` is left out (Fig. 12 / 16 / 14: the panels and modes there are).
  Fig. 14 keeps the modes of `before_fig14` (an earlier run's fig14.json) this run does
  not redo."""
  of = lambda fig: {k.split("/", 1)[1]: v for k, v in results.items() if figure_of(k) == fig}
  out = {}
  for fig in ("fig12", "fig16"):
    if fig[3:] in f.figs and of(fig):
      out[fig] = of(fig)
  if "13" in f.figs:
    if "fig13" in results:
      out["fig13"] = results["fig13"]
    elif all(f"fig13/{p}" in results for p in f.fig13_panels):
      out["fig13"] = {p: results[f"fig13/{p}"] for p in f.fig13_panels}
  if "14" in f.figs and of("fig14"):
    out["fig14"] = fig14_merged(f, of("fig14"), before_fig14 or {})
  if "18" in f.figs and all(f"fig18/{w}/{bs}" in results for w in ("sharegpt", "alpaca")
                            for bs in f.fig18_block_sizes):
    out["fig18"] = {w: [results[f"fig18/{w}/{bs}"] for bs in f.fig18_block_sizes]
                    for w in ("sharegpt", "alpaca")}
  if "19" in f.figs and all(f"fig19/{bs}" in results for bs in f.fig19_block_sizes):
    setting = paper_scale.setting("opt-13b", GPU_OF["opt-13b"])
    out["fig19"] = {"microbenchmark": paper_figures.swap_vs_recompute(
                        setting, block_sizes=f.fig18_block_sizes),
                    "end_to_end": [r for bs in f.fig19_block_sizes
                                   for r in results[f"fig19/{bs}"]]}
  return out


def fig14_merged(f, modes: Dict, before: Dict) -> Dict:
  """This run's Fig. 14 modes with an earlier run's modes it does not redo, in
  FIG14_MODES order (the figure may run in parts: n2,n4,n6 then beam2,beam4,beam6)."""
  every = dict({m: v for m, v in before.items() if m not in f.fig14_modes}, **modes)
  order = list(serving_sweep.FIG14_MODES)
  return dict(sorted(every.items(), key=lambda kv: order.index(kv[0])))

