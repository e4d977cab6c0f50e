"""Per-step cost of one paper-scale point: this tree against a base tree, side by side.

    git archive main | tar -x -C /tmp/base
    python -m experiments.step_host_cost --base_tree=/tmp/base --rounds=2 \
        --out=experiments/results/host_overhead

Each run is a fresh process on one tree (PYTHONPATH=tree) that serves the point twice
(`sweep.run_point` on the stand-in engine under the virtual model clock) and times the
second, warm run (no compiles): CPU seconds (`time.process_time`, XLA's threads
included) and wall. Trees alternate (base, this, base, this, ...) so the shared
machine's load hits both alike. The model clock is virtual, so the point's summary
(latency, throughput, steps, preemptions) must be identical across trees: `same_summary`.
Writes OUT/step_host_cost.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import Dict, Optional

import numpy as np

from experiments import common
from experiments import configs
from experiments import provenance

# Run in the tree under test (only paged_jax.bench's public point API: old trees have it).
_POINT = """
import json, sys, time
from paged_jax.bench import paper_scale, sweep
model, gpu, w, system, rate, n = sys.argv[1:7]
st = paper_scale.setting(model, gpu)
reqs = sweep.rate_stream(w, float(rate), None, 0, st.scale.max_len, int(n), st.scale)
kv = st.kv_budget_tokens(16)
sizes = sweep.system_sizes(system, reqs, kv_budget_tokens=kv, block_size=16,
                           max_len=st.scale.max_len, max_seqs_cap=256)
def once():
  t0, c0 = time.perf_counter(), time.process_time()
  res = sweep.run_point(system, reqs, kv_budget_tokens=kv, block_size=16,
                        max_len=st.scale.max_len, sizes=sizes, clock=st.clock(16),
                        engine_fn=st.make_engine,
                        max_num_batched_tokens=st.scale.max_num_batched_tokens,
                        preemption_mode="auto")
  return res, time.perf_counter() - t0, time.process_time() - c0
once()
res, wall, cpu = once()
print("POINT " + json.dumps(dict(summary=res["summary"], steps=res["steps"],
      preemptions=res["preemptions"], wall_s=wall, cpu_s=cpu), default=str))
"""


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.step_host_cost."""
  base_tree: str = configs.flag("", "the base code (e.g. `git archive main` unpacked)")
  rounds: int = configs.flag(2, "timed runs per tree (alternating)", lower=1)
  model: str = configs.flag("opt-13b", "paper-scale model (bench.paper_scale)")
  gpu: str = configs.flag("a100-40gb", "paper-scale GPU")
  workload: str = configs.flag("sharegpt", "workload")
  system: str = configs.flag("paged", "serving system")
  rate: float = configs.flag(2.0, "request rate (req/s)", lower=0, lower_open=True)
  num_requests: int = configs.flag(200, "requests", lower=1)
  out: str = configs.flag("results/host_overhead", "output directory")


def _run(tree: str, f: Config) -> Dict:
  args = [f.model, f.gpu, f.workload, f.system, str(f.rate), str(f.num_requests)]
  env = dict(os.environ, PYTHONPATH=tree)
  proc = subprocess.run([sys.executable, "-c", _POINT, *args], cwd=tree, env=env,
                        capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("POINT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"the point failed in {tree}: {proc.stderr.strip()[-2000:]}")
  out = json.loads(lines[-1][len("POINT "):])
  out["load_average"] = os.getloadavg()
  return out


def run(f: Config) -> Dict:
  if not f.base_tree or not pathlib.Path(f.base_tree, "paged_jax").is_dir():
    raise ValueError(f"--base_tree must be a directory holding paged_jax, got {f.base_tree!r}")
  here = str(pathlib.Path(__file__).resolve().parents[1])
  trees = {"base": str(pathlib.Path(f.base_tree).resolve()), "this": here}
  runs = {name: [] for name in trees}
  for _ in common.progress(range(f.rounds)):
    for name, tree in trees.items():
      runs[name].append(_run(tree, f))
  med = {name: {k: float(np.median([r[k] for r in rs])) for k in ("cpu_s", "wall_s")}
         for name, rs in runs.items()}
  # The least CPU time of a tree's runs: the least disturbed by the shared machine.
  least = {name: min(r["cpu_s"] for r in rs) for name, rs in runs.items()}
  steps = runs["this"][0]["steps"]
  summaries = [json.dumps([r["summary"], r["steps"], r["preemptions"]], sort_keys=True)
               for rs in runs.values() for r in rs]
  return {"runs": runs, "median": med, "steps": steps,
          "same_summary": len(set(summaries)) == 1,
          "steps_per_cpu_s": {n: steps / m["cpu_s"] for n, m in med.items()},
          "cpu_ratio_base_over_this": med["base"]["cpu_s"] / med["this"]["cpu_s"],
          "least_cpu_s": least, "least_cpu_ratio_base_over_this": least["base"] / least["this"],
          "wall_ratio_base_over_this": med["base"]["wall_s"] / med["this"]["wall_s"],
          **provenance.run_metadata(f)}


def main(f: Config, out: Optional[pathlib.Path]):
  """Runs with settings `f` into `out` (the `common.run_app` main)."""
  res = run(f)
  rows = [[n, res["median"][n]["cpu_s"], res["median"][n]["wall_s"],
           res["steps_per_cpu_s"][n]] for n in ("base", "this")]
  common.report(res, out, "step_host_cost.json", rows,
                ["tree", "cpu s (median)", "wall s (median)", "steps / cpu s"],
                [f"steps {res['steps']}; same summary: {res['same_summary']}; "
                 f"cpu ratio base/this {res['cpu_ratio_base_over_this']:.2f} (median), "
                 f"{res['least_cpu_ratio_base_over_this']:.2f} (least), "
                 f"wall {res['wall_ratio_base_over_this']:.2f}"])


if __name__ == "__main__":
  common.run_app(main, Config)
