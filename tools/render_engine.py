"""Renderers of the engine experiments' results (memory, serving, sharing, prefix caching,
the transformers peer, host overhead) for tools/render_results.py."""

from __future__ import annotations

import os
from typing import Callable, List, Tuple

from render_common import load, table


def memory_waste(doc) -> str:
  from experiments import memory_waste as experiment  # pylint: disable=g-import-not-at-top
  return experiment.summary_table(doc)


def rows_with(module: str, key=None, rows: str = "summary_rows",
              headers: str = "HEADERS") -> Callable:
  """A renderer: `module.<rows>(doc[key] or doc)` under `module.<headers>`."""
  def render(doc) -> str:
    import importlib  # pylint: disable=g-import-not-at-top
    mod = importlib.import_module(f"experiments.{module}")
    return table(getattr(mod, rows)(doc if key is None else doc[key]), getattr(mod, headers))
  return render


def hf_peer(doc) -> str:
  from experiments import hf_peer_bench  # pylint: disable=g-import-not-at-top
  rows = [[mode, name, e["median_s"], e["output_tokens_per_s"], e["requests_per_s"]]
          for mode, m in doc["modes"].items() for name, e in m["engines"].items()]
  return table(rows, hf_peer_bench.HEADERS)


def hf_peer_runs(results_dir: str) -> str:
  """Every committed hf_peer run (hf_peer/**/hf_peer.json): tokens/s per mode, the
  ratio and, where measured, the compute floor's bound on any ratio."""
  base = os.path.join(results_dir, "hf_peer")
  rels = sorted(os.path.relpath(os.path.join(d, "hf_peer.json"), results_dir)
                for d, _, files in os.walk(base) if "hf_peer.json" in files)
  rows = []
  for rel in rels:
    doc = load(results_dir, rel)
    w = doc["workload"]
    model = ("shipped" if "num_params" not in w or w["checkpoint"].endswith("tiny_byte_llama")
             else f"random {w['num_params'] / 1e6:.0f}M")
    floor = doc.get("compute_floor")
    for mode in ("steady", "end_to_end"):
      e = doc["modes"][mode]["engines"]
      rows.append([os.path.dirname(rel), model, w["num_prompts"], w["kv_blocks"],
                   w["decode_steps_per_sync"], mode,
                   f"{e['paged_jax']['output_tokens_per_s']:.0f}",
                   f"{e['transformers']['output_tokens_per_s']:.0f}",
                   f"{doc['modes'][mode]['ratio_tokens_per_s']:.2f}x",
                   f"{floor['max_ratio_over_transformers']:.2f}x"
                   if floor and mode == "steady" else "",
                   f"{doc['agreement']['exact_match_fraction']:.2f}"])
  return table(rows, ["run", "model", "prompts", "KV blocks", "steps/sync", "mode",
                      "paged_jax tok/s", "transformers tok/s", "ratio", "floor bound",
                      "outputs equal"])


def hf_peer_floor(results_dir: str) -> str:
  """Where the 25M-model runs' time goes: achieved GFLOP/s of each engine beside this
  CPU's GEMM rate, the bound paged_jax's own kernels set (compute_floor.kernel_floor,
  with the most it could then beat transformers by), and the attention cost per layer
  beside the projection GEMMs."""
  base = os.path.join(results_dir, "hf_peer")
  rows = []
  for d in sorted(os.listdir(base)):
    rel = os.path.join("hf_peer", d, "hf_peer.json")
    if not os.path.exists(os.path.join(results_dir, rel)):
      continue
    doc = load(results_dir, rel)
    fl = doc.get("compute_floor", {})
    if "attention" not in fl:
      continue
    e, at = doc["modes"]["steady"]["engines"], fl["attention"]
    rows.append([d, doc["workload"]["decode_steps_per_sync"],
                 f"{e['paged_jax']['achieved_gflops']:.0f}",
                 f"{e['transformers']['achieved_gflops']:.0f}",
                 f"{fl['best_gemm_gflops']:.0f}", f"{fl['floor_s']:.2f}",
                 (f"{fl['kernels']['kernel_floor_s']:.2f} ({fl['max_ratio_at_kernels']:.2f}x)"
                  if "kernels" in fl else "-"),
                 f"{at['decode_ms_per_layer']:.2f} / {at['decode_gemm_ms_per_layer']:.2f}",
                 f"{at['mixed_ms_per_layer']:.2f} / {at['mixed_gemm_ms_per_layer']:.2f}"])
  return table(rows, ["run", "steps/sync", "paged_jax GFLOP/s", "transformers GFLOP/s",
                      "best GEMM GFLOP/s", "floor s", "kernel bound s (max ratio)",
                      "decode attn / GEMM ms per layer",
                      "mixed attn / GEMM ms per layer"])


def serving_runs(results_dir: str) -> List[Tuple[str, dict]]:
  """(run directory, JSON) of every committed serving_benchmark run, in name order."""
  base = os.path.join(results_dir, "serving_benchmark")
  runs = sorted(d for d in (os.listdir(base) if os.path.isdir(base) else [])
                if os.path.exists(os.path.join(base, d, "serving_benchmark.json")))
  if not runs:
    raise FileNotFoundError(f"{base}/*/serving_benchmark.json: no committed result "
                            "(run the experiment first)")
  return [(d, load(base, os.path.join(d, "serving_benchmark.json"))) for d in runs]


def _max_rate(sec: dict, name: str) -> str:
  """'24 (26.8)': swept rate (interpolated crossing); '>=8' when no swept rate missed."""
  swept, interp = sec["max_rate_at_slo"][name], sec["max_rate_at_slo_interpolated"][name]
  return f">={swept:g}" if interp is None else f"{swept:g} ({interp:.1f})"


def rate_ratio(sec: dict, name: str) -> str:
  """Paged's max rate over system `name`'s, as a bound where a system met the SLO at
  every swept rate (its true maximum lies above the sweep): '>=' when paged did,
  '<=' when `name` did; '' when there is no ratio."""
  ratio = sec["paged_rate_ratio"].get(f"paged_over_{name}")
  if ratio is None:
    return ""
  interp = sec["max_rate_at_slo_interpolated"]
  paged_open, other_open = interp["paged"] is None, interp.get(name) is None
  bound = "" if paged_open == other_open else (">=" if paged_open else "<=")
  return f"{bound}{ratio:.2f}x"


def serving(results_dir: str, every_row: bool = True) -> str:
  """Per run and system: engine slots, max request rate under the SLO, paged's ratio.
  `every_row=False` names each run on its first row only (smaller)."""
  rows = []
  for run, doc in serving_runs(results_dir):
    for i, (name, c) in enumerate(doc["systems"].items()):
      rows.append([run if every_row or not i else "", name, c["max_seqs"], _max_rate(doc, name),
                   rate_ratio(doc, name), f"{max(c['mean_running']):.1f}"])
  return table(rows, ["run", "system", "max_seqs", "max req/s at SLO", "paged / it",
                       "max mean running"])


def serving_saturation(results_dir: str) -> str:
  """Per wall-clock run and system, at its highest swept rate (every system saturated):
  what a step holds and costs on this CPU. 'rows / ms' (mean running per device ms of a
  step) over Orca(Max)'s is the throughput the batching buys here; on the step clock it
  would be the ratio of mean running alone (a step costs the same whatever it holds)."""
  def running_and_ms(c):
    return c["mean_running"][-1], 1e3 * c["device_s"][-1] / c["steps"][-1]

  rows = []
  for run, doc in serving_runs(results_dir):
    if doc["flags"].get("clock") != "wall":
      continue
    base = None
    if "orca_max" in doc["systems"]:
      running, ms = running_and_ms(doc["systems"]["orca_max"])
      base = running / ms
    for i, (name, c) in enumerate(doc["systems"].items()):
      running, ms = running_and_ms(c)
      rel = f"{running / ms / base:.2f}x" if base else ""
      rows.append(["" if i else f"{run} ({c['rates'][-1]:g}/s)", name, f"{running:.1f}",
                   f"{ms:.2f}", rel, f"{c['throughput_req_s'][-1]:.1f}", c["preemptions"][-1]])
  if not rows:
    raise FileNotFoundError("no committed wall-clock serving_benchmark run")
  return table(rows, ["run (top rate)", "system", "running", "ms / step",
                      "rows / ms over Orca(Max)", "req/s served", "preempted"])


def serving_fig14(results_dir: str) -> str:
  """The --fig14 sections: paged vs Orca(Oracle) with parallel sampling and beam search."""
  rows = []
  for run, doc in serving_runs(results_dir):
    for mode, sec in doc.get("fig14", {}).items():
      paged = sec["systems"]["paged"]
      rows.append([run, mode, _max_rate(sec, "paged"), _max_rate(sec, "orca_oracle"),
                   rate_ratio(sec, "orca_oracle"),
                   f"{sum(paged['preemptions'])} ({sum(paged.get('swaps', [0]))})"])
  if not rows:
    raise FileNotFoundError("no committed serving_benchmark run has a fig14 section")
  return table(rows, ["run", "mode", "paged req/s", "Orca(Oracle) req/s", "paged / Oracle",
                      "paged preemptions (swapped), all rates"])


def summary(doc) -> str:
  return table(doc["rows"], ["what", "ours", "paper"])


def host_overhead(doc) -> str:
  rows = [[name, r["device_calls"], f"{r['wall_us_per_token']:.1f}",
           f"{r['host_us_per_token']:.1f}", f"{r['device_us_per_token']:.1f}",
           f"{r['host_overhead_ratio_vs_python']:.2f}", f"{r['wall_ratio_vs_python']:.2f}",
           r["same_tokens_as_python_allocator"]] for name, r in doc["results"].items()]
  return table(rows, ["path", "device calls", "wall us/token", "host us/token",
                       "device us/token", "host vs python", "wall vs python", "same tokens"])


def prefix_sweep(doc) -> str:
  rows = [[r["block_size"], f"{r['hit_rate']:.3f}", f"{r['lost_tokens']:.1f}"]
          for r in doc["block_size_sweep"]]
  return table(rows, ["block size", "hit tokens / shared tokens", "shared tokens lost (mean)"])


def _us(s: float) -> str:
  return f"{s * 1e6:.1f}" if s < 1e-3 else f"{s * 1e6:,.0f}"


def prefix_cost(doc) -> str:
  rows = [[f"{r['num_blocks']:,}", _us(r["lookup_s_per_block"]), _us(r["evict16_s"]),
           _us(r["topk16_s"]), _us(r["count_evictable_s"])] for r in doc["lookup_cost"]]
  return table(rows, ["num_blocks", "lookup us / block", "evict 16 (LRU ring) us",
                       "evict 16 (top-k scan) us", "count evictable us"])
