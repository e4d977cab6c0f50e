r"""More points on a committed `--rates=auto` panel, and its SLO crossings re-read with them.

    python -m experiments.rate_points \
        --panel=experiments/results/paper_scale/fig12_long/opt-13b-sharegpt/serving_benchmark.json \
        --points=paged@2.05,paged@2.15,orca_oracle@1.2,orca_oracle@1.25 --out=DIR

`--rates=auto`'s search stops when its bracket around a system's SLO crossing is within
25% (`rate_search.search_systems`' rel_tol), so a panel's max rate is a linear
interpolation across up to 25% of rate, where the latency curve bends sharply (queueing
sets in). Rerunning the whole panel with a finer search costs what it cost (an hour a
1,000-request panel here); the engine and the virtual clock are deterministic, so a point
run again on the panel's stream, sizes and flags reads exactly what the search would have
(this module checks that by rerunning one committed point first, `--check_point`).

Each `system@rate` point serves the panel's first `num_requests` requests of its seeded
stream at that rate, on an engine sized as the panel's (`sizes` in its JSON) and the
panel's clock: `rate_search.sweep_auto`'s point. Writes DIR/rate_points.json: the new
points, each system's merged curve (committed + new, by rate), the panel's SLO and the
crossings re-read (`latency.max_rate_at_slo`), paged's ratios over the others, with the
flags, versions and machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Dict, List, Sequence, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from experiments import serving_benchmark as sb
from paged_jax.bench import latency
from paged_jax.bench import rate_search
from paged_jax.bench import sweep as serving_sweep


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.rate_points."""
  panel: str = configs.flag("", "a serving_benchmark.json written with --rates=auto")
  points: Tuple[str, ...] = configs.flag((), "system@rate points to run (req/s)")
  check_point: bool = configs.flag(True, "first rerun the panel's lowest point of its first "
                                   "system and stop unless it reads the committed latency")
  out: str = configs.flag("results/rate_points", "output directory")

  def check(self) -> None:
    if not self.panel:
      raise ValueError("--panel is required (a serving_benchmark.json)")
    if not self.points:
      raise ValueError("--points is empty (system@rate, ...)")
    parse_points(self.points)


def parse_points(specs: Sequence[str]) -> List[Tuple[str, float]]:
  """[(system, rate)] from "system@rate" strings; ValueError (one line) on a bad one."""
  out = []
  for spec in specs:
    system, _, rate = spec.partition("@")
    try:
      value = float(rate)
    except ValueError:
      value = math.nan
    if system not in serving_sweep.SYSTEMS or not math.isfinite(value) or value <= 0:
      raise ValueError(f"--points: {spec!r} is not system@rate with system in "
                       f"{serving_sweep.SYSTEMS} and a finite rate > 0")
    out.append((system, value))
  return out


def merged_crossings(panel: Dict, new: Dict[str, Dict[float, float]]) -> Dict:
  """Each system's curve (the panel's points and `new` {system: {rate: latency}}, by rate)
  and its max rate at the panel's SLO; paged's ratios over the others (interpolated)."""
  slo = panel["slo_s_per_token"]
  curves, found = {}, {}
  for system, c in panel["systems"].items():
    pts = dict(zip(c["rates"], c["normalized_latency_s_per_token"]))
    pts.update(new.get(system, {}))
    rates = sorted(pts)
    curves[system] = {"rates": rates, "normalized_latency_s_per_token": [pts[r] for r in rates]}
    found[system] = latency.max_rate_at_slo(rates, [pts[r] for r in rates], slo)
  interp = {s: v["interpolated"] for s, v in found.items()}
  ratios = {f"paged_over_{s}": interp["paged"] / v for s, v in interp.items()
            if s != "paged" and v and interp.get("paged")}
  return {"slo_s_per_token": slo, "curves": curves,
          "max_rate_at_slo": {s: v["swept"] for s, v in found.items()},
          "max_rate_at_slo_interpolated": interp, "paged_rate_ratio": ratios}


def _panel_config(panel: Dict) -> sb.Config:
  flags = {k: tuple(v) if isinstance(v, list) else v for k, v in panel["flags"].items()}
  unknown = sorted(set(flags) - set(configs.fields(sb.Config)))
  if unknown:
    raise ValueError(f"--panel: flags {unknown} are not serving_benchmark's (an older run?)")
  if flags.get("rates") != ("auto",):
    raise ValueError("--panel: its rates were not searched (--rates=auto)")
  return sb.Config(**flags)


def run_point(panel: Dict, f: sb.Config, system: str, rate: float) -> Dict:
  """`rate_search.sweep_auto`'s point: the panel's stream, sizes, engine and clock."""
  d = sb.deployment(f)
  return rate_search.serve_point(
      system, rate, panel["num_requests"], workload=f.workload, seed=f.seed,
      max_len=d["max_len"], scale=d["scale"], kv_budget_tokens=d["kv_budget_tokens"],
      block_size=f.block_size, sizes=panel["sizes"][system], clock=d["clock_fn"](),
      preemption_mode=f.preemption_mode, engine_fn=d["engine_fn"],
      progress=lambda total, desc: common.progress(total=total, desc=desc))


def run(f: Config) -> Dict:
  panel = json.loads(open(f.panel).read())
  pf = _panel_config(panel)
  start = time.time()
  result: Dict = {"panel": f.panel, "points": []}
  if f.check_point:
    system = next(iter(panel["systems"]))
    c = panel["systems"][system]
    rate, want = c["rates"][0], c["normalized_latency_s_per_token"][0]
    got = run_point(panel, pf, system, rate)["summary"]["normalized_latency_s_per_token"]
    result["check_point"] = {"system": system, "rate": rate, "committed": want, "rerun": got}
    if not math.isclose(got, want, rel_tol=1e-9):
      raise RuntimeError(f"--check_point: {system} at {rate:g} req/s reads {got:.6g} s/token, "
                         f"the panel {want:.6g}: the code or flags differ from the panel's")
  new: Dict[str, Dict[float, float]] = {}
  for system, rate in parse_points(f.points):
    t0, c0 = time.time(), time.process_time()
    s = run_point(panel, pf, system, rate)["summary"]
    new.setdefault(system, {})[rate] = s["normalized_latency_s_per_token"]
    result["points"].append({"system": system, "rate": rate, **{
        k: s[k] for k in ("normalized_latency_s_per_token", "throughput_req_s", "ttft_p50_s",
                          "tpot_p50_s")},
        "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0})
  result.update(merged_crossings(panel, new))
  result["seconds"] = time.time() - start
  result["flags"] = f.flags()
  result["versions"] = provenance.versions(())
  result["machine"] = provenance.machine()
  result["code"] = provenance.code_version()
  return result


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = run(f)
  common.write_json(out / "rate_points.json", result)
  for s, v in result["max_rate_at_slo_interpolated"].items():
    if v is None:   # no point misses the SLO: the crossing lies above the highest rate
      print(f"{s}: every point meets the SLO (max rate at it: above "
            f"{result['curves'][s]['rates'][-1]:.4g} req/s)")
    else:
      print(f"{s}: max rate at the SLO {v:.4g} req/s (interpolated, merged curve)")
  print(f"paged over: {result['paged_rate_ratio']}\nwrote {out / 'rate_points.json'}")


if __name__ == "__main__":
  common.run_app(main, Config)
