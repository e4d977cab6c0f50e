"""Latency metrics of an online serving run, and the sustainable rate under an SLO.

Inputs are per-request timestamps in seconds from the run's start (one clock):
`arrival` (when the request was offered), `first_token` (when its first output
token was on the host), `finish` (when its last was), and `output_len` (tokens
generated per sequence). Definitions (the vLLM paper's, Sec. 6.1, plus the
usual serving ones):

  normalized latency  mean over requests of (finish - arrival) / output_len, s/token
  TTFT                first_token - arrival, s
  TPOT                (finish - first_token) / (output_len - 1), s/token, requests
                      with output_len >= 2 only
  throughput          finished requests / (last finish - first arrival), req/s
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import numpy as np


def _pct(x: np.ndarray, q: float) -> float:
  return float(np.percentile(x, q)) if x.size else math.nan


def summarize(arrival: Sequence[float], first_token: Sequence[float], finish: Sequence[float],
              output_len: Sequence[int]) -> Dict[str, float]:
  """Latency summary of one run (module docstring); all arrays f64[num_requests].

  Returns {"requests", "normalized_latency_s_per_token", "mean_latency_s",
  "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "throughput_req_s",
  "throughput_tok_s", "makespan_s"}. A NaN first_token (not observed) gives NaN TTFT/TPOT.
  """
  a, f = np.asarray(arrival, float), np.asarray(finish, float)
  t1, n = np.asarray(first_token, float), np.asarray(output_len, float)
  if not a.shape == f.shape == t1.shape == n.shape or a.ndim != 1 or a.size == 0:
    raise ValueError(f"need equal-length non-empty 1-D arrays, got shapes "
                     f"{a.shape}, {t1.shape}, {f.shape}, {n.shape}")
  if np.any(n < 1) or np.any(f < a):
    raise ValueError("need output_len >= 1 and finish >= arrival for every request")
  latency = f - a
  multi = n >= 2
  tpot = (f[multi] - t1[multi]) / (n[multi] - 1)
  makespan = float(f.max() - a.min())
  return {
      "requests": int(a.size),
      "normalized_latency_s_per_token": float(np.mean(latency / n)),
      "mean_latency_s": float(latency.mean()),
      "ttft_p50_s": _pct(t1 - a, 50), "ttft_p99_s": _pct(t1 - a, 99),
      "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
      "throughput_req_s": a.size / makespan if makespan > 0 else math.inf,
      "throughput_tok_s": float(n.sum()) / makespan if makespan > 0 else math.inf,
      "makespan_s": makespan,
  }


def slo_from_unloaded(unloaded: Sequence[float], factor: float) -> float:
  """The SLO rule: `factor` x the LARGEST unloaded normalized latency among the systems,
  so every system meets it when unloaded (s/token)."""
  if not factor >= 1:
    raise ValueError(f"SLO factor must be >= 1, got {factor}")
  vals = [v for v in unloaded if math.isfinite(v)]
  if not vals:
    raise ValueError("no finite unloaded latency to derive the SLO from")
  return factor * max(vals)


def max_rate_at_slo(rates: Sequence[float], latency: Sequence[float], slo: float
                    ) -> Dict[str, Optional[float]]:
  """Highest request rate sustained under `slo`.

  Returns {"swept": the highest swept rate such that it and every lower swept rate meet
  the SLO (0.0 if the lowest misses), "interpolated": the rate where the latency curve,
  linear between swept rates, crosses the SLO (None when no swept rate misses it: the
  sweep did not reach the limit)}.
  """
  order = np.argsort(rates)
  r, lat = np.asarray(rates, float)[order], np.asarray(latency, float)[order]
  ok = lat <= slo
  k = int(np.argmin(ok)) if not ok.all() else r.size   # first miss
  swept = float(r[k - 1]) if k > 0 else 0.0
  if k == r.size:
    return {"swept": swept, "interpolated": None}
  if k == 0:
    return {"swept": 0.0, "interpolated": 0.0}
  frac = (slo - lat[k - 1]) / (lat[k] - lat[k - 1])
  return {"swept": swept, "interpolated": float(r[k - 1] + frac * (r[k] - r[k - 1]))}


def slo_and_rates(curves: Dict[str, Dict], factor: float) -> Dict:
  """The SLO of a sweep and each system's highest rate under it.

  Args:
    curves: {system: {"rates": [...], "normalized_latency_s_per_token": [...]}}.
    factor: the SLO is `factor` x the largest normalized latency any system has at its
      lowest swept rate (the unloaded latency; `slo_from_unloaded`).
  Returns:
    {"slo_s_per_token", "unloaded_s_per_token": {system: s/token},
    "max_rate_at_slo": {system: swept rate}, "max_rate_at_slo_interpolated": {system:
    rate or None}} (`max_rate_at_slo`).
  """
  unloaded = {s: c["normalized_latency_s_per_token"][c["rates"].index(min(c["rates"]))]
              for s, c in curves.items()}
  slo = slo_from_unloaded(list(unloaded.values()), factor)
  found = {s: max_rate_at_slo(c["rates"], c["normalized_latency_s_per_token"], slo)
           for s, c in curves.items()}
  return {"slo_s_per_token": slo, "unloaded_s_per_token": unloaded,
          "max_rate_at_slo": {s: v["swept"] for s, v in found.items()},
          "max_rate_at_slo_interpolated": {s: v["interpolated"] for s, v in found.items()}}


def max_rate(result: Dict, system: str) -> Optional[float]:
  """`system`'s max rate at the SLO in a result holding `slo_and_rates`' two dicts (a
  serving_benchmark JSON, a sweep's): where its curve crossed the SLO, else the highest
  rate swept under it (a lower bound); None for a system the result lacks."""
  return (result["max_rate_at_slo_interpolated"].get(system)
          or result["max_rate_at_slo"].get(system))


def rate_ratios(max_rate: Dict[str, Optional[float]], base: str = "paged") -> Dict[str, float]:
  """{f"{base}_over_{s}": base's sustainable rate over s's} for every other system s (inf
  when s sustains none; systems without a rate left out)."""
  p = max_rate.get(base)
  return {f"{base}_over_{s}": (p / r if r else math.inf) for s, r in max_rate.items()
          if s != base and p is not None and r is not None}
