"""`--rates=auto`: each system's sustainable request rate found by running it.

    found = rate_search.search_systems(["paged", "orca_max"], run, num_requests=150,
                                       slo_factor=3.0)
    found["max_rate_at_slo"]["paged"], found["systems"]["paged"]["rates"]

`run(system, rate, num_requests)` serves the first `num_requests` requests of one seeded
stream arriving at `rate` (rate inf: all at t = 0) and returns `sweep.run_point`'s dict.
The search, per sweep:

  1. capacity probe of the first system (paged): every request at t = 0; the requests it
     finishes per second (N / makespan: a lower bound of its saturated throughput, since
     the batch fills and drains);
  2. unloaded latency: the first system at 1/20 of the probe's rate, where requests
     rarely overlap; every system serves a lone request alike (a gate admits it at once),
     so this one figure sets the SLO = `slo_factor` x it (`latency.slo_from_unloaded`);
  3. per system, the rate where the normalized latency crosses the SLO: bracketed by
     steps of x `step` up (under the SLO) or down (over it) from a start (the first
     system: twice its probe's rate; the others: a hint from the first's answer, e.g.
     scaled by what their KV memory holds), then bisected until the bracket is within
     `rel_tol`; `latency.max_rate_at_slo` reads the answer off every point run
     (interpolated between the two around the crossing).

Each point serves the same `num_requests` requests (common random numbers: a faster rate
is the same arrivals compressed), so systems differ only in what they sustain.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from paged_jax.bench import latency
from paged_jax.bench import sweep
from paged_jax.bench.scale import HarnessScale

UNLOADED_FRACTION = 0.05   # of the probe's rate: the unloaded-latency point
MIN_REQUESTS = 150         # requests a point serves at least (num_requests=0)
REQUESTS_PER_SLOT = 4      # ... and this many per request the largest KV memory holds
REBRACKETS = 2             # find_saturation(interleave=True) searches again at most this often
PROBE_FACTOR = 2.0         # the first search starts at this x the burst's throughput (a
#                            burst of N requests fills and drains: it under-reads capacity)


def _latency(point: Dict) -> float:
  return point["summary"]["normalized_latency_s_per_token"]


def probe_rate(point: Dict) -> float:
  """Requests finished per second of a burst (all arriving at t = 0)."""
  return point["summary"]["throughput_req_s"]


def bracket_and_bisect(measure: Callable[[float], float], start: float, slo: float, *,
                       step: float = 1.5, rel_tol: float = 0.12, max_points: int = 8
                       ) -> List[Tuple[float, float]]:
  """(rate, latency) of every rate measured while finding where latency crosses `slo`.

  From `start`: up by x `step` while under the SLO, down by / `step` while over it, until
  the crossing is bracketed; then bisection (arithmetic) until hi / lo <= 1 + rel_tol.
  At most `max_points` measurements (the last bracket is what they found)."""
  if not (math.isfinite(start) and start > 0):
    raise ValueError(f"start rate must be a finite number > 0, got {start}")
  seen: Dict[float, float] = {}

  def at(rate: float) -> float:
    if rate not in seen:
      seen[rate] = measure(rate)
    return seen[rate]

  lo, hi, rate = None, None, start
  while (lo is None or hi is None) and len(seen) < max_points:
    if at(rate) <= slo:
      lo = rate
      rate = rate * step
    else:
      hi = rate
      rate = rate / step
    if lo is not None and hi is not None and lo > hi:   # latency not monotone: stop
      break
  while (lo is not None and hi is not None and lo < hi and hi / lo > 1 + rel_tol
         and len(seen) < max_points):
    mid = (lo + hi) / 2
    if at(mid) <= slo:
      lo = mid
    else:
      hi = mid
  return sorted(seen.items())


def crossing_rate(lo: float, hi: float, lat_lo: float, lat_hi: float, slo: float) -> float:
  """Where the line through (lo, lat_lo) and (hi, lat_hi) meets `slo` (req/s; lat_hi >
  lat_lo: the line rises). Outside [lo, hi] when both latencies are on one side."""
  return lo + (slo - lat_lo) / (lat_hi - lat_lo) * (hi - lo)


def find_saturation(measure: Callable[[float], float], start: float, slo: float, *,
                    step: float = 1.5, rel_tol: float = 0.05, max_rates: int = 8,
                    repeats: int = 3, near: Optional[float] = None,
                    interleave: bool = False) -> Dict:
  """The highest rate whose latency stays within `slo`, found on a noisy clock.

  `bracket_and_bisect`'s walk (up by x `step` while under the SLO, down while over, then
  bisection until hi / lo <= 1 + rel_tol, at most `max_rates` rates), with every rate
  judged by the median of `repeats` measurements: on a shared machine's wall clock a
  single point near the crossing lands on either side of the SLO. `near` (> 1, None:
  every rate): a rate whose first measurement lies under slo / near is judged by that
  one measurement; every other rate is measured `repeats` times. One-sided because a
  shared machine's noise is: a run the machine was taken from is slow (perf_validation
  one_thread_3: one run at 7x the CPU a step, 33x the SLO, at a rate its two repeats
  sustained within it), never fast, so only a far-under run is safe to take alone.
  `interleave`: once bracketed, `repeats` more runs at each end, taken in turn (lo, hi,
  lo, hi, ...), and the crossing read from their medians: the search reaches its two
  ends minutes apart, and a machine whose speed moves by minutes moves a crossing read
  across them (perf_validation one_thread's Orca(Max): its 24 req/s runs took 4.2 ms of
  CPU a step, the 23.5 req/s runs after them 2.7-3.4). Where those medians do not
  straddle the SLO the machine has moved the crossing past an end, and the search goes
  on from that end (at most REBRACKETS times; "settled" says whether the last did).

  Returns {"max_rate": the highest rate judged within the SLO (None if none was),
  "bound": the lowest rate above it judged over the SLO (None if none was), "censored":
  None when the crossing was bracketed, "above" when no rate tried was over the SLO (the
  max rate is at least "max_rate"), "below" when every rate tried was (it is below
  "bound"), "monotone": False when a rate below "max_rate" was judged over the SLO,
  "judged": [(rate, median latency)] ascending, "measurements": [(rate, latency)] in the
  order taken, "crossing": where the line between the judged latencies at "max_rate" and
  "bound" (the interleaved runs' medians, "interleaved" [[rate, median]], when
  `interleave` settled) meets the SLO (None when censored), "settled"}. A censored
  result has no error to report: never score it as 0%."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  if near is not None and not near > 1:
    raise ValueError(f"near must be > 1 (a factor around the SLO), got {near}")
  taken: List[Tuple[float, float]] = []

  def judged(rate: float) -> float:
    vals = [float(measure(rate))]
    if near is None or vals[0] > slo / near:
      vals += [float(measure(rate)) for _ in range(repeats - 1)]
    taken.extend((rate, v) for v in vals)
    return float(np.median(vals))

  def bracket(pts):
    within = [r for r, lat in pts if lat <= slo]
    lo = max(within) if within else None
    return lo, min((r for r, lat in pts if lat > slo and (lo is None or r > lo)),
                   default=None)

  ends, settled, begin = None, not interleave, start
  for _ in range(1 + REBRACKETS * interleave):
    pts = bracket_and_bisect(judged, begin, slo, step=step, rel_tol=rel_tol,
                             max_points=max_rates)
    lo, hi = bracket(pts)
    if not interleave or lo is None or hi is None:
      break
    runs: Dict[float, List[float]] = {lo: [], hi: []}
    for _ in range(repeats):
      for r in (lo, hi):
        runs[r].append(float(measure(r)))
        taken.append((r, runs[r][-1]))
    ends = {r: float(np.median(v)) for r, v in runs.items()}
    settled = ends[lo] <= slo < ends[hi]
    if settled:
      break
    begin = hi if ends[hi] <= slo else lo   # the side the crossing moved to
  crossing = None
  if lo is not None and hi is not None:
    lat = ends if settled and ends else dict(pts)
    crossing = crossing_rate(lo, hi, lat[lo], lat[hi], slo)
  return {"max_rate": lo, "bound": hi, "crossing": crossing,
          "interleaved": ends and [[r, m] for r, m in sorted(ends.items())],
          "settled": settled,
          "censored": None if lo is not None and hi is not None else
                      ("above" if hi is None else "below"),
          "monotone": lo is None or all(lat <= slo for r, lat in pts if r < lo),
          "judged": pts, "measurements": taken}


def search_systems(systems: Sequence[str], run: Callable[[str, float, int], Dict], *,
                   num_requests: int, slo_factor: float,
                   start_hint: Optional[Callable[[str, float], float]] = None,
                   step: float = 1.5, rel_tol: float = 0.25, max_points: int = 6,
                   unloaded_requests: int = 24) -> Dict:
  """The search of the module docstring over `systems` (the first sets the SLO).

  The first system's search starts at PROBE_FACTOR x its burst throughput; each later
  one's at `start_hint(system, first system's max rate)` (default: that rate).

  Returns {"slo_s_per_token", "unloaded_s_per_token": {system: s/token (the first's, for
  all)}, "max_rate_at_slo", "max_rate_at_slo_interpolated" (latency.max_rate_at_slo),
  "probe_req_s": {first system: burst throughput}, "start_rate": {system: rate},
  "rates": {system: [rates run, ascending]}, "points": {system: [their run_point dicts]},
  "unloaded_rate", "unloaded_point": run_point dict}.
  """
  if not systems:
    raise ValueError("systems is empty")
  first = systems[0]
  probe = probe_rate(run(first, math.inf, num_requests))
  calm = probe * UNLOADED_FRACTION
  unloaded_point = run(first, calm, min(unloaded_requests, num_requests))
  unloaded = _latency(unloaded_point)
  slo = latency.slo_from_unloaded([unloaded], slo_factor)
  points: Dict[str, List[Dict]] = {}
  rates: Dict[str, List[float]] = {}
  starts: Dict[str, float] = {}
  found = {}
  for system in systems:
    if system == first:
      starts[system] = PROBE_FACTOR * probe
    else:
      ref = found[first]["interpolated"] or found[first]["swept"] or probe
      starts[system] = start_hint(system, ref) if start_hint else ref
    runs: Dict[float, Dict] = {}

    def measure(rate: float, system=system, runs=runs) -> float:
      runs[rate] = run(system, rate, num_requests)
      return _latency(runs[rate])

    curve = bracket_and_bisect(measure, starts[system], slo, step=step, rel_tol=rel_tol,
                               max_points=max_points)
    points[system] = [runs[r] for r, _ in curve]
    rates[system] = [r for r, _ in curve]
    found[system] = latency.max_rate_at_slo(rates[system], [v for _, v in curve], slo)
  return {"slo_s_per_token": slo, "unloaded_s_per_token": dict.fromkeys(systems, unloaded),
          "max_rate_at_slo": {s: v["swept"] for s, v in found.items()},
          "max_rate_at_slo_interpolated": {s: v["interpolated"] for s, v in found.items()},
          "probe_req_s": {first: probe}, "start_rate": starts, "rates": rates,
          "points": points, "unloaded_rate": calm, "unloaded_point": unloaded_point}


def serve_point(system: str, rate: float, num_requests: int, *, workload: str, seed: int,
                max_len: int, scale: HarnessScale, kv_budget_tokens: int, block_size: int,
                sizes: Dict, clock, preemption_mode: str, engine_fn,
                mode: Optional[Dict] = None, progress: Optional[Callable] = None) -> Dict:
  """One point of a `--rates=auto` search: `system` serves the first `num_requests` of the
  seeded `workload` stream (lengths at `scale`) arriving at `rate` req/s, on a fresh engine
  from `engine_fn` (one for all, or {system: fn}) sized by `sizes` (`sweep.system_sizes`),
  on `clock`. `progress(total, desc)`: a context manager bar (None: none).
  Returns `sweep.run_point`'s dict. `sweep_auto` runs its points with it, and
  `experiments.rate_points` reruns a committed panel's points with it."""
  reqs = sweep.rate_stream(workload, rate, None, seed, max_len, num_requests, scale)
  bar = progress or (lambda total, desc: contextlib.nullcontext())
  with bar(len(reqs), f"{system} {rate:.4g} req/s") as b:
    return sweep.run_point(system, reqs, kv_budget_tokens=kv_budget_tokens,
                           block_size=block_size, max_len=max_len, sizes=sizes,
                           params_fn=sweep.sampling(mode or {}), clock=clock, progress=b,
                           preemption_mode=preemption_mode,
                           engine_fn=sweep.engine_for(engine_fn, system),
                           max_num_batched_tokens=scale.max_num_batched_tokens)


def sweep_auto(systems: Sequence[str], *, workload: str, seed: int, num_requests: int,
               kv_budget_tokens: int, block_size: int, max_len: int, slo_factor: float,
               mode: Optional[Dict] = None, clock_fn: Callable, headroom: float = 1.5,
               max_seqs_cap: int = 256, preemption_mode: str = "recompute",
               progress: Optional[Callable] = None, scale: HarnessScale,
               engine_fn, max_points: int = 6, shared_prefix_tokens: int = 0,
               release: bool = True) -> Dict:
  """`sweep.sweep_systems` with each system's rates found by `search_systems`.

  Every point serves the first `num_requests` of one seeded stream (its lengths at
  `scale`) at the point's rate, on a fresh engine from `engine_fn` sized by
  `sweep.system_sizes` on the whole stream (`engine_fn`: one for all, or {system: fn}:
  e.g. prefix caching for paged only). num_requests 0: REQUESTS_PER_SLOT x the most
  requests any system's KV memory holds at once (at least MIN_REQUESTS), so a run is long
  against a request's life (counting at most max_seqs_cap, the most any system runs at
  once; a prefix paged caches counted once: `shared_prefix_tokens`). `release`: drop the
  compiled steps when the system changes and at the end (False: the caller bounds them,
  e.g. a figure whose engines share two geometries keeps them across its sampling modes).
  Returns {"systems": {NAME: sweep.curve(...) over the rates run}, "sizes",
  "num_requests", and `search_systems`' keys but "points"}.
  """
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  mode = mode or {}
  num_seqs = max(mode.get("n", 1), mode.get("beam_width", 1))
  if num_requests == 0:
    sample = sweep.rate_stream(workload, 1.0, None, seed, max_len, MIN_REQUESTS, scale)
    conc = min(max_seqs_cap, max(sweep.system_sizes(
        s, sample, kv_budget_tokens=kv_budget_tokens, block_size=block_size, max_len=max_len,
        num_seqs=num_seqs, max_seqs_cap=max_seqs_cap,
        shared_prefix_tokens=shared_prefix_tokens)["memory_concurrency"] for s in systems))
    num_requests = max(MIN_REQUESTS, math.ceil(REQUESTS_PER_SLOT * conc))
  base = sweep.rate_stream(workload, 1.0, None, seed, max_len, num_requests, scale)
  bar = progress
  sizes: Dict[str, Dict] = {}
  current = [None]

  def size(system: str) -> Dict:
    if system not in sizes:
      sizes[system] = sweep.system_sizes(
          system, base, kv_budget_tokens=kv_budget_tokens, block_size=block_size,
          max_len=max_len, num_seqs=num_seqs, headroom=headroom, max_seqs_cap=max_seqs_cap,
          shared_prefix_tokens=shared_prefix_tokens)
    return sizes[system]

  def run(system: str, rate: float, n: int) -> Dict:
    if release and current[0] not in (None, system):
      release_compiled()   # the next system's engine has other shapes
    current[0] = system
    return serve_point(system, rate, n, workload=workload, seed=seed, max_len=max_len,
                       scale=scale, kv_budget_tokens=kv_budget_tokens, block_size=block_size,
                       sizes=size(system), mode=mode, clock=clock_fn(),
                       preemption_mode=preemption_mode, engine_fn=engine_fn, progress=bar)

  def hint(system: str, first_rate: float) -> float:
    """The first system's rate scaled by the requests each one's KV memory holds."""
    return (first_rate * size(system)["memory_concurrency"]
            / size(systems[0])["memory_concurrency"])

  found = search_systems(systems, run, num_requests=num_requests, slo_factor=slo_factor,
                         max_points=max_points, start_hint=hint)
  if release:
    release_compiled()
  points = found.pop("points")
  found["unloaded_point"] = found["unloaded_point"]["summary"]
  curves = {s: sweep.curve(found["rates"][s], points[s]) for s in systems}
  return {"systems": curves, "sizes": sizes, "num_requests": num_requests, **found}
