"""Renderers of the paper-scale results (tools/render_results.py sections paper_scale,
paper_scale_rates, perf_validation): the committed JSON of experiments.paper_scale and
experiments.perf_validation, our figures beside the paper's."""

from __future__ import annotations

import os

import numpy as np

from render_common import load, table

PAPER_SCALE = "paper_scale"


def paper_scale(summary) -> str:
  """[figure, ours, paper] as experiments.paper_scale printed them, then its cost line."""
  rows = [list(r) for r in summary["rows"]]
  load_avg = summary["load_avg"]
  # The committed figures came from several part runs, some side by side: their seconds
  # summed (the whole suite timed in one run: section paper_scale_suite_time).
  rows.append(["seconds of the runs that made these figures, summed",
               f"{summary['total_seconds'] / 60:.0f} min at load {load_avg['start']:.1f}"
               f"-{load_avg['end']:.1f} on {load_avg['cores']} cores", "-"])
  return table(rows, ["figure (paper scale, model clock)", "ours", "paper"])


def paper_scale_suite_time(summary) -> str:
  """One timed run of the whole suite: wall clock, workers, each figure's part seconds."""
  run = summary["runs"][-1]
  parts = run["parts"]
  load_avg = summary["load_avg"]
  rows = [["the whole suite", f"{run['jobs']}",
           f"{run['seconds']:,.0f} s = {run['seconds'] / 60:.1f} min",
           f"{sum(p['cpu_s'] for p in parts.values()):,.0f} CPU s over {len(parts)} parts; "
           f"load {load_avg['start']:.1f}-{load_avg['end']:.1f} on {load_avg['cores']} cores; "
           f"code {summary['code']['git_commit'][:7]}"]]
  for fig, seconds in summary["seconds"].items():
    n = sum(1 for name in parts if name.split("/")[0] == fig)
    rows.append([f"Fig. {fig[3:]}", "", f"{seconds:,.0f} s over {n} part(s)", ""])
  return table(rows, ["what", "workers", "wall seconds", "CPU, load, code"])


def paper_scale_rates(results_dir: str) -> str:
  """Every committed Fig. 12 / 16 panel: each system's max rate at the SLO (req/s)."""
  rows = []
  for fig in ("fig12", "fig12_real", "fig16"):
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
      rows.append([f"Fig. {fig[3:5]} {panel}", f"{dm['tp']} x {dm['gpu']['name']}",
                   f"{res['kv_budget_tokens']:,}", f"{res['slo_s_per_token']:.3f}", *cells])
  fig14 = os.path.join(results_dir, PAPER_SCALE, "fig14.json")
  if os.path.exists(fig14):   # OPT-13B on one A100-40GB (experiments.paper_scale.fig14)
    for mode, res in load(os.path.dirname(fig14), "fig14.json").items():
      rates = res["max_rate_at_slo_interpolated"]
      cells = [("-" if r is None else f"{'' if rates.get(name) else '>='}{r:.3g}")
               for name in ("paged", "orca_oracle")
               for r in [rates.get(name) or res["max_rate_at_slo"].get(name)]]
      rows.append([f"Fig. 14 opt-13b-alpaca {mode}", "1 x a100-40gb",
                   f"{res['sizes']['paged']['pool_tokens']:,}",
                   f"{res['slo_s_per_token']:.3f}", *cells, "-", "-"])
  if not rows:
    raise FileNotFoundError(f"{results_dir}/{PAPER_SCALE}/fig12: no committed result "
                            f"(run experiments.paper_scale)")
  return table(rows, ["panel", "GPUs", "KV slots", "SLO s/token", "paged", "Orca(Oracle)",
                      "Orca(Pow2)", "Orca(Max)"])


def _rate_cell(rate, censored, bound) -> str:
  """A max rate at the SLO: ">= x" censored above (never over the SLO up to x), "< x"
  censored below (over it at every rate down to x), else the rate."""
  if rate is None:
    return f"< {bound:.3g}" if bound else "-"
  return f"{'>= ' if censored else ''}{rate:.3g}"


def _raw_cell(v) -> str:
  """The search's own crossing and the error against it, where the judged crossing is
  the speed-normalized one (`perf_validation_search.judge` with the fit); else "-"."""
  raw, err = v.get("measured_raw_crossing"), v.get("rel_error_raw")
  if v.get("measured_speed_normalized") is None or raw is None:
    return "-"
  return f"{raw:.3g} ({'-' if err is None else f'{err:+.1%}'})"


def perf_validation(res) -> str:
  """Measured vs predicted max rate of each system (the tiny model on this CPU, on the
  run's truth clock: CPU seconds or wall): at each sweep's own SLO (the target's figure)
  and at the measured SLO; the largest spread of the measured point's repeats; the load
  factors the prediction's points were scaled by; the crossing of each repeat's own curve
  (`validation.single_run_crossings`: how far one run of the machine moves the measured
  figure); the search's own crossing where the judged one is read at one speed; then
  the fit, the truth and the load."""
  from paged_jax.bench import validation  # pylint: disable=g-import-not-at-top
  rows = []
  for name, v in res["systems"].items():
    ones = [x for x in validation.single_run_crossings(v["measured"],
                                                       res["measured_slo_s_per_token"]) if x]
    one_spread = validation.crossing_spread(ones)
    err = v["rel_error"]
    at_slo = v.get("predicted_max_rate_at_measured_slo")
    factors = v["predicted"].get("load_factor") or [1.0]
    spread = [x for x in v.get("measured_repeat_spread") or [] if x is not None]
    m_cens, p_cens = v.get("measured_censored"), v.get("predicted_censored")
    rows.append([_LABEL.get(name, name),   # >= x: still under the SLO at the highest rate
                 _rate_cell(v["measured_max_rate"], m_cens, v.get("measured_bound")),
                 _rate_cell(v["predicted_max_rate"], p_cens, None),
                 "-" if err is None else f"{'>= ' if p_cens and err > 0 else ''}{err:+.1%}",
                 "-" if at_slo is None else f"{at_slo:.3g}",
                 f"{max(spread):.0%}" if spread else "-",
                 f"{min(factors):.2f}-{max(factors):.2f}",
                 f"{min(ones):.3g}-{max(ones):.3g} ({one_spread:.0%})" if one_spread is not None
                 else "-", _raw_cell(v)])
  fit = res["fit"]
  load = res["load_avg"]
  truth = res.get("truth", {"clock": "wall", "repeats": 1})
  rows.append(["fit", f"{fit['calibration_steps']} steps", f"{fit['grouped_steps']} groups",
               f"mean step error {fit['mean_abs_rel_error']:.0%}",
               f"{truth['clock']} clock, {truth['repeats']} run(s) a point",
               f"load {min(load['during_measured_points']):.1f}-"
               f"{max(load['during_measured_points']):.1f}", f"{load['cores']} cores", "", ""])
  return table(rows, ["system", "measured max rate (req/s)", "predicted", "error",
                      "predicted at the measured SLO", "repeats' latency spread",
                      "load factors", "one run's crossing (spread)",
                      "the search's own crossing (error)"])


def perf_validation_paired(res) -> str:
  """`perf_validation --predict=paired`: the measured crossing, the bracket it lies in,
  the paired prediction's crossing and error, whether the predicted medians fall on the
  measured sides of the SLO at both ends, and each paired run's latency error."""
  rows = []
  for name, v in res["systems"].items():
    m, p = v["measured"], v["predicted"]
    lo, hi = p["rates"] if len(p["rates"]) == 2 else (None, None)   # the bracket's ends
    err = v["rel_error"]
    runs = [e for _, e in v.get("paired_latency_errors") or []]
    sides = "-"
    if lo is not None:
      med = lambda c, r: c["normalized_latency_s_per_token"][c["rates"].index(r)]
      ms, ps = res["measured_slo_s_per_token"], res["predicted_slo_s_per_token"]
      sides = "yes" if ((med(m, lo) <= ms) == (med(p, lo) <= ps)
                        and (med(m, hi) <= ms) == (med(p, hi) <= ps)) else "no"
    rows.append([_LABEL.get(name, name), f"{v['measured_max_rate']:.3g}",
                 "-" if lo is None else f"{lo:.4g}-{hi:.4g} ({hi / lo - 1:.1%})",
                 f"{v['predicted_max_rate']:.3g}",
                 "-" if err is None else f"{err:+.1%}", sides,
                 f"{np.median(np.abs(runs)):.0%} ({min(runs):+.0%} to {max(runs):+.0%})"
                 if runs else "-"])
  load = res["load_avg"]["during_measured_points"]
  rows.append(["load", f"{min(load):.1f}-{max(load):.1f}", "", "", "", "",
               f"XLA_FLAGS: {res.get('xla_flags') or 'default'}"])
  return table(rows, ["system", "measured max rate (req/s)", "bracket (width)",
                      "paired prediction", "error", "medians on the measured sides",
                      "paired runs' latency error: median |x| (range)"])


# perf_validation runs re-predicted from their measured files with the median load factor.
REPREDICTED = (("E", "one_thread"), ("F", "one_thread_2"), ("G", "one_thread_3"),
               ("H", "quiet_one_thread"))
# ... and every run with run steps kept, re-judged at one speed (DIR/speed_normalized), then
# the runs made with that rule (their own directory).
REJUDGED = (("A", "."), ("B", "repeat")) + REPREDICTED + (
    ("I", "interleaved_1"), ("J", "interleaved_2"), ("K", "interleaved_3_busy"))
SPEED_NORMALIZED_RUNS = (("L", "normalized_1"), ("M", "normalized_2"))


def perf_validation_repredicted(results_dir) -> str:
  """Each REPREDICTED run's error per system as committed (the pooled load factor) and
  re-predicted from its measured file with the median factor (DIR/median_factor)."""
  rows = []
  for label, run in REPREDICTED:
    old = load(results_dir, f"perf_validation/{run}/perf_validation.json")["systems"]
    new = load(results_dir, f"perf_validation/{run}/median_factor/perf_validation.json")
    cells = [f"{old[s]['rel_error']:+.1%} -> {new['systems'][s]['rel_error']:+.1%}"
             for s in new["systems"]]
    rows.append([label, *cells, f"{new['max_abs_rel_error']:.1%}"])
  return table(rows, ["run", *(_LABEL.get(s, s) for s in new["systems"]),
                      "worst, median factor"])


def perf_validation_speed_normalized(results_dir) -> str:
  """Per run (REJUDGED re-judged, then SPEED_NORMALIZED_RUNS): its load, and each
  system's error against the search's own crossing -> against the crossing read at the
  median run's speed (runs dropped off it, a crossing outside the mapped rates), the
  worst, and whether within 5%."""
  pct = lambda x: "censored" if x is None else f"{x:+.1%}"
  rows = []
  runs = ([(label, f"{run}/speed_normalized") for label, run in REJUDGED]
          + list(SPEED_NORMALIZED_RUNS))
  for label, path in runs:
    res = load(results_dir, f"perf_validation/{path}/perf_validation.json")
    cells = []
    for v in res["systems"].values():
      norm = v.get("measured_speed_normalized") or {}
      notes = ([f"{norm['dropped']} dropped"] if norm.get("dropped") else []) + (
          ["extrapolated"] if norm.get("extrapolated") else [])
      cells.append(f"{pct(v['rel_error_raw'])} -> {pct(v['rel_error'])}"
                   + (f" ({', '.join(notes)})" if notes else ""))
    worst = res["max_abs_rel_error"]
    rows.append([label, f"{res['load_avg']['mean']:.1f}", *cells,
                 "-" if worst is None else f"{worst:.1%}",
                 "yes" if res["within_target"] else "no"])
  return table(rows, ["run", "load (mean)", *(_LABEL.get(s, s) for s in res["systems"]),
                      "worst", "within 5%, none censored"])


# The paper's stated figures as checks (Kwon et al., SOSP 2023): ranges as stated; a single
# value (Fig. 13, 16) counts as met within POINT_TOLERANCE of it (our stream and engine are
# not the paper's: the check asks for the same size of effect, not the same digits).
POINT_TOLERANCE = 0.25
FIG12_RANGES = {"orca_oracle": (1.7, 2.7), "orca_max": (2.7, 8.0)}   # ShareGPT, 3 sizes
FIG13_POINTS = {"orca_oracle": 2.2, "orca_max": 4.3}                  # OPT-13B ShareGPT
FIG14_BEAM6 = 2.3                                                     # OPT-13B Alpaca
FIG16_POINTS = {"fewshot-1": 1.67, "fewshot-5": 3.58}                 # LLaMA-13B
FIG18_RANGES = {"sharegpt": (16, 128), "alpaca": (16, 32)}            # best block size
FIG19_COMPARABLE = (16, 64, 0.8, 1.25)   # block sizes whose swap / recompute latency ~ 1
_LABEL = {"orca_oracle": "Orca(Oracle)", "orca_pow2": "Orca(Pow2)", "orca_max": "Orca(Max)"}


def _max_rate(res, name):
  return res["max_rate_at_slo_interpolated"].get(name) or res["max_rate_at_slo"].get(name)


class Ratio(float):
  """paged / other max rate; `bound` ">=" where paged never crossed the SLO (its rate is a
  floor), "<=" where the other never did, "" where both crossed (exact), "?" neither."""
  bound = ""


def _paged_over(res, name):
  p, o = _max_rate(res, "paged"), _max_rate(res, name)
  if not p or not o:
    return None
  crossed = res["max_rate_at_slo_interpolated"]
  r = Ratio(p / o)
  r.bound = {(True, True): "", (False, True): ">=", (True, False): "<=",
             (False, False): "?"}[(bool(crossed.get("paged")), bool(crossed.get(name)))]
  return r


def _verdict(ok) -> str:
  return {None: "n/a", True: "met", False: "NOT met", "open": "open (a bound)"}[ok]


def _in(v, lo, hi):
  """True / False, or "open" where a bound leaves it undecided."""
  if v is None:
    return None
  bound = getattr(v, "bound", "")
  if bound == ">=":
    return False if v > hi else "open"
  if bound == "<=":
    return False if v < lo else "open"
  return "open" if bound == "?" else lo <= v <= hi


def _near(v, point):
  return _in(v, point * (1 - POINT_TOLERANCE), point * (1 + POINT_TOLERANCE))


def _x(v):
  return "n/a" if v is None else f"{getattr(v, 'bound', '')}{v:.2f}x"


def paper_targets(results_dir: str) -> str:
  """Each of the paper's stated figures beside ours and whether ours is inside it."""
  base = os.path.join(results_dir, PAPER_SCALE)
  rows = []
  panels = {}
  # fig12_real: the ShareGPT trace (sharegpt-real); fig12_long: a panel rerun on a longer
  # stream (its request count in the row's name).
  for fig in ("fig12", "fig12_real", "fig12_long"):
    d = os.path.join(base, fig)
    if os.path.isdir(d):
      for p in sorted(os.listdir(d)):
        res = load(d, os.path.join(p, "serving_benchmark.json"))
        key = p if fig != "fig12_long" else f"{p}, {res['num_requests']:,} requests a point"
        panels[key] = res
        # experiments.rate_points: the same panel with points added near its crossings.
        if os.path.exists(os.path.join(d, p, "refined", "rate_points.json")):
          panels[f"{key}, refined"] = load(d, os.path.join(p, "refined", "rate_points.json"))
  for panel, res in panels.items():
    if "-sharegpt" not in panel:
      continue
    for name, (lo, hi) in FIG12_RANGES.items():
      v = _paged_over(res, name)
      rows.append([f"Fig. 12 {panel}: max rate paged / {_LABEL[name]}", f"{lo}-{hi}x", _x(v),
                   _verdict(_in(v, lo, hi))])
  small, large = panels.get("opt-13b-alpaca"), panels.get("opt-175b-alpaca")
  if small and large:
    a, b = _paged_over(small, "orca_oracle"), _paged_over(large, "orca_oracle")
    exact = a is not None and b is not None and not (a.bound or b.bound)
    rows.append(["Fig. 12f: Alpaca-like, paged's edge over Orca(Oracle) smaller at OPT-175B "
                 "than at OPT-13B", "smaller", f"{_x(b)} vs {_x(a)}",
                 _verdict(None if a is None or b is None else (b < a if exact else "open"))])
  if os.path.exists(os.path.join(base, "fig13.json")):
    # The mean over the steps while requests wait (the saturated regime the paper's long
    # trace is made of) where the run recorded per-step counts; else over every step.
    fig13 = load(base, "fig13.json").get("opt-13b-sharegpt", {})
    for name, point in FIG13_POINTS.items():
      entry = fig13.get(name, {})
      waiting = "paged_over_while_waiting" in entry
      v = entry.get("paged_over_while_waiting" if waiting else "paged_over")
      v = None if v is None else Ratio(v)
      rows.append([f"Fig. 13 opt-13b-sharegpt: requests batched"
                   f"{' while requests wait' if waiting else ''}, paged / {_LABEL[name]}",
                   f"{point}x", _x(v), _verdict(_near(v, point))])
  if os.path.exists(os.path.join(base, "fig14.json")):
    fig14 = load(base, "fig14.json")
    for kind, label in (("n", "parallel sampling n"), ("beam", "beam width")):
      modes = sorted((int(m[len(kind):]), m) for m in fig14 if m[:-1] == kind)
      vals = [_paged_over(fig14[m], "orca_oracle") for _, m in modes]
      grows = None if None in vals or len(vals) < 2 else all(
          b >= a for a, b in zip(vals, vals[1:]))
      if modes:
        rows.append([f"Fig. 14 OPT-13B Alpaca-like: paged / Orca(Oracle) grows with {label}",
                     "grows", ", ".join(f"{k}: {_x(v)}" for (k, _), v in zip(modes, vals)),
                     _verdict(grows)])
    if "beam6" in fig14:
      v = _paged_over(fig14["beam6"], "orca_oracle")
      rows.append(["Fig. 14 OPT-13B Alpaca-like: max rate paged / Orca(Oracle), beam width 6",
                   f"{FIG14_BEAM6}x", _x(v), _verdict(_near(v, FIG14_BEAM6))])
  for workload, point in FIG16_POINTS.items():
    path = os.path.join(base, "fig16", workload, "serving_benchmark.json")
    if os.path.exists(path):
      v = _paged_over(load(base, os.path.join("fig16", workload, "serving_benchmark.json")),
                      "orca_oracle")
      rows.append([f"Fig. 16 LLaMA-13B {workload}: max rate paged (prefix cached) / "
                   "Orca(Oracle)", f"{point}x", _x(v), _verdict(_near(v, point))])
  if os.path.exists(os.path.join(base, "fig18.json")):
    for workload, pts in load(base, "fig18.json").items():
      lo, hi = FIG18_RANGES[workload]
      best = min(p["normalized_latency_s_per_token"] for p in pts)
      tied = [p["block_size"] for p in pts if p["normalized_latency_s_per_token"] <= 1.01 * best]
      rows.append([f"Fig. 18 OPT-13B {workload}-like: best block size (latency within 1% "
                   "of the lowest)", f"{lo}-{hi}", ", ".join(map(str, tied)),
                   _verdict(any(lo <= b <= hi for b in tied))])
  if os.path.exists(os.path.join(base, "fig19.json")):
    fig19 = load(base, "fig19.json")
    lo_bs, hi_bs, lo, hi = FIG19_COMPARABLE
    by = {(p["block_size"], p["preemption_mode"]): p["normalized_latency_s_per_token"]
          for p in fig19["end_to_end"]}
    ratios = {bs: by[(bs, "swap")] / by[(bs, "recompute")] for bs, m in by
              if m == "swap" and lo_bs <= bs <= hi_bs and (bs, "recompute") in by}
    rows.append([f"Fig. 19b: latency swap / recompute at block sizes {lo_bs}-{hi_bs}",
                 f"comparable ({lo}-{hi})",
                 ", ".join(f"{bs}: {r:.2f}" for bs, r in sorted(ratios.items())),
                 _verdict(bool(ratios) and all(lo <= r <= hi for r in ratios.values()))])
    micro = fig19["microbenchmark"]
    small = micro[0]["recompute_over_swap"]
    worst = max(p["recompute_over_swap"] for p in micro)
    rows.append(["Fig. 19a model: recompute / swap seconds, smallest block; largest over "
                 "block sizes", "< 1 at small blocks; never > 1.2",
                 f"{small:.2f}; {worst:.2f}", _verdict(small < 1 and worst <= 1.2)])
  if not rows:
    raise FileNotFoundError(f"{base}: no committed result (run experiments.paper_scale)")
  return table(rows, ["target (the paper's)", "paper", "ours", "check"])


# Shorter wording of paper_targets' first column (BENCHMARKS.md keeps to a byte budget).
_SHORT = (("Alpaca-like, paged's edge over Orca(Oracle) smaller at OPT-175B than at OPT-13B",
           "Alpaca paged / Oracle lower at 175B than 13B"),
          (": max rate paged / ", ": paged / "),
          ("requests batched, paged / ", "batched, paged / "),
          ("requests batched while requests wait, paged / ", "batched while queued, paged / "),
          ("OPT-13B Alpaca-like: max rate paged / Orca(Oracle), beam width 6",
           "OPT-13B Alpaca beam 6: paged / Oracle"),
          ("OPT-13B Alpaca-like: paged / Orca(Oracle) grows with ", "OPT-13B Alpaca: paged / "
           "Oracle grows with "),
          ("OPT-13B Alpaca-like: paged / Orca(Oracle), beam width 6",
           "OPT-13B Alpaca beam 6: paged / Oracle"),
          ("grows with parallel sampling n", "grows with n"),
          ("grows with beam width", "grows with beam"),
          ("recompute / swap seconds, smallest block; largest over block sizes",
           "recompute / swap, smallest block; largest"),
          ("max rate paged (prefix cached) / ", "paged+cache / "),
          (" (latency within 1% of the lowest)", ""), ("-sharegpt", " ShareGPT"),
          ("-alpaca", " Alpaca"), (" requests a point", " req/point"), ("Fig. ", ""), ("Orca(Oracle)", "Oracle"),
          ("Orca(Max)", "Max"), ("LLaMA-13B ", ""))


def paper_targets_compact(results_dir: str) -> str:
  """paper_targets in shorter words, same rows and checks (for BENCHMARKS.md)."""
  lines = paper_targets(results_dir).splitlines()
  for old, new in _SHORT:
    lines[2:] = [l.replace(old, new) for l in lines[2:]]
  return "\n".join(["| figure | paper | ours | check |"] + lines[1:])
