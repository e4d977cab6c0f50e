r"""`experiments.perf_validation --rates=auto` (the default): each system's max rate at the
SLO found by running it, on the truth clock and on the fitted model's clock.

    done = measured_search(f, stream, done={}, save=None)    # the truth clock's searches
    predicted = predicted_search(f, stream, fit.model, done)  # the model clock's
    result = judge(done, predicted)                           # errors, censoring

A grid of rates judges nothing on a machine faster than its top rate (every curve under
the SLO: censored) and little on one slower than its second (one point over). Here:

1. unloaded: every system at --unloaded_rate (a calibration run of another seed's
   stream first, then --repeats measured runs, the median kept); the SLO is --slo_factor
   x the largest median (`latency.slo_from_unloaded`);
2. per system, `rate_search.find_saturation` on the truth clock from --start_rate: up by
   x SEARCH_STEP while under the SLO, down while over, then bisection until the bracket
   is within --rel_tol, at most --max_rates rates; a rate whose first run is not under
   the SLO / --near gets --repeats runs, judged by their median; then --repeats more at
   each end of the bracket in turn, whose medians place the crossing (`interleave`).
   Before each new rate, a calibration run of it (the samples the fit reads);
3. the fit (`calibration.fit_cpu` over every calibration step), then the same two steps
   on a `perf.ModelClock` of it (the stand-in engine charged the bucketed shapes), each
   system's search from its measured crossing, one run a rate (virtual time repeats),
   every step scaled by a load factor: the median over the measured runs at that
   system's two rates around its crossing of each run's measured over fitted seconds
   (--load_from=measured: the machine's speed while they ran; a calibration run minutes
   away ran on another machine, as far as a shared one goes) or of the calibration runs
   there (--load_from=calibration). The fit itself sees the calibration runs only.
4. per system: rel_error = predicted / measured crossing - 1, or None (censored: a
   search that never bracketed the SLO within --max_rates rates has a bound, not a
   rate). The measured crossing is read from the runs at the bracket's two ends, each
   mapped to their median speed by its own load factor (`speed_normalized`: this
   machine's speed moves by minutes, and a search's medians mix its speeds); the search's
   own crossing is kept beside it. The load average is sampled before every run.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from experiments import common
from paged_jax import perf
from paged_jax.bench import calibration
from paged_jax.bench import engines
from paged_jax.bench import latency
from paged_jax.bench import rate_search
from paged_jax.bench import sweep as serving_sweep
from paged_jax.bench import validation
from paged_jax.bench.scale import TINY

SEARCH_STEP = 1.5   # the bracket's factor per rate (as --rates=auto's)
PREDICTED_REL_TOL = 0.01   # the model clock's bisection (deterministic: cheap to refine)
PREDICTED_STEP = 1.15      # its bracket's factor, from the measured crossing


def sizes(f, system: str, requests) -> Dict:
  """`sweep.system_sizes` of `system` on `requests` at f's KV budget and block size."""
  return serving_sweep.system_sizes(system, requests, kv_budget_tokens=f.kv_budget_tokens,
                                    block_size=f.block_size, max_len=TINY.max_len)


def point_steps(clock) -> Dict:
  """Per-step wall and CPU seconds of one measured run (means, and CPU over wall)."""
  wall, cpu = float(np.sum(clock.wall_s)), float(np.sum(clock.cpu_s))
  n = max(len(clock.wall_s), 1)
  return {"step_wall_s": wall / n, "step_cpu_s": cpu / n,
          "cpu_over_wall": cpu / wall if wall > 0 else None}


def _kw(f, size: Dict) -> Dict:
  return dict(kv_budget_tokens=f.kv_budget_tokens, block_size=f.block_size, sizes=size,
              preemption_mode=f.preemption_mode)


def calibration_point(f, system: str, requests, size: Dict) -> Dict:
  """One run on the truth's recording clock: {"samples": [(StepShape, s)], "late": [s]}."""
  rec = calibration.recording_clock(f.truth, f.block_size)
  with common.progress(total=len(requests), desc=f"calibration {system}") as bar:
    serving_sweep.run_point(system, requests, clock=rec, progress=bar, **_kw(f, size))
  return {"samples": rec.samples, "late": list(rec.wake_late_s)}


def measured_point(f, system: str, requests, size: Dict) -> Dict:
  """One run on the truth clock: `run_point`'s dict with "load_avg" (1-minute, before it),
  `point_steps`' per-step seconds and, on the CPU clock, "samples": every step as
  (StepShape, CPU s) (`calibration.RecordingCpuClock`: the same clock, recording)."""
  clock = (calibration.recording_clock(f.truth, f.block_size) if f.truth == "cpu" else
           calibration.truth_clock(f.truth))
  load = os.getloadavg()[0]
  with common.progress(total=len(requests), desc=f"measured {system}") as bar:
    point = serving_sweep.run_point(system, requests, clock=clock, progress=bar,
                                    **_kw(f, size))
  return dict(point, load_avg=load, samples=getattr(clock, "samples", None),
              **point_steps(clock))


def standin_engine(holder: Dict, **kw):
  """The tiny model's engine with the stand-in forward and ONE compiled shape; `holder`
  gets a ModelClock `to_step` charging the shapes the bucketed engine of that geometry
  runs."""
  from paged_jax.engine import buckets as buckets_lib  # pylint: disable=g-import-not-at-top
  engine = engines.make_engine(standin=True, shape_buckets=False, **kw)
  holder["to_step"] = calibration.bucketed_step(
      buckets_lib.step_buckets(engine.cache_config, engine.max_num_batched_tokens,
                               engine.decode_steps_per_sync), engine.cache_config.block_size)
  return engine


def predicted_point(f, system: str, requests, size: Dict, model: perf.DeviceTimeModel,
                    factor: float) -> Dict:
  """The same run on virtual time: the stand-in engine (it schedules as the tiny model
  does) on a ModelClock of `model` x `factor`, each step charged the padded shape the
  measured engine ran it on; "model_s" is the clock's seconds (the point's "device_s" is
  the stand-in's own wall time)."""
  holder: Dict = {}
  clock = perf.ModelClock(calibration.scaled(model, factor), block_size=f.block_size,
                          to_step=lambda rep: holder["to_step"](rep))
  with common.progress(total=len(requests), desc=f"predicted {system}") as bar:
    point = serving_sweep.run_point(system, requests, clock=clock, progress=bar,
                                    engine_fn=functools.partial(standin_engine, holder),
                                    **_kw(f, size))
  return dict(point, model_s=clock.device_s + clock.host_s)


def _latency(point: Dict) -> float:
  return point["summary"]["normalized_latency_s_per_token"]


def _load(start: float) -> List[float]:
  """[seconds since `start`, 1-, 5-, 15-minute load average]."""
  return [time.time() - start, *os.getloadavg()]


def _summary(point: Dict) -> Dict:
  """What the measured file keeps of a run: latency, steps, per-step seconds, load."""
  keep = ("steps", "load_avg", "step_wall_s", "step_cpu_s", "cpu_over_wall", "model_s")
  return dict({k: point[k] for k in keep if k in point},
              normalized_latency_s_per_token=_latency(point),
              throughput_req_s=point["summary"]["throughput_req_s"])


def _runner(rec: Dict, start: float, run_one: Callable[[float], Dict],
            calibrate: Optional[Callable[[float], Dict]] = None) -> Callable[[float], float]:
  """measure(rate) -> normalized latency of `run_one(rate)` (a run's dict), kept in
  rec["runs"] as [rate, `_summary`] (and a run's own "samples", where it has them, in
  rec["run_samples"] as [rate, samples]); before a rate's first run, `calibrate(rate)`
  (None: none), its samples in rec["samples"] as [rate, samples]. rec["loads"] gains a
  `_load` before every run."""
  def measure(rate: float) -> float:
    if calibrate is not None and all(r != rate for r, _ in rec["samples"]):
      rec["loads"].append(_load(start))
      cal = calibrate(rate)
      rec["samples"].append([rate, cal["samples"]])
      rec["late"] += cal["late"]
    rec["loads"].append(_load(start))
    point = run_one(rate)
    rec["runs"].append([rate, _summary(point)])
    if point.get("samples"):
      rec.setdefault("run_samples", []).append([rate, point["samples"]])
    return _latency(point)
  return measure


def _median(rec: Dict, rate: float) -> float:
  return float(np.median([p["normalized_latency_s_per_token"] for r, p in rec["runs"]
                          if r == rate]))


def measured_search(f, stream: Callable, done: Dict, save: Optional[Callable] = None) -> Dict:
  """Steps 1-2 of the module docstring for every system of f.systems not in `done` yet.
  `stream(rate, seed, duration_s)`: the requests. `done` gains {"unloaded": {system: rec},
  "searches": {system: rec}, "slo_s_per_token"}, a rec holding "runs", "samples", "loads",
  "late" (and a search's `find_saturation` result under "found"); `save(done)` runs after
  each system, so a stopped run keeps what it finished."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  start = time.time()
  done.setdefault("unloaded", {})
  done.setdefault("searches", {})
  size = {s: sizes(f, s, stream(f.max_rate, f.seed, f.duration_s)) for s in f.systems}

  def runner(system: str, rec: Dict) -> Callable[[float], float]:
    return _runner(rec, start,
                   lambda r: measured_point(f, system, stream(r, f.seed, f.duration_s),
                                            size[system]),
                   lambda r: calibration_point(f, system, stream(r, f.calibration_seed,
                                                                 f.calibration_duration_s),
                                               size[system]))
  new = lambda: {"runs": [], "samples": [], "loads": [], "late": []}
  for system in f.systems:
    if system in done["unloaded"]:
      continue
    rec = new()
    measure = runner(system, rec)
    for _ in range(f.repeats):
      measure(f.unloaded_rate)
    rec["latency"] = _median(rec, f.unloaded_rate)
    done["unloaded"][system] = rec
    if save:
      save(done)
  slo = latency.slo_from_unloaded([done["unloaded"][s]["latency"] for s in f.systems],
                                  f.slo_factor)
  done["slo_s_per_token"] = slo
  for system in f.systems:
    if system in done["searches"]:
      continue
    rec = new()
    rec["found"] = rate_search.find_saturation(
        runner(system, rec), f.start_rate, slo, step=SEARCH_STEP, rel_tol=f.rel_tol,
        max_rates=f.max_rates, repeats=f.repeats, near=f.near, interleave=True)
    done["searches"][system] = rec
    keep_crossing_steps(done)
    if save:
      save(done)
  release_compiled()   # kept across the phases: each system's shapes compile once
  return done


def _crossing_rates(rec: Dict, source: str) -> set:
  found = rec.get("found") or {"censored": "none"}
  if found["censored"]:
    return {r for r, _ in rec.get(source, [])}
  return {found.get("max_rate"), found.get("bound")} - {None}


def crossing_runs(rec: Dict, source: str = "samples") -> List[List]:
  """Each run's steps in rec[source] ("samples": the calibration runs; "run_samples":
  the measured runs themselves) at the judged rates around a search's crossing
  ("max_rate" and "bound"; every rate when censored, or when a rec has no "found": an
  unloaded point): the machine's speed where it counts."""
  near = _crossing_rates(rec, source)
  return [samples for r, samples in rec.get(source, []) if r in near]


def paired_runs(rec: Dict, rates) -> List[Tuple[float, list, float]]:
  """[(rate, recorded steps, measured latency)] of rec's measured runs at `rates`, in run
  order: a run's "run_samples" entry is appended with its "runs" entry (`_runner`), so
  the two lists pair up (on the CPU clock every run keeps steps)."""
  steps = [(r, xs) for r, xs in rec.get("run_samples", []) if r in rates]
  lats = [p["normalized_latency_s_per_token"] for r, p in rec.get("runs", []) if r in rates]
  return [(r, xs, lat) for (r, xs), lat in zip(steps, lats)]


def keep_crossing_steps(done: Dict) -> Dict:
  """`done` with each search's measured-run steps ("run_samples") kept only at the rates
  `crossing_runs` reads (the measured file stays small: a run records ~2,000 steps)."""
  for rec in done.get("searches", {}).values():
    if "run_samples" in rec and "found" in rec:
      near = _crossing_rates(rec, "run_samples")
      rec["run_samples"] = [[r, xs] for r, xs in rec["run_samples"] if r in near]
  return done


def load_factors(f, model: perf.DeviceTimeModel, done: Dict) -> Dict:
  """{system: {"unloaded", "search"}}: `calibration.median_load_factor` of the runs
  --load_from names (the measured runs' own, else the calibration runs') at the unloaded
  rate and around the measured crossing; the calibration runs' where the measured runs
  kept no steps (--truth=wall)."""
  out = {}
  for system in f.systems:
    out[system] = {}
    for key, rec in (("unloaded", done["unloaded"][system]),
                     ("search", done["searches"][system])):
      runs = (crossing_runs(rec, "run_samples") if f.load_from == "measured" else [])
      out[system][key] = calibration.median_load_factor(model, runs or crossing_runs(rec))
  return out


def predicted_search(f, stream: Callable, model: perf.DeviceTimeModel, done: Dict) -> Dict:
  """Step 3 of the module docstring: {"unloaded": {system: rec}, "searches": {system:
  rec}, "slo_s_per_token", "load_factor": {system: {"unloaded", "search"}}} on the model
  clock, as `measured_search`'s. A system's search starts at its measured crossing (else
  its highest rate within the SLO, else --start_rate)."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  start = time.time()
  size = {s: sizes(f, s, stream(f.max_rate, f.seed, f.duration_s)) for s in f.systems}
  out: Dict = {"unloaded": {}, "searches": {}, "load_factor": {}}
  factors = load_factors(f, model, done)

  def runner(system: str, rec: Dict, key: str) -> Callable[[float], float]:
    return _runner(rec, start, lambda r: predicted_point(
        f, system, stream(r, f.seed, f.duration_s), size[system], model,
        factors[system][key]))
  for system in f.systems:
    rec = {"runs": [], "samples": [], "loads": [], "late": []}
    runner(system, rec, "unloaded")(f.unloaded_rate)
    rec["latency"] = _median(rec, f.unloaded_rate)
    out["unloaded"][system] = rec
  slo = latency.slo_from_unloaded([out["unloaded"][s]["latency"] for s in f.systems],
                                  f.slo_factor)
  for system in f.systems:
    found = done["searches"][system]["found"]
    rec = {"runs": [], "samples": [], "loads": [], "late": []}
    first = found["crossing"] or found["max_rate"] or f.start_rate
    rec["found"] = rate_search.find_saturation(
        runner(system, rec, "search"), first, slo, step=PREDICTED_STEP,
        rel_tol=PREDICTED_REL_TOL, max_rates=2 * f.max_rates, repeats=1)
    out["searches"][system] = rec
    release_compiled()
  out.update(slo_s_per_token=slo, load_factor=factors)
  return out


def rate_of(found: Dict) -> Optional[float]:
  """A search's max rate at the SLO: its crossing when bracketed, else None."""
  return None if found["censored"] else found["crossing"]


def curve(rec: Dict) -> Dict:
  """A search's judged points as a curve ({"rates", "normalized_latency_s_per_token"}:
  each rate's median), with "repeats" (every run's latency per rate) and "runs"."""
  rates = sorted({r for r, _ in rec["runs"]})
  per = [[p["normalized_latency_s_per_token"] for r, p in rec["runs"] if r == rate]
         for rate in rates]
  return {"rates": rates, "normalized_latency_s_per_token": [float(np.median(v)) for v in per],
          "latency_runs": per, "runs": rec["runs"]}


def speed_normalized(model: Optional[perf.DeviceTimeModel], rec: Dict, slo: float,
                     ref: float) -> Optional[Dict]:
  """`validation.speed_normalized_crossing` of a search's measured runs at the two rates
  around its crossing, each at its own `calibration.load_factor`, read at `ref` (the
  factor the prediction ran at: `load_factors`, by default these runs' median); None
  without a model, for a censored search, or for runs that kept no steps (--truth=wall)."""
  if model is None or rec["found"]["censored"]:
    return None
  runs = paired_runs(rec, _crossing_rates(rec, "run_samples"))
  if not runs:
    return None
  rates, steps, lats = zip(*runs)
  return validation.speed_normalized_crossing(
      rates, lats, [calibration.load_factor(model, xs) for xs in steps], slo, ref=ref)


def judge(done: Dict, predicted: Dict, model: Optional[perf.DeviceTimeModel] = None) -> Dict:
  """Per system: measured and predicted crossings, the error (None when either is
  censored: a bound is not a rate, and never a 0% error), censoring, curves. With the
  fit `model`, the measured crossing is `speed_normalized`'s (the runs each mapped to
  the speed the prediction ran at), where the runs kept steps;
  the search's own (its medians at the bracket's ends) is kept as "measured_raw_crossing",
  its error as "rel_error_raw"."""
  out = {}
  for s, m in done["searches"].items():
    p = predicted["searches"][s]
    raw, pv = rate_of(m["found"]), rate_of(p["found"])
    norm = speed_normalized(model, m, done["slo_s_per_token"],
                            predicted["load_factor"][s]["search"])
    mv = raw if norm is None else norm["crossing"]
    mc, pc = curve(m), curve(p)
    at_m = latency.max_rate_at_slo(pc["rates"], pc["normalized_latency_s_per_token"],
                                   done["slo_s_per_token"])
    out[s] = {"measured_max_rate": mv if mv is not None else m["found"]["max_rate"],
              "predicted_max_rate": pv if pv is not None else p["found"]["max_rate"],
              "rel_error": pv / mv - 1 if mv and pv is not None else None,
              "measured_censored": m["found"]["censored"] or (norm or {}).get("censored"),
              "measured_raw_crossing": raw, "measured_speed_normalized": norm,
              "rel_error_raw": pv / raw - 1 if raw and pv is not None else None,
              "predicted_censored": p["found"]["censored"],
              "measured_bound": m["found"]["bound"], "measured_monotone":
              m["found"]["monotone"], "predicted_max_rate_at_measured_slo":
              at_m["interpolated"] or at_m["swept"],
              "measured_repeat_spread": [max(v) / min(v) - 1 if len(v) > 1 else None
                                         for v in mc["latency_runs"]],
              "measured_single_run_crossings": validation.single_run_crossings(
                  mc, done["slo_s_per_token"]),
              "measured": mc,
              "predicted": dict(pc, load_factor=[predicted["load_factor"][s]["search"]]),
              "unloaded": {"measured": done["unloaded"][s]["latency"],
                           "predicted": predicted["unloaded"][s]["latency"]},
              **({"paired_latency_errors": p["latency_errors"]} if "latency_errors" in p
                 else {})}
  return {"systems": out, "measured_slo_s_per_token": done["slo_s_per_token"],
          "predicted_slo_s_per_token": predicted["slo_s_per_token"]}


def map_samples(done: Dict, fn: Callable) -> Dict:
  """`done` (`measured_search`'s) with every rec's calibration samples passed through
  `fn` (`calibration.samples_as_dicts` to write, `samples_from_dicts` to read)."""
  out = dict(done)
  for key in ("unloaded", "searches"):
    out[key] = {s: dict(rec, **{k: [[r, fn(xs)] for r, xs in rec[k]]
                                for k in ("samples", "run_samples") if k in rec})
                for s, rec in done.get(key, {}).items()}
  return out


def cpu_over_wall(measured: Dict) -> Dict:
  """CPU over wall seconds of the measured steps, per system and point (every repeat)."""
  out = {}
  for s, c in measured.items():
    reps = c.get("repeats") or []
    out[s] = {"cpu_over_wall": [r.get("cpu_over_wall") for r in reps],
              "load_avg": [r.get("load_avg") for r in reps]}
  return out
