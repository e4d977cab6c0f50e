"""Comparing a measured serving sweep with its prediction (`experiments.perf_validation`).

    curve = median_curve([run_1, run_2])          # point-by-point median of repeated runs
    res = compare(measured, predicted, 3.0)       # per system: max rates, errors, censoring
    got = speed_normalized_crossing(rates, latencies, factors, slo)   # runs at moving speeds

A curve is `sweep.curve`'s dict ({"rates", "normalized_latency_s_per_token", ...}); a
sweep is {system: curve}.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from paged_jax.bench import latency


def median_curve(curves: Sequence[Dict]) -> Dict:
  """The point-by-point median of like curves (each numeric list entry; others from the
  first), with "repeats": every curve's normalized latency and per-step seconds."""
  out = dict(curves[0])
  for k, v in curves[0].items():
    if k != "rates" and isinstance(v, list) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
      if all(len(c[k]) == len(v) for c in curves):
        out[k] = [float(np.median([c[k][i] for c in curves])) for i in range(len(v))]
  keep = ("normalized_latency_s_per_token", "step_wall_s", "step_cpu_s", "cpu_over_wall",
          "load_avg")
  out["repeats"] = [{k: c[k] for k in keep if k in c} for c in curves]
  return out


def repeat_spread(curve: Dict, key: str = "normalized_latency_s_per_token") -> List:
  """Per point: max / min - 1 of `key` over the repeated runs (None with one run)."""
  reps = curve.get("repeats") or []
  if len(reps) < 2:
    return [None] * len(curve["rates"])
  out = []
  for vals in zip(*(r[key] for r in reps)):
    ok = all(v is not None and v > 0 for v in vals)
    out.append(max(vals) / min(vals) - 1 if ok else None)
  return out


def single_run_crossings(curve: Dict, slo: float) -> List[Optional[float]]:
  """Where each repeat's own curve crosses `slo` (req/s): the truth's resolution.

  curve: a search's measured curve ({"rates", "latency_runs": per rate, every run's
  normalized latency}). Curve j takes each rate's j-th run (a rate run fewer times: its
  last), and `latency.max_rate_at_slo` reads its crossing (None where it never misses).
  The median-of-runs crossing the check judges lies among these; how far apart they lie
  is how far one run of this machine moves it, whatever the model says.
  """
  runs = curve.get("latency_runs") or []
  k = max((len(v) for v in runs), default=0)
  out = []
  for j in range(k):
    lat = [v[min(j, len(v) - 1)] for v in runs]
    out.append(latency.max_rate_at_slo(curve["rates"], lat, slo)["interpolated"])
  return out


def crossing_spread(crossings: Sequence[Optional[float]]) -> Optional[float]:
  """(max - min) / median of the crossings found (None with fewer than two)."""
  xs = [x for x in crossings if x]
  return (max(xs) - min(xs)) / float(np.median(xs)) if len(xs) > 1 else None


SPEED_BAND = 1.5   # a run this far off the median speed: the machine changed within it
MIN_RUNS = 3


def speed_normalized_crossing(rates: Sequence[float], latencies: Sequence[float],
                              factors: Sequence[float], slo: float, *,
                              ref: Optional[float] = None, band: float = SPEED_BAND,
                              min_runs: int = MIN_RUNS) -> Dict:
  """The max rate at `slo` of runs the machine served at different speeds, read at the
  median run's speed.

  Time dilation: a run at `rate` (req/s) whose steps each took `factor` x the fit's
  seconds is, on the clock t x ref / factor, a run at rate x factor / ref whose steps
  take ref x the fit's: the queue sees only arrival gaps over step times. So each run is
  mapped to ref (the speed the prediction runs at; by default the median factor) as
  (rate x factor / ref, latency x ref / factor), and a least-squares line of log latency
  over the mapped rates crosses log(slo) at the rate the machine sustains at ref. (Exact
  but for the arrival window, which the mapping stretches by ref / factor.) A run whose
  factor lies outside [median / band, median x band] is left out: one number no longer
  describes a machine that moved that far within a run.

  Args:
    rates: f64[n] each run's request rate (req/s), > 0.
    latencies: f64[n] each run's normalized latency (s/token), > 0.
    factors: f64[n] each run's measured over fitted seconds (`calibration.load_factor`).
    slo: the latency target (s/token), > 0.
    ref: the factor to read the crossing at, > 0 (None: the median of `factors`).
  Returns:
    {"crossing": req/s at ref, or None when "censored" says why ("too few runs": under
    `min_runs` kept or one mapped rate; "flat": latency not rising with rate), "ref",
    "slope" (d log latency / d req/s), "runs" (kept), "dropped", "extrapolated" (the
    crossing outside the mapped rates)}.
  """
  r, lat, f = (np.asarray(v, np.float64).reshape(-1) for v in (rates, latencies, factors))
  if not (r.size == lat.size == f.size):
    raise ValueError(f"rates, latencies and factors must have one entry per run, got "
                     f"{r.size}, {lat.size}, {f.size}")
  median = float(np.median(f)) if f.size else 1.0
  ref = median if ref is None else ref
  for name, v in (("rates", r), ("latencies", lat), ("factors", f), ("slo", np.array([slo])),
                  ("ref", np.array([ref]))):
    if not np.all(np.isfinite(v) & (v > 0)):
      raise ValueError(f"{name} must be finite numbers > 0, got {v.tolist()}")
  keep = (f >= median / band) & (f <= median * band)
  x, y = r[keep] * f[keep] / ref, np.log(lat[keep] * ref / f[keep])
  out = {"crossing": None, "ref": ref, "slope": None, "runs": int(keep.sum()),
         "dropped": int((~keep).sum()), "extrapolated": None, "censored": None}
  if x.size < min_runs or np.ptp(x) == 0:
    return dict(out, censored="too few runs")
  slope, intercept = np.polyfit(x, y, 1)
  if slope <= 0:
    return dict(out, slope=float(slope), censored="flat")
  crossing = float((np.log(slo) - intercept) / slope)
  return dict(out, crossing=crossing, slope=float(slope),
              extrapolated=bool(not x.min() <= crossing <= x.max()))


def step_time_errors(measured: Dict, predicted: Dict) -> List:
  """Per point: the predicted mean step (the model clock's seconds, "model_s", / steps)
  over the measured one (the truth clock's mean step "step_s", else seconds inside
  Engine.step / steps) - 1. A predicted curve without "model_s" (written before it was
  kept) has no such figure: its "device_s" is the stand-in engine's own wall time inside
  its jitted call, not the model's, so every entry is None."""
  out = []
  if measured.get("step_s"):   # the truth clock's mean step, the loop's work included
    per_step = measured["step_s"]
    steps = [1] * len(per_step)
  else:
    per_step, steps = measured.get("engine_step_s") or [], measured["steps"]
  model_s = predicted.get("model_s") or [None] * len(predicted["steps"])
  for ms, mn, ps, pn in zip(per_step, steps, model_s, predicted["steps"]):
    ok = ms and mn and ps and pn
    out.append((ps / pn) / (ms / mn) - 1 if ok else None)
  return out


def censored(curve: Dict, slo: float) -> bool:
  """True when the curve is under the SLO at its highest rate (its max rate is beyond)."""
  rates, lat = curve["rates"], curve["normalized_latency_s_per_token"]
  return bool(lat[rates.index(max(rates))] <= slo)


def compare(measured: Dict, predicted: Dict, slo_factor: float) -> Dict:
  """Per system: max rate at each sweep's own SLO, and at the measured SLO; latency errors."""
  m, p = (latency.slo_and_rates(c, slo_factor) for c in (measured, predicted))
  out = {}
  for s in measured:
    at_measured_slo = latency.max_rate_at_slo(predicted[s]["rates"],
                                              predicted[s]["normalized_latency_s_per_token"],
                                              m["slo_s_per_token"])
    mv, pv = latency.max_rate(m, s), latency.max_rate(p, s)
    # A curve still under its SLO at the highest rate gives that rate as its max: a lower
    # bound only. A measured one cannot be judged; a predicted one's error is a bound.
    m_cens, p_cens = (censored(c[s], res["slo_s_per_token"])
                      for c, res in ((measured, m), (predicted, p)))
    lat_m = np.array(measured[s]["normalized_latency_s_per_token"])
    lat_p = np.array(predicted[s]["normalized_latency_s_per_token"])
    out[s] = {"measured_max_rate": mv, "predicted_max_rate": pv,
              "rel_error": pv / mv - 1 if mv and not m_cens else None,
              "measured_censored": m_cens, "predicted_censored": p_cens,
              "predicted_max_rate_at_measured_slo": (at_measured_slo["interpolated"]
                                                     or at_measured_slo["swept"]),
              "latency_rel_error": (lat_p / lat_m - 1).tolist(),
              "step_time_rel_error": step_time_errors(measured[s], predicted[s]),
              "measured_repeat_spread": repeat_spread(measured[s]),
              "measured": measured[s], "predicted": predicted[s]}
  return {"systems": out, "measured_slo_s_per_token": m["slo_s_per_token"],
          "predicted_slo_s_per_token": p["slo_s_per_token"]}
