r"""`make demo`: the headline experiments at small default sizes, one summary table at the end.

    python -m experiments.demo --out=results

Runs, as stages in `--jobs` worker processes (default: one per core): memory waste
(paged vs Orca reservations), the block-size sweep, serving throughput (paged vs
contiguous Orca(Max) at equal KV budget), Fig. 12 on the step clock and at the paper's
scale on the device-time model (short), prefix caching and sharing (parallel sampling /
beam search). Each writes its JSON / PNG under `--out/<experiment>/`;
`--out/summary.json` and `--out/summary.md` hold the closing table, our figures beside
the paper's. Sizes are scaled down so the whole run takes at most 10 minutes on 2 CPU
cores with an empty compilation cache (see README "What is synthetic"); most of that is
XLA compiling the engines' step shapes, one core per compile. Measured 2026-12-05 on this
2-core machine, otherwise idle, empty cache: 585 s with two workers (one process: 1,526 s
at load ~3). The wall-clock rows (CPU requests/s, tokens/s) are then timed while the
other worker runs: `--jobs=1` times them alone.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, List, Optional

from experiments import block_size_sweep
from experiments import common
from experiments import configs
from experiments import provenance
from experiments import sharing
from experiments import task_graph
from experiments import throughput


@dataclasses.dataclass(frozen=True)
class DemoSizes:
  """Default sizes of each experiment in the demo."""
  memory_requests: int = 1000
  sweep_requests: Optional[Dict[str, int]] = None      # block_size_sweep default
  sweep_engine_block_sizes: tuple = (4, 16, 64, 256)
  sweep_engine_requests: int = 32
  throughput_requests: int = 48
  # Prefix caching's memory-bound regime (docs/notes/prefix_cache_miss.md, "The demo's
  # prefix rows"): 4x more requests than the 64 sequence slots, so without caching the
  # 4,096-slot pool bounds the batch through the whole run (~10 5-shot / ~28 1-shot
  # requests at once) and caching lets up to 64 run (with 64 requests the run was mostly
  # the ramp and the longest outputs' tail).
  prefix_requests: int = 256
  # Tokens a step computes: the model's context (1,024), as vLLM v0.1 (the paper's) needs
  # max_num_batched_tokens >= max_model_len. A cached prompt's hit tokens still count
  # against it when it is admitted, so at 256 the 5-shot rows admitted one prompt a step.
  prefix_batched_tokens: int = 1024
  sharing_requests: int = 8
  sharing_widths: tuple = (2, 4, 6)
  paper_scale_requests: int = 60


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def _range(values, fmt) -> str:
  lo, hi = min(values), max(values)
  return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def summary_rows(results: Dict) -> List[List[str]]:
  """[what, ours, paper] rows from the experiments' results (missing ones skipped)."""
  rows = []
  mw = results.get("memory_waste")
  if mw:
    from experiments import memory_waste  # pylint: disable=g-import-not-at-top
    for name in memory_waste.ALLOCATORS:
      rows.append([f"KV memory holding token states, {memory_waste.LABELS[name]} (ShareGPT-like)",
                   _pct(mw[name]["token_utilization"]),
                   _pct(memory_waste.PAPER_TOKEN_STATES[name])])
    rows.append(["mean concurrent requests, paged / Orca(Oracle); / Orca(Max)",
                 f"{mw['paged']['mean_concurrent'] / mw['orca_oracle']['mean_concurrent']:.2f}x; "
                 f"{mw['paged']['mean_concurrent'] / mw['orca_max']['mean_concurrent']:.2f}x",
                 "2.2x; 4.3x"])
  tp = results.get("throughput")
  if tp:
    for name, row in tp.items():
      rows.append([f"throughput paged / contiguous Orca(Max), {name}-like "
                   "(tokens per step; CPU wall req/s)",
                   f"{row['speedup_tokens_per_step']:.2f}x; {row['speedup_requests_per_s']:.2f}x",
                   "2-4x"])
  sbm = results.get("serving_benchmark")
  if sbm:
    from experiments import serving_benchmark  # pylint: disable=g-import-not-at-top
    for clock, r in sbm.items():
      rows.extend(serving_benchmark.demo_rows(r, f"ShareGPT-like, {clock} clock"))
  ps = results.get("paper_scale")
  if ps:
    rows.extend([f"{what} (short demo run)", ours, paper] for what, ours, paper in ps["rows"])
  pc = results.get("prefix_caching")
  if pc and pc.get("summary_rows"):
    rows.extend(pc["summary_rows"])
  elif "prefix_caching" in results:
    rows.append(["shared-prefix speed-up (1-shot; 5-shot)", "not measured: "
                 + str(results["prefix_caching"].get("note", "")), "1.67x; 3.58x"])
  sh = results.get("sharing")
  if sh:
    for name in dict.fromkeys(r["workload"] for r in sh):
      for mode in sharing.MODES:
        sel = [r["savings"] for r in sh if r["workload"] == name and r["mode"] == mode]
        lo, hi = sharing.PAPER_SAVINGS[(name, mode)]
        widths = [r["width"] for r in sh if r["workload"] == name and r["mode"] == mode]
        rows.append([f"blocks saved by sharing, {mode} n/width {min(widths)}-{max(widths)}, "
                     f"{name}-like", _range(sel, _pct), f"{_pct(lo)}-{_pct(hi)}"])
  sweep = results.get("block_size_sweep")
  if sweep:
    for name, b in block_size_sweep.best_block_sizes(sweep).items():
      rows.append([f"best block size, {name}-like (by {b['by']}; measured "
                   f"{','.join(map(str, b['measured_block_sizes']))})",
                   f"{b['best']} (within 5%: {b['good_range'][0]}-{b['good_range'][1]})",
                   f"{b['paper'][0]}-{b['paper'][1]}"])
    for name in dict.fromkeys(r["workload"] for r in sweep):
      r16 = next((r for r in sweep if r["workload"] == name and r["block_size"] == 16), None)
      if r16:
        rows.append([f"KV memory holding token states, paged block 16, {name}-like "
                     "(sweep budget)", _pct(r16["token_utilization"]),
                     "96.3%" if name == "sharegpt" else ""])
        if r16.get("prefix_hit_rate") is not None:
          rows.append([f"prefix-cache hit rate (prompt tokens), 80-token shared prompt, block 16, "
                       f"{name}-like", _pct(r16["prefix_hit_rate"]), "(not reported)"])
  return rows


def _paper_scale(out, num_requests: int) -> Dict:
  """Fig. 12 at the paper's scale, short: OPT-13B on one A100-40GB (its Table 1 KV budget,
  2,048-token context, unscaled ShareGPT-like stream), paged vs Orca(Oracle),
  each system's rate found by running it, `num_requests` per point (the full figure:
  `python -m experiments.paper_scale`)."""
  from experiments import paper_scale  # pylint: disable=g-import-not-at-top
  from experiments import paper_scale_plots  # pylint: disable=g-import-not-at-top
  # Orca(Max) is left out: its few-row steps take most of the time (~3,000 steps a point).
  f = paper_scale.Config(figs=("12",), fig12_models=("opt-13b",), fig12_workloads=("sharegpt",),
                         systems=("paged", "orca_oracle"),
                         num_requests=num_requests, out=str(out / "paper_scale"),
                         jobs=1)   # the demo's stages already run side by side
  res = paper_scale.run(f, common.out_dir(f.out))["results"]
  rows = paper_scale_plots.summary_rows(res)
  print(common.table(rows, ["figure", "ours", "paper"]))
  return {"rows": rows}


def _prefix_caching(out, num_requests: int, budget: int = DemoSizes.prefix_batched_tokens):
  """Shared-prefix speed-up: `experiments.prefix_caching.compare` (caching off vs on, same
  engine and budget, outputs checked identical) on `bench.prefix_serving`'s few-shot
  requests for the paper's 1-shot (80-token) and 5-shot (341-token) prefixes, all
  arriving at once, on a 4,096-slot pool with 64 sequence slots and `budget` tokens a
  step. Writes prefix_caching_demo/prefix_caching_demo.json (rows, engine settings,
  versions, machine with the load average at the end, "load_avg_start", "seconds",
  "executables": the compiled step shapes held, made and released in the process).
  Returns {"rows": [...], "summary_rows": [[what, ours, paper]]}.
  """
  import os  # pylint: disable=g-import-not-at-top
  from experiments import prefix_caching as module  # pylint: disable=g-import-not-at-top
  from paged_jax import executables  # pylint: disable=g-import-not-at-top
  from paged_jax.bench import prefix_serving  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  start, load_start = time.time(), list(os.getloadavg())
  engine_kw = dict(block_size=16, kv_budget_tokens=4096, max_seqs=64, max_len=1024,
                   budget=budget)
  rows, summary = [], []
  for shots in (1, 5):
    prefix, requests = prefix_serving.few_shot_requests(num_requests, shots, 0)
    row = module.compare(f"{shots}-shot", prefix, requests, **engine_kw)
    rows.append(row)
    # The two rows meet ~27 step shapes each (off and on engines): drop one row's before
    # the next, so the process holds ~27 executables, not ~46 (~1,000 memory maps each).
    release_compiled()
    paper = module.PAPER_SPEEDUP.get(f"{shots}-shot")
    summary.append([f"shared-prefix throughput, caching on / off, {shots}-shot "
                    f"({len(prefix)}-token prefix, {num_requests} requests; hit rate "
                    f"{100 * row['hit_rate']:.0f}%)", f"{row['throughput_ratio']:.2f}x",
                    f"{paper}x" if paper else ""])
  common.write_json(out / "prefix_caching_demo" / "prefix_caching_demo.json",
                    {"rows": rows, "engine": engine_kw, "seconds": time.time() - start,
                     "load_avg_start": load_start, "versions": provenance.versions(),
                     "machine": provenance.machine(), "code": provenance.code_version(),
                     "executables": executables.BUDGET.stats()})
  return {"rows": rows, "summary_rows": summary}


def _serving_benchmark(out) -> Dict:
  """A short Fig. 12 sweep (ShareGPT-like, paged vs Orca(Max) / Orca(Oracle)) on the
  virtual step clock: every step costs the same (the memory-bound GPU case), so the
  figures do not depend on this machine's load or compile times. The wall-clock sweep,
  which first compiles every step shape each system can reach (minutes per system on
  2 CPU cores), is `experiments.serving_benchmark --clock=wall`."""
  from experiments import serving_benchmark as sb  # pylint: disable=g-import-not-at-top
  res = {}
  for clock, rates in (("step", (4.0, 8.0, 12.0, 16.0, 24.0)),):
    f = sb.Config(rates=rates, duration_s=4.0, clock=clock,
                  systems=("paged", "orca_max", "orca_oracle"))
    r = sb.run(f)
    common.write_json(out / "serving_benchmark" / f"{clock}_clock" / "serving_benchmark.json", r)
    print(common.table(sb.summary_rows(r), sb.HEADERS))
    res[clock] = r
  return res


def _memory_waste(out, sizes: DemoSizes) -> Dict:
  from experiments import memory_waste  # pylint: disable=g-import-not-at-top
  mw = memory_waste.run(memory_waste.Config(workload="sharegpt", num_requests=sizes.memory_requests,
                                            block_size=16, kv_budget_tokens=14336))
  common.write_json(out / "memory_waste" / "memory_waste.json", mw)
  memory_waste.plot(mw, out / "memory_waste" / "memory_waste.png",
                    f"ShareGPT-like, {sizes.memory_requests} requests, KV budget 14336 tokens, "
                    "block size 16")
  print(memory_waste.summary_table(mw))
  return mw


def _block_size_sweep(out, sizes: DemoSizes) -> List[Dict]:
  sweep_config = block_size_sweep.Config(
      engine_block_sizes=sizes.sweep_engine_block_sizes,
      engine_num_requests=sizes.sweep_engine_requests,
      **({} if sizes.sweep_requests is None else {"num_requests": sizes.sweep_requests}))
  rows = block_size_sweep.run(sweep_config)
  block_size_sweep.write_jsonl(rows, out / "block_size_sweep" / "block_size_sweep.jsonl")
  best = block_size_sweep.best_block_sizes(rows)
  common.write_json(out / "block_size_sweep" / "block_size_sweep_best.json", best)
  block_size_sweep.plot(rows, out / "block_size_sweep" / "block_size_sweep.png", best)
  print(common.table(block_size_sweep.summary_rows(rows), block_size_sweep.HEADERS))
  return rows


def _throughput(out, sizes: DemoSizes) -> Dict:
  tp = throughput.run(throughput.Config(num_requests=sizes.throughput_requests))
  common.write_json(out / "throughput" / "throughput.json",
                    {"results": tp, "paper": throughput.PAPER_SPEEDUP})
  throughput.plot(tp, out / "throughput" / "throughput.png")
  print(common.table(throughput.summary_rows(tp), throughput.HEADERS))
  return tp


def _sharing(out, sizes: DemoSizes) -> List[Dict]:
  sh = sharing.run(sharing.Config(widths=sizes.sharing_widths,
                                  num_requests=sizes.sharing_requests))
  common.write_json(out / "sharing" / "sharing.json", {"rows": sh})
  sharing.plot(sh, out / "sharing" / "sharing.png")
  print(common.table(sharing.summary_rows(sh), sharing.HEADERS))
  return sh


def _prefix_stage(out, sizes: DemoSizes) -> Dict:
  res = _prefix_caching(out, sizes.prefix_requests, sizes.prefix_batched_tokens)
  for row in res.get("summary_rows") or []:
    print(" | ".join(row))
  return res


# name: (the stage's heading, its function, about its seconds with an empty compilation
# cache on a 2-core CPU, 2026-12-05: `task_graph` starts the longest first).
STAGES = {
    "memory_waste": ("memory waste (paged vs Orca, ShareGPT-like)", _memory_waste, 12),
    "block_size_sweep": ("block-size sweep", _block_size_sweep, 300),
    "throughput": ("throughput (paged vs contiguous Orca(Max), equal KV budget)",
                   _throughput, 90),
    "serving_benchmark": ("serving under Poisson arrivals (paged vs Orca, equal KV memory; "
                          "Fig. 12)", lambda out, sizes: _serving_benchmark(out), 40),
    "paper_scale": ("Fig. 12 at the paper's scale (OPT-13B / A100-40GB on the device-time "
                    "model)", lambda out, sizes: _paper_scale(out, sizes.paper_scale_requests),
                    130),
    "prefix_caching": ("prefix caching (1-shot / 5-shot shared prefix, caching on vs off)",
                       _prefix_stage, 600),
    "sharing": ("sharing (parallel sampling, beam search)", _sharing, 320),
}


def run_stage(name: str, out: str, sizes: DemoSizes) -> Dict:
  """One stage of the demo (a `STAGES` name) into `out`: {"result", "seconds"}."""
  import pathlib  # pylint: disable=g-import-not-at-top
  heading, fn, _ = STAGES[name]
  print(f"== {heading}", flush=True)
  t = time.time()
  result = fn(pathlib.Path(out), sizes)
  return {"result": result, "seconds": time.time() - t}


def run_all(out, sizes: DemoSizes = DemoSizes(), jobs: int = 1) -> Dict:
  """Runs every stage, `jobs` side by side in worker processes (`experiments.task_graph`:
  each stage compiles its own engines' steps, and XLA:CPU compiles one step on one core,
  so two workers on two cores take about half the time); writes each stage's files;
  returns their results + "seconds" (per stage). Each stage starts with no compiled
  executables (XLA:CPU executables hold memory maps; a process keeping every stage's
  would meet the kernel's per-process map limit)."""
  from experiments import paper_scale_parts  # pylint: disable=g-import-not-at-top
  from paged_jax import compile_cache  # pylint: disable=g-import-not-at-top
  tasks = [task_graph.Task(name, run_stage, args=(name, str(out), sizes), cost=cost)
           for name, (_, _, cost) in STAGES.items()]
  t0, cpu_s = time.time(), {}

  def event(kind, name, info):
    if kind == "done":
      cpu_s[name] = info["cpu_s"]
      print(f"[{(time.time() - t0) / 60:5.1f} min] done {name}: {info['seconds']:.0f} s, "
            f"{info['cpu_s']:.0f} CPU-s (worker {info['worker']}, load "
            f"{info['load_avg_end']:.1f})", flush=True)

  done = task_graph.run(tasks, jobs, init=paper_scale_parts.worker_init,
                        init_args=(compile_cache.directory() or "none",
                                   provenance.code_version()),
                        after_part=paper_scale_parts.after_part, on_event=event)
  results = {name: done[name]["result"] for name in STAGES}
  results["seconds"] = {name: done[name]["seconds"] for name in STAGES}
  results["cpu_s"] = cpu_s
  # The same schedule on the stages' CPU seconds: the wall time of this run on an
  # otherwise idle machine with `jobs` cores (the load through the run does not count).
  results["idle_machine_s"] = task_graph.simulate(
      [dataclasses.replace(t, cost=cpu_s[t.name]) for t in tasks], jobs)["makespan"]
  return results


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.demo."""
  jobs: int = configs.flag(0, "worker processes running the stages side by side (0: this "
                           "machine's cores; 1: one after another in this process)", lower=0)
  out: str = configs.flag("results", "output directory")


def main(f: Config, out):
  """Runs every experiment into `out`, then the closing table (the `common.run_app` main)."""
  import jax  # pylint: disable=g-import-not-at-top
  start = time.time()
  jobs = f.jobs or task_graph.default_jobs()
  results = run_all(out, jobs=jobs)
  total = time.time() - start
  rows = summary_rows(results)
  table = common.table(rows, ["what", "ours", "paper"])
  machine = f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})"
  common.write_json(out / "summary.json", {
      "rows": rows, "seconds": results["seconds"], "total_seconds": total, "jobs": jobs,
      "cpu_s": results["cpu_s"], "idle_machine_s": results["idle_machine_s"],
      "load_avg_end": list(os.getloadavg()),
      "machine_line": machine, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
      **provenance.run_metadata(f)})
  (out / "summary.md").write_text(f"{table}\n\n{machine}; {total:.0f} s in all\n")
  print(f"\n== summary ({total:.0f} s, {jobs} worker(s); on an idle machine "
        f"{results['idle_machine_s']:.0f} s; {machine})")
  print(table)


if __name__ == "__main__":
  common.run_app(main, Config)
