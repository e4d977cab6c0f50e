"""Renderers of the paper-scale results (tools/render_results.py sections paper_scale,
paper_scale_rates, perf_validation): the committed JSON of experiments.paper_scale and
experiments.perf_validation, our figures beside the paper's."""

from __future__ import annotations

import os

from render_common import load, table

PAPER_SCALE = "paper_scale"


def paper_scale(summary) -> str:
  """[figure, ours, paper] as experiments.paper_scale printed them, then its cost line."""
  rows = [list(r) for r in summary["rows"]]
  load_avg = summary["load_avg"]
  rows.append(["run time of these figures on this machine",
               f"{summary['total_seconds'] / 60:.0f} min at load {load_avg['start']:.1f}"
               f"-{load_avg['end']:.1f} on {load_avg['cores']} cores", "-"])
  return table(rows, ["figure (paper scale, model clock)", "ours", "paper"])


def paper_scale_rates(results_dir: str) -> str:
  """Every committed Fig. 12 / 16 panel: each system's max rate at the SLO (req/s)."""
  rows = []
  for fig in ("fig12", "fig16"):
    base = os.path.join(results_dir, PAPER_SCALE, fig)
    if not os.path.isdir(base):
      continue
    for panel in sorted(os.listdir(base)):
      res = load(base, os.path.join(panel, "serving_benchmark.json"))
      dm = res["device_model"]
      rates = res["max_rate_at_slo_interpolated"]
      cells = []
      for name in ("paged", "orca_oracle", "orca_pow2", "orca_max"):
        r = rates.get(name) or res["max_rate_at_slo"].get(name)
        cells.append("-" if r is None else f"{r:.3g}")
      rows.append([f"Fig. {fig[3:]} {panel}", f"{dm['tp']} x {dm['gpu']['name']}",
                   f"{res['kv_budget_tokens']:,}", f"{res['slo_s_per_token']:.3f}", *cells])
  if not rows:
    raise FileNotFoundError(f"{results_dir}/{PAPER_SCALE}/fig12: no committed result "
                            f"(run experiments.paper_scale)")
  return table(rows, ["panel", "GPUs", "KV slots", "SLO s/token", "paged", "Orca(Oracle)",
                      "Orca(Pow2)", "Orca(Max)"])


def perf_validation(res) -> str:
  """Measured vs predicted max rate of each system (CPU wall clock, the tiny model)."""
  rows = []
  for name, v in res["systems"].items():
    err = v["rel_error"]
    rows.append([name, f"{v['measured_max_rate']:.3g}", f"{v['predicted_max_rate']:.3g}",
                 "-" if err is None else f"{err:+.0%}"])
  fit = res["fit"]
  rows.append(["fit", f"{fit['calibration_steps']} steps, {fit['grouped_steps']} groups",
               f"mean step error {fit['mean_abs_rel_error']:.0%}",
               f"load {res['load_avg']['mean']:.1f} on {res['load_avg']['cores']} cores"])
  return table(rows, ["system", "measured max rate (req/s)", "predicted", "error"])
