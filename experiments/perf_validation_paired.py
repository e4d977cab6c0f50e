"""`perf_validation --predict=paired`: the model predicts the measured runs themselves.

The searched prediction (`perf_validation_search.predicted_search`) runs its own search on
the model clock, every step scaled by ONE load factor per system: the measured over
fitted seconds of all the measured runs around the crossing together. But on a shared
machine the truth's speed moves from run to run: the same point (Orca(Pow2) at 24 req/s,
the same stream, one XLA thread, the process on a core: CPU seconds over wall 0.97-1.12)
took 3.21, 3.61 and 4.37 ms of CPU a step in three back-to-back runs, and near saturation
a queue multiplies that: 4.45 to 23.0 ms/token. One factor for all of them predicts a
machine that never ran.

Paired, each measured run at the two rates around the measured crossing (and at the
unloaded rate, which sets the SLO) is predicted on its own: the same system, rate and
stream on a `perf.ModelClock` of the fit x THAT run's own load factor
(`calibration.load_factor` of its recorded steps: the machine's speed while it ran, read
off the work it did). Each rate's median predicted latency, the SLO from the predicted
unloaded latencies, and the crossing by the measured search's own rule (the line between
the judged latencies at the bracket's two ends, `rate_search.crossing_rate`) give the
predicted max rate: the same estimator on the same runs, so what differs is the model's
step costs and schedule, not the machine's moods. A system whose measured search was
censored, or whose runs kept no steps (--truth=wall), has no paired prediction.

The crossing is the line's: where the predictions at both ends lie on one side of the
SLO it is extrapolated ("bracketed": false in the JSON's found record). What this can and
cannot show: with the bracket --rel_tol wide, a prediction whose medians fall on the same
sides of the SLO as the measured ones lands within about that width of the measured
crossing whatever its latencies are; the latencies themselves are compared run by run
("latency_errors": predicted over measured latency - 1 of every paired run, in the
searches' records and the result's systems), and that is the finer test.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import numpy as np

from experiments import perf_validation_search as search
from paged_jax import perf
from paged_jax.bench import calibration
from paged_jax.bench import latency
from paged_jax.bench import rate_search


def _predict_runs(f, system: str, stream: Callable, size: Dict, model: perf.DeviceTimeModel,
                  runs: List[Tuple[float, list, float]], rec: Dict) -> None:
  """Predicts each `search.paired_runs` run at its own load factor into rec ("runs" as the
  searches keep them, "factors" [rate, factor], "latency_errors" [rate, predicted /
  measured - 1])."""
  # pylint: disable=protected-access  (the searches' own record format)
  for rate, steps, lat in runs:
    factor = calibration.load_factor(model, steps)
    point = search.predicted_point(f, system, stream(rate, f.seed, f.duration_s), size,
                                   model, factor)
    rec["runs"].append([rate, search._summary(point)])
    rec["factors"].append([rate, factor])
    rec["latency_errors"].append([rate, search._latency(point) / lat - 1])


def paired_prediction(f, stream: Callable, model: perf.DeviceTimeModel, done: Dict) -> Dict:
  """{"unloaded", "searches", "slo_s_per_token", "load_factor"} as `predicted_search`
  returns them (so `search.judge` compares), each rec's runs the paired predictions of
  the measured runs, its "found" the crossing by the measured search's rule."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  size = {s: search.sizes(f, s, stream(f.max_rate, f.seed, f.duration_s)) for s in f.systems}
  new = lambda: {"runs": [], "factors": [], "latency_errors": [], "samples": [],
                 "loads": [], "late": []}
  out: Dict = {"unloaded": {}, "searches": {}, "load_factor": {}}
  for s in f.systems:
    rec = new()
    runs = search.paired_runs(done["unloaded"][s], {f.unloaded_rate})
    if not runs:
      raise ValueError(f"--predict=paired needs the measured runs' steps (--truth=cpu); "
                       f"{s}'s unloaded runs kept none")
    _predict_runs(f, s, stream, size[s], model, runs, rec)
    rec["latency"] = search._median(rec, f.unloaded_rate)  # pylint: disable=protected-access
    out["unloaded"][s] = rec
  slo = latency.slo_from_unloaded([out["unloaded"][s]["latency"] for s in f.systems],
                                  f.slo_factor)
  for s in f.systems:
    found, rec = done["searches"][s]["found"], new()
    lo, hi = found.get("max_rate"), found.get("bound")
    if found["censored"] or lo is None or hi is None:
      rec["found"] = dict(found, crossing=None)
    else:
      _predict_runs(f, s, stream, size[s], model,
                    search.paired_runs(done["searches"][s], {lo, hi}), rec)
      lat_lo, lat_hi = (search._median(rec, r)  # pylint: disable=protected-access
                        for r in (lo, hi))
      crossing = (rate_search.crossing_rate(lo, hi, lat_lo, lat_hi, slo)
                  if lat_hi != lat_lo else None)
      rec["found"] = {"max_rate": lo, "bound": hi, "crossing": crossing,
                      "censored": None if crossing is not None else "flat",
                      "monotone": lat_hi >= lat_lo,
                      "bracketed": bool(lat_lo <= slo < lat_hi)}
    out["searches"][s] = rec
    factors = [x for _, x in rec["factors"]] or [x for _, x in out["unloaded"][s]["factors"]]
    out["load_factor"][s] = {"search": float(np.median(factors)),
                             "unloaded": float(np.median(
                                 [x for _, x in out["unloaded"][s]["factors"]]))}
    release_compiled()
  out["slo_s_per_token"] = slo
  return out
