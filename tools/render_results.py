r"""Renders the results tables of README.md / BENCHMARKS.md from the committed JSON.

    python tools/render_results.py            # rewrite README.md and BENCHMARKS.md in place
    python tools/render_results.py --check    # exit 1 (naming the files) if any would change
    python tools/render_results.py --list     # the section names and the JSON each reads
    make results                              # the first form

A Markdown file asks for a table with a pair of marker comments; everything between
them is replaced by the table rendered from experiments/results/:

    <!-- results:memory_waste -->
    (generated: do not edit by hand)
    <!-- /results:memory_waste -->

A section renders with the experiment's own `summary_rows` / `summary_table` where it has
one (the table reads as the experiment printed it); otherwise a renderer here reads the
committed files only (GPU runs, the compile report, host overhead, the claims `index`).
Columns are not padded, to keep the docs small. An unknown section name, a missing result
file or an unclosed marker is an error naming the file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable, Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
DOCS = ("README.md", "BENCHMARKS.md")
MARKER = re.compile(r"<!-- results:(?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)"
                    r"<!-- /results:(?P=name) -->", re.S)
OPEN = re.compile(r"<!-- results:([a-z0-9_]+) -->")


def _load(results_dir: str, rel: str):
  path = os.path.join(results_dir, rel)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no committed result (run the experiment first)")
  with open(path) as f:
    if rel.endswith(".jsonl"):
      return [json.loads(line) for line in f if line.strip()]
    return json.load(f)


def _table(rows, headers) -> str:
  from experiments import common  # pylint: disable=g-import-not-at-top
  return common.table(rows, headers)


def _memory_waste(doc) -> str:
  from experiments import memory_waste  # pylint: disable=g-import-not-at-top
  return memory_waste.summary_table(doc)


def _rows_with(module: str, key=None) -> Callable:
  """A renderer: `module.summary_rows(doc[key] or doc)` under `module.HEADERS`."""
  def render(doc) -> str:
    import importlib  # pylint: disable=g-import-not-at-top
    mod = importlib.import_module(f"experiments.{module}")
    return _table(mod.summary_rows(doc if key is None else doc[key]), mod.HEADERS)
  return render


def _hf_peer(doc) -> str:
  from experiments import hf_peer_bench  # pylint: disable=g-import-not-at-top
  rows = [[mode, name, e["median_s"], e["output_tokens_per_s"], e["requests_per_s"]]
          for mode, m in doc["modes"].items() for name, e in m["engines"].items()]
  return _table(rows, hf_peer_bench.HEADERS)


def _hf_peer_runs(results_dir: str) -> str:
  """Both committed hf_peer runs (32 and 128 prompts): tokens/s per mode and the ratio."""
  rows = []
  for rel in ("hf_peer/hf_peer.json", "hf_peer/batch128/hf_peer.json"):
    doc = _load(results_dir, rel)
    for mode in ("steady", "end_to_end"):
      e = doc["modes"][mode]["engines"]
      rows.append([doc["workload"]["num_prompts"], doc["workload"]["kv_blocks"], mode,
                   f"{e['paged_jax']['output_tokens_per_s']:.0f}",
                   f"{e['transformers']['output_tokens_per_s']:.0f}",
                   f"{doc['modes'][mode]['ratio_tokens_per_s']:.2f}x",
                   f"{doc['agreement']['exact_match_fraction']:.2f}"])
  return _table(rows, ["prompts", "KV blocks", "mode", "paged_jax tok/s", "transformers tok/s",
                       "ratio", "outputs equal"])


def _serving_runs(results_dir: str) -> List[Tuple[str, dict]]:
  """(run directory, JSON) of every committed serving_benchmark run, in name order."""
  base = os.path.join(results_dir, "serving_benchmark")
  runs = sorted(d for d in (os.listdir(base) if os.path.isdir(base) else [])
                if os.path.exists(os.path.join(base, d, "serving_benchmark.json")))
  if not runs:
    raise FileNotFoundError(f"{base}/*/serving_benchmark.json: no committed result "
                            "(run the experiment first)")
  return [(d, _load(base, os.path.join(d, "serving_benchmark.json"))) for d in runs]


def _max_rate(sec: dict, name: str) -> str:
  """'24 (26.8)': swept rate (interpolated crossing); '>=8' when no swept rate missed."""
  swept, interp = sec["max_rate_at_slo"][name], sec["max_rate_at_slo_interpolated"][name]
  return f">={swept:g}" if interp is None else f"{swept:g} ({interp:.1f})"


def _serving(results_dir: str) -> str:
  """Per run and system: engine slots, max request rate under the SLO, paged's ratio."""
  rows = []
  for run, doc in _serving_runs(results_dir):
    for name, c in doc["systems"].items():
      ratio = doc["paged_rate_ratio"].get(f"paged_over_{name}")
      rows.append([run, name, c["max_seqs"], _max_rate(doc, name),
                   "" if ratio is None else f"{ratio:.2f}x", f"{max(c['mean_running']):.1f}"])
  return _table(rows, ["run", "system", "max_seqs", "max req/s at SLO", "paged / it",
                       "max mean running"])


def _serving_fig14(results_dir: str) -> str:
  """The --fig14 sections: paged vs Orca(Oracle) with parallel sampling and beam search."""
  rows = []
  for run, doc in _serving_runs(results_dir):
    for mode, sec in doc.get("fig14", {}).items():
      ratio = sec["paged_rate_ratio"].get("paged_over_orca_oracle")
      bound = ">=" if sec["max_rate_at_slo_interpolated"]["paged"] is None else ""
      rows.append([run, mode, _max_rate(sec, "paged"), _max_rate(sec, "orca_oracle"),
                   "" if ratio is None else f"{bound}{ratio:.2f}x"])
  if not rows:
    raise FileNotFoundError("no committed serving_benchmark run has a fig14 section")
  return _table(rows, ["run", "mode", "paged req/s", "Orca(Oracle) req/s", "paged / Oracle"])


def _summary(doc) -> str:
  return _table(doc["rows"], ["what", "ours", "paper"])


def _x(v, digits: int = 2) -> str:
  """A ratio cell; '-' where there is none (a missing or NaN figure)."""
  return "-" if v is None or v != v else f"{v:.{digits}f}"


# ---- the H200 run of experiments/gpu_check.sh (gpu_check_h200/) ----------------------------

def _median_ms(timings, name):
  t = timings.get(name, {})
  return t["median_s"] * 1e3 if "median_s" in t else None


def _ratio(a, b):
  return None if a is None or b is None else a / b


def _gpu_kernel(doc) -> str:
  """kernel_bench.json of a GPU run: the decode kernel per (batch, context, block size)."""
  rows = []
  for r in doc["results"]:
    if "timings" not in r:
      continue
    t = r["timings"]
    ours = _median_ms(t, "kernel_paged")
    rows.append([r["batch"], r["context"], r["block_size"], f"{ours:.3f}",
                 f"{t['kernel_paged']['GBps']:.0f}",
                 _x(t["kernel_paged"].get("fraction_of_copy_bw")),
                 _x(_ratio(ours, _median_ms(t, "kernel_contiguous"))),
                 _x(_ratio(_median_ms(t, "jax_paged"), ours)),
                 _x(_ratio(_median_ms(t, "dense"), ours))])
  return _table(rows, ["batch", "context", "block", "paged ms", "GB/s", "of copy bw",
                       "paged/contig", "JAX paged op/ours", "dense/ours"])


def _gpu_ragged(doc) -> str:
  """ragged_bench.json of a GPU run: the ragged (prefill + decode) kernel per scenario."""
  rows = []
  for r in doc["results"]:
    if "error" in r:
      rows.append([r["scenario"], r["block_size"], "error", "-", "-", "-", "-", "-", "-"])
      continue
    t = r["timings"]
    ours = _median_ms(t, "ragged_paged")
    p = t["ragged_paged"]
    rows.append([r["scenario"], r["block_size"], f"{ours:.3f}", f"{p['GBps']:.0f}",
                 _x(p.get("fraction_of_copy_bw")), f"{p['TFLOPs']:.1f}",
                 _x(_ratio(ours, _median_ms(t, "ragged_contiguous"))),
                 _x(_ratio(_median_ms(t, "dense"), ours)),
                 _x(_ratio(_median_ms(t, "decode_kernel"), ours))])
  return _table(rows, ["scenario", "block", "ms", "GB/s", "of copy bw", "TFLOP/s",
                       "paged/contig", "dense/ours", "decode kernel/ours"])


def _gpu_env(text: str) -> str:
  """env.txt (+ summary.txt, tests.log beside it) of a gpu_check.sh run."""
  lines = [l.strip() for l in text.splitlines()]
  gpu_header = next(i for i, l in enumerate(lines) if l.startswith("name, memory.total"))
  gpu = dict(zip([h.strip() for h in lines[gpu_header].split(",")],
                 [v.strip() for v in lines[gpu_header + 1].split(",")]))
  jax_line = next(l for l in lines if l.startswith("jax "))
  python = next(l for l in lines if re.match(r"\d+\.\d+\.\d+ ", l)).split()[0]
  rows = [["date", " ".join(lines[0].split())], ["commit", lines[1][:12]],
          ["device", f"{gpu['name']}, {gpu['memory.total [MiB]']}, driver {gpu['driver_version']}"],
          ["software", f"Python {python}, {jax_line}"]]
  return _table(rows, ["", "H200 run (experiments/gpu_check.sh)"])


def _gpu_steps(doc) -> str:
  """summary.txt (step, status, rc, time) and the pytest summary line of tests.log."""
  tail = [l.strip("= ") for l in doc["tests"].splitlines()
          if re.search(r"\d+ (passed|failed)", l)]
  failed: Dict[str, List[str]] = {}   # test -> parameter ids
  for l in doc["tests"].splitlines():
    if l.startswith("FAILED "):
      m = re.match(r"(?P<test>[^\[\s]+)(?:\[(?P<param>[^\]]*)\])?", l.split()[1].split("::")[-1])
      failed.setdefault(m["test"], []).extend([m["param"]] if m["param"] else [])
  detail = (tail[-1].split(" in ")[0] if tail else "") + "".join(
      f"; {t}" + (f"[{','.join(sorted(p))}]" if p else "") for t, p in failed.items())
  rows = []
  for line in doc["summary"].splitlines():
    if line.strip():
      name, status, rc, secs = line.split()
      rows.append([name, status, rc.split("=")[-1], secs, detail if name == "tests" else ""])
  return _table(rows, ["step", "status", "rc", "time", "detail"])


# ---- deviceless sm_90 compile (gpu_compile_report/) -----------------------------------------

def _gpu_compile(doc) -> str:
  """One row per config: its launches' tiles, the largest shared memory and register count,
  total spill bytes, XLA's temp bytes and the modelled time (K/V bytes over HBM bandwidth)."""
  rows = []
  for r in doc["rows"]:
    ls = r["launches"]
    tiles = ", ".join(re.sub(r"^(paged_decode_|ragged_paged_attention_)", "", l["kernel"])
                      for l in ls)
    rows.append([r["case"], tiles, "/".join(sorted({f"{l['warps']}w{l['stages']}s" for l in ls})),
                 f"{max(l['shared_memory'] for l in ls) / 1024:.0f}",
                 max(l["registers"] for l in ls), sum(l["spill_bytes"] for l in ls),
                 f"{r['modelled_time_us']:.1f}", f"{r['temp_bytes'] / 2**20:.1f}"])
  for f in doc["failures"]:
    rows.append([f["case"], "FAILED: " + f["error"][:60], "", "", "", "", "", ""])
  return _table(rows, ["case", "launches", "warps, stages", "smem KiB", "regs", "spill B",
                       "modelled us", "temp MiB"])


# ---- engine results without a summary_rows of their own ---------------------------------------

def _host_overhead(doc) -> str:
  rows = [[name, r["device_calls"], f"{r['wall_us_per_token']:.1f}",
           f"{r['host_us_per_token']:.1f}", f"{r['device_us_per_token']:.1f}",
           f"{r['host_overhead_ratio_vs_python']:.2f}", f"{r['wall_ratio_vs_python']:.2f}",
           r["same_tokens_as_python_allocator"]] for name, r in doc["results"].items()]
  return _table(rows, ["path", "device calls", "wall us/token", "host us/token",
                       "device us/token", "host vs python", "wall vs python", "same tokens"])


def _prefix_sweep(doc) -> str:
  rows = [[r["block_size"], f"{r['hit_rate']:.3f}", f"{r['lost_tokens']:.1f}"]
          for r in doc["block_size_sweep"]]
  return _table(rows, ["block size", "hit tokens / shared tokens", "shared tokens lost (mean)"])


def _us(s: float) -> str:
  return f"{s * 1e6:.1f}" if s < 1e-3 else f"{s * 1e6:,.0f}"


def _prefix_cost(doc) -> str:
  rows = [[f"{r['num_blocks']:,}", _us(r["lookup_s_per_block"]), _us(r["evict16_s"]),
           _us(r["topk16_s"]), _us(r["count_evictable_s"])] for r in doc["lookup_cost"]]
  return _table(rows, ["num_blocks", "lookup us / block", "evict 16 (LRU ring) us",
                       "evict 16 (top-k scan) us", "count evictable us"])


# ---- the claims index: one row per claim, every figure read from a committed JSON -------------

def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def _index_rows(results_dir: str) -> List[list]:
  load = lambda rel: _load(results_dir, rel)
  rows = []
  mw = load("memory_waste/memory_waste.json")
  order = ("paged", "orca_oracle", "orca_pow2", "orca_max")
  rows.append(["KV memory holding tokens: paged / Orca Oracle / Pow2 / Max",
               " / ".join(_pct(mw[k]["token_utilization"]) for k in order),
               "96.3% / 38.2% / 26.8% / 20.4%", "memory_waste/", "`experiments.memory_waste`"])
  real_path = os.path.join(results_dir, "serving_benchmark", "sharegpt_real_table1.json")
  if os.path.exists(real_path):
    real = load("serving_benchmark/sharegpt_real_table1.json")
    t1 = real["table1"]
    rmw = real["memory_waste_1000_requests_kv14336_block16"]["sharegpt-real"]
    rows.append([f"real ShareGPT trace ({t1['tokenizer'].split()[0]}): mean in / out tokens; "
                 "KV holding tokens as above",
                 f"{t1['mean_input']:.1f} / {t1['mean_output']:.1f}; "
                 + " / ".join(_pct(rmw[k]["token_utilization"]) for k in order),
                 f"{t1['paper_mean_input']} / {t1['paper_mean_output']}; as above",
                 "serving_benchmark/", "`command` in its JSON"])
  conc = lambda k: mw["paged"]["mean_concurrent"] / mw[k]["mean_concurrent"]
  rows.append(["concurrent requests, paged over Orca Oracle; Max",
               f"{conc('orca_oracle'):.2f}x; {conc('orca_max'):.2f}x", "2.2x; 4.3x",
               "memory_waste/", "`experiments.memory_waste`"])
  tp = load("throughput/throughput.json")["results"]
  rows.append(["tokens per step, paged over Orca Max (ShareGPT; Alpaca)",
               "; ".join(f"{tp[w]['speedup_tokens_per_step']:.2f}x" for w in ("sharegpt", "alpaca")),
               "2-4x (throughput, Fig. 12)", "throughput/", "`experiments.demo`"])
  sh = load("sharing/sharing.json")["rows"]
  for mode in ("parallel", "beam"):
    ours, paper = [], []
    for w in ("sharegpt", "alpaca"):
      rs = [r for r in sh if r["workload"] == w and r["mode"] == mode]
      ours.append(f"{_pct(min(r['savings'] for r in rs))}-{_pct(max(r['savings'] for r in rs))}")
      paper.append("-".join(_pct(x) for x in rs[0]["paper_savings"]))
    rows.append([f"blocks saved, {mode} width 2-6 (ShareGPT; Alpaca)", "; ".join(ours),
                 "; ".join(paper), "sharing/", "`experiments.demo`"])
  pc = {r["workload"]: r for r in load("prefix_caching/prefix_caching.json")["serving"]}
  shots = [k for k in pc if pc[k]["paper_ratio"]]
  rows.append(["prefix caching on over off (" + ", ".join(shots) + ")",
               "; ".join(f"{pc[k]['throughput_ratio']:.2f}x" for k in shots),
               "; ".join(f"{pc[k]['paper_ratio']}x" for k in shots), "prefix_caching/",
               "`experiments.prefix_caching`"])
  for run, doc in _serving_runs(results_dir):
    r = doc["paged_rate_ratio"]
    sharegpt = doc["flags"]["workload"].startswith("sharegpt")
    rows.append([f"max req/s at the latency SLO, paged over Orca Max; Oracle "
                 f"({doc['flags']['workload']}, {doc['flags']['clock']} clock)",
                 "; ".join(_x(r.get(f"paged_over_{k}")) + "x" for k in ("orca_max", "orca_oracle")),
                 "2.7-8x; 1.7-2.7x" if sharegpt else "2-4x", f"serving_benchmark/{run}/",
                 "`experiments.serving_benchmark`"])
  best = load("block_size_sweep/block_size_sweep_best.json")
  rows.append(["best block size (ShareGPT; Alpaca)",
               "; ".join(f"{best[w]['best']}" for w in ("sharegpt", "alpaca")),
               "; ".join("-".join(map(str, best[w]["paper"])) for w in ("sharegpt", "alpaca")),
               "block_size_sweep/", "`experiments.demo`"])
  kb = load("gpu_check_h200/kernel_bench.json")
  at = [r for r in kb["results"] if r.get("batch") == 64 and r.get("context") == 4096
        and r.get("block_size") == 16 and "timings" in r]
  if at:
    t = at[0]["timings"]
    ours = _median_ms(t, "kernel_paged")
    rows.append(["H200 decode, B=64 ctx 4096 bs 16: share of copy bandwidth",
                 _x(t["kernel_paged"]["fraction_of_copy_bw"]), "-", "gpu_check_h200/",
                 "`experiments/gpu_check.sh`"])
    rows.append(["H200, same: JAX's paged op time / ours; paged / contiguous",
                 f"{_x(_ratio(_median_ms(t, 'jax_paged'), ours))}x; "
                 f"{_x(_ratio(ours, _median_ms(t, 'kernel_contiguous')))}",
                 "-; 1.20-1.26", "gpu_check_h200/", "`experiments/gpu_check.sh`"])
  gc = load("gpu_compile_report/gpu_compile_report.json")
  spills = sum(1 for r in gc["rows"] if r["spilled"])
  smem = max(r["max_shared_memory"] for r in gc["rows"])
  rows.append(["sm_90 configs compiled, not run: failed, spilled, max smem",
               f"{len(gc['rows'])}: {len(gc['failures'])}, {spills}, "
               f"{smem:,} of {gc['target']['shared_memory_per_block_optin']:,} B",
               "-", "gpu_compile_report/", "`experiments.gpu_compile_report`"])
  hf = load("hf_peer/hf_peer.json")
  hf128 = load("hf_peer/batch128/hf_peer.json")
  rows.append(["tokens/s over transformers (32; 128 prompts, steady)",
               f"{hf['modes']['steady']['ratio_tokens_per_s']:.2f}x; "
               f"{hf128['modes']['steady']['ratio_tokens_per_s']:.2f}x", "-", "hf_peer/",
               "`experiments.hf_peer_bench`"])
  return rows


def _index(results_dir: str) -> str:
  return _table(_index_rows(results_dir), ["claim", "ours", "paper", "results/", "command"])


def _with(*parts: str) -> Callable:
  """A loader for several files of one directory, as {stem: content}."""
  def load(results_dir: str):
    out = {}
    for rel in parts:
      path = os.path.join(results_dir, rel)
      if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no committed result (run the experiment first)")
      with open(path) as f:
        out[os.path.splitext(os.path.basename(rel))[0]] = f.read()
    return out
  return load


# name: (what it reads under experiments/results/, renderer of it -> Markdown). The first
# item is a JSON path (parsed for the renderer) or a loader(results_dir) -> content.
SECTIONS: Dict[str, Tuple[object, Callable]] = {
    "summary": ("summary.json", _summary),
    "index": (lambda d: d, _index),
    "memory_waste": ("memory_waste/memory_waste.json", _memory_waste),
    "block_size_sweep": ("block_size_sweep/block_size_sweep.jsonl", _rows_with("block_size_sweep")),
    "sharing": ("sharing/sharing.json", _rows_with("sharing", "rows")),
    "preemption": ("preemption/preemption.json", _rows_with("preemption", "rows")),
    "throughput": ("throughput/throughput.json", _rows_with("throughput", "results")),
    "hf_peer": ("hf_peer/hf_peer.json", _hf_peer),
    "hf_peer_batch128": ("hf_peer/batch128/hf_peer.json", _hf_peer),
    "hf_peer_runs": (lambda d: d, _hf_peer_runs),
    "serving_benchmark": (lambda d: d, _serving),
    "serving_benchmark_fig14": (lambda d: d, _serving_fig14),
    "prefix_caching": ("prefix_caching/prefix_caching.json", _rows_with("prefix_caching",
                                                                        "serving")),
    "prefix_caching_block_size": ("prefix_caching/prefix_caching.json", _prefix_sweep),
    "prefix_caching_cost": ("prefix_caching/prefix_caching.json", _prefix_cost),
    "prefix_caching_demo": ("prefix_caching_demo/prefix_caching_demo.json",
                            _rows_with("prefix_caching", "rows")),
    "host_overhead": ("host_overhead/host_overhead.json", _host_overhead),
    "gpu_check_h200_env": (_with("gpu_check_h200/env.txt"), lambda d: _gpu_env(d["env"])),
    "gpu_check_h200_steps": (_with("gpu_check_h200/summary.txt", "gpu_check_h200/tests.log"),
                             _gpu_steps),
    "gpu_check_h200_kernel": ("gpu_check_h200/kernel_bench.json", _gpu_kernel),
    "gpu_check_h200_ragged": ("gpu_check_h200/ragged_bench.json", _gpu_ragged),
    "gpu_compile_report": ("gpu_compile_report/gpu_compile_report.json", _gpu_compile),
}


def render_section(name: str, results_dir: str = RESULTS) -> str:
  """The Markdown table of section `name` from the JSON under `results_dir`."""
  if name not in SECTIONS:
    raise ValueError(f"unknown results section {name!r}; known: {sorted(SECTIONS)}")
  source, render = SECTIONS[name]
  return _compact(render(_load(results_dir, source) if isinstance(source, str)
                         else source(results_dir)))


def _compact(table: str) -> str:
  """The Markdown table without column padding (same cells; the docs stay small)."""
  out = []
  for line in table.splitlines():
    cells = [c.strip() for c in line.strip()[1:-1].split(" | ")]
    if all(c and set(c) <= {"-"} for c in cells):
      cells = ["---"] * len(cells)
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def render_text(text: str, where: str = "<text>", results_dir: str = RESULTS) -> str:
  """`text` with the body of every marker pair replaced by its rendered table."""
  closed = {m.start() for m in MARKER.finditer(text)}
  for m in OPEN.finditer(text):
    if m.start() not in closed:
      raise ValueError(f"{where}: <!-- results:{m.group(1)} --> has no matching "
                       f"<!-- /results:{m.group(1)} -->")
  cache: Dict[str, str] = {}

  def fill(m):
    name = m.group("name")
    if name not in cache:
      try:
        cache[name] = render_section(name, results_dir)
      except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{where}: {e}") from None
    return f"<!-- results:{name} -->\n{cache[name]}\n<!-- /results:{name} -->"

  return MARKER.sub(fill, text)


def render_files(paths: Sequence[str], check: bool = False,
                 results_dir: str = RESULTS) -> List[str]:
  """Renders each file in place (or, with `check`, only reports); returns the files whose
  text changed (or would change)."""
  changed = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      old = f.read()
    new = render_text(old, path, results_dir)
    if new != old:
      changed.append(path)
      if not check:
        with open(path, "w", encoding="utf-8") as f:
          f.write(new)
  return changed


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("files", nargs="*", help=f"Markdown files (default: {' '.join(DOCS)})")
  parser.add_argument("--check", action="store_true", help="report only; exit 1 on a change")
  parser.add_argument("--list", action="store_true", help="print the section names")
  parser.add_argument("--results", default=RESULTS, help="results directory")
  args = parser.parse_args(argv)
  if args.list:
    for name, (source, _) in SECTIONS.items():
      print(f"{name}\t{source if isinstance(source, str) else 'several files'}")
    return 0
  sys.path.insert(0, ROOT)   # `experiments` importable when run as a script
  files = args.files or [os.path.join(ROOT, d) for d in DOCS]
  try:
    changed = render_files(files, check=args.check, results_dir=args.results)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  for path in changed:
    print(f"{'would change' if args.check else 'rendered'}: {os.path.relpath(path, ROOT)}")
  return 1 if args.check and changed else 0


if __name__ == "__main__":
  sys.exit(main())
