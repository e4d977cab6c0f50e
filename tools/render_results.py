r"""Renders the results tables of the docs (README.md, BENCHMARKS.md, docs/**/*.md) from
the committed JSON.

    python tools/render_results.py            # rewrite every doc in DOCS in place
    python tools/render_results.py --check    # exit 1 (naming the files) if any would change
    python tools/render_results.py --list     # the section names and the JSON each reads
    make results                              # the first form

A Markdown file asks for a table with a pair of marker comments; everything between
them is replaced by the table rendered from experiments/results/:

    <!-- results:memory_waste -->
    (generated: do not edit by hand)
    <!-- /results:memory_waste -->

A section renders with the experiment's own `summary_rows` / `summary_table` where it has
one (the table reads as the experiment printed it); otherwise a renderer reads the committed
files only: render_engine.py (engine experiments), render_gpu.py (the H200 run, the
deviceless compile reports), render_paper.py (paper scale, perf validation),
render_index.py (the claims index); render_common.py holds the shared helpers. Columns
are not padded, to keep the docs small. An unknown section name, a missing result file or
an unclosed marker is an error naming the file.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Callable, Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the render_* modules
# pylint: disable=g-import-not-at-top,wrong-import-position
import render_engine as engine
import render_gpu as gpu
import render_paper as paper
from render_common import RESULTS, ROOT, load, with_files
from render_index import index

# The Markdown files rendered (patterns relative to the repository root): a table may sit in
# any of them, so a note under docs/ that shows a result renders it like BENCHMARKS does.
DOCS = ("README.md", "BENCHMARKS.md", "docs/**/*.md")
MARKER = re.compile(r"<!-- results:(?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)"
                    r"<!-- /results:(?P=name) -->", re.S)
OPEN = re.compile(r"<!-- results:([a-z0-9_]+) -->")
_RESULTS_DIR = lambda d: d   # a renderer that reads several files itself

# name: (what it reads under experiments/results/, renderer of it -> Markdown). The first
# item is a JSON path (parsed for the renderer) or a loader(results_dir) -> content.
SECTIONS: Dict[str, Tuple[object, Callable]] = {
    "summary": ("summary.json", engine.summary),
    "index": (_RESULTS_DIR, index),
    "memory_waste": ("memory_waste/memory_waste.json", engine.memory_waste),
    "block_size_sweep": ("block_size_sweep/block_size_sweep.jsonl",
                         engine.rows_with("block_size_sweep")),
    "sharing": ("sharing/sharing.json", engine.rows_with("sharing", "rows")),
    "preemption": ("preemption/preemption.json", engine.rows_with("preemption", "rows")),
    "throughput": ("throughput/throughput.json", engine.rows_with("throughput", "results")),
    "throughput_fit": ("throughput/throughput.json",
                       engine.rows_with("throughput", "results", "fit_rows", "FIT_HEADERS")),
    "hf_peer": ("hf_peer/hf_peer.json", engine.hf_peer),
    "hf_peer_batch128": ("hf_peer/batch128/hf_peer.json", engine.hf_peer),
    "hf_peer_runs": (_RESULTS_DIR, engine.hf_peer_runs),
    "hf_peer_floor": (_RESULTS_DIR, engine.hf_peer_floor),
    "step_cost": ("step_cost/step_cost.json", engine.rows_with("step_cost")),
    "serving_benchmark": (_RESULTS_DIR, engine.serving),
    "serving_benchmark_compact": (_RESULTS_DIR, lambda d: engine.serving(d, every_row=False)),
    "serving_benchmark_fig14": (_RESULTS_DIR, engine.serving_fig14),
    "serving_saturation": (_RESULTS_DIR, engine.serving_saturation),
    "prefix_caching": ("prefix_caching/prefix_caching.json",
                       engine.rows_with("prefix_caching", "serving")),
    "prefix_caching_block_size": ("prefix_caching/prefix_caching.json", engine.prefix_sweep),
    "prefix_caching_cost": ("prefix_caching/prefix_caching.json", engine.prefix_cost),
    "prefix_miss": ("prefix_miss/prefix_miss.json", engine.rows_with("prefix_miss")),
    "policies": ("policies/policies.json", engine.rows_with("policies")),
    "hybrid_caching": ("hybrid_caching/hybrid_caching.json", engine.rows_with("hybrid_caching")),
    "hybrid_scale": ("hybrid_scale/hybrid_scale.json", engine.rows_with("hybrid_scale")),
    "hybrid_scale_burst": ("hybrid_scale/burst/hybrid_scale.json",
                           engine.rows_with("hybrid_scale", None, "burst_rows",
                                            "BURST_HEADERS")),
    "hybrid_scale_burst_long": ("hybrid_scale/burst_long/hybrid_scale.json",
                                engine.rows_with("hybrid_scale", None, "burst_rows",
                                                 "BURST_HEADERS")),
    "hybrid_scale_burst_27b": ("hybrid_scale/burst_27b/hybrid_scale.json",
                               engine.rows_with("hybrid_scale", None, "burst_rows",
                                                "BURST_HEADERS")),
    "hybrid_scale_vllm": ("hybrid_scale/hybrid_scale.json",
                          engine.rows_with("hybrid_scale", None, "vllm_rows", "VLLM_HEADERS")),
    "speculative": ("speculative/speculative.json", engine.rows_with("speculative")),
    "speculative_backoff": ("speculative/backoff_counts/speculative.json",
                            engine.rows_with("speculative", None, "count_rows",
                                             "COUNT_HEADERS")),
    "speculative_draft": ("speculative/draft_model/speculative_draft.json",
                          engine.rows_with("speculative_draft")),
    "speculative_draft_prefix": ("speculative/draft_model_prefix/speculative_draft.json",
                                 engine.rows_with("speculative_draft")),
    "speculative_scale": ("speculative_scale/speculative_scale.json",
                          engine.rows_with("speculative_scale")),
    "speculative_scale_kv": (lambda d: {"runs": [
        (run, load(d, f"speculative_scale/{run}/speculative_scale.json")) for run in (
            "kv_half", "kv_half_seed1", "kv_half_alpha", "kv_quarter", "kv_full")]},
                             engine.rows_with("speculative_scale", None, "kv_runs_rows",
                                              "KV_RUNS_HEADERS")),
    "speculative_blocks": ("speculative_blocks/speculative_blocks.json",
                           engine.rows_with("speculative_blocks")),
    "host_tier": ("host_tier/host_tier.json", engine.rows_with("host_tier")),
    "host_tier_scale": ("host_tier_scale/host_tier_scale.json",
                        engine.rows_with("host_tier_scale")),
    "prefix_caching_demo": ("prefix_caching_demo/prefix_caching_demo.json",
                            engine.rows_with("prefix_caching", "rows")),
    "host_overhead": ("host_overhead/host_overhead.json", engine.host_overhead),
    "gpu_check_h200_env": (with_files("gpu_check_h200/env.txt"),
                           lambda d: gpu.gpu_env(d["env"])),
    "gpu_check_h200_steps": (with_files("gpu_check_h200/summary.txt", "gpu_check_h200/tests.log"),
                             gpu.gpu_steps),
    "gpu_check_h200_kernel": ("gpu_check_h200/kernel_bench.json", gpu.gpu_kernel),
    "gpu_check_h200_ragged": ("gpu_check_h200/ragged_bench.json", gpu.gpu_ragged),
    "gpu_compile_report": ("gpu_compile_report/gpu_compile_report.json", gpu.gpu_compile),
    "mosaic_gpu_compile_report": ("gpu_compile_report/mosaic_gpu_compile_report.json",
                                  gpu.mosaic_compile),
    "tpu_engine_compile": ("tpu_engine_compile/tpu_engine_compile.json",
                           engine.rows_with("tpu_engine_compile")),
    "tpu_engine_compile_int8": ("tpu_engine_compile/int8/tpu_engine_compile.json",
                                engine.rows_with("tpu_engine_compile")),
    "tpu_engine_compile_int8_l32": ("tpu_engine_compile/int8_L32/tpu_engine_compile.json",
                                    engine.rows_with("tpu_engine_compile")),
    "tpu_engine_compile_int8_l32_vocab": (
        "tpu_engine_compile/int8_L32_vocab128256/tpu_engine_compile.json",
        engine.rows_with("tpu_engine_compile")),
    "cost_analysis": ("cost_analysis/cost_analysis.json", engine.rows_with("cost_analysis")),
    "paper_scale": ("paper_scale/summary.json", paper.paper_scale),
    "paper_scale_suite_time": ("paper_scale/suite_jobs2/summary.json",
                               paper.paper_scale_suite_time),
    "paper_scale_rates": (_RESULTS_DIR, paper.paper_scale_rates),
    "paper_targets": (_RESULTS_DIR, paper.paper_targets),
    "paper_targets_compact": (_RESULTS_DIR, paper.paper_targets_compact),
    "perf_validation": ("perf_validation/perf_validation.json", paper.perf_validation),
    "perf_validation_repeat": ("perf_validation/repeat/perf_validation.json",
                               paper.perf_validation),
    "perf_validation_fine": ("perf_validation/fine/perf_validation.json",
                             paper.perf_validation),
    "perf_validation_near3_load13": ("perf_validation/near3_load13/perf_validation.json",
                                     paper.perf_validation),
    "perf_validation_quiet": ("perf_validation/quiet_load1_5/perf_validation.json",
                              paper.perf_validation),
    "perf_validation_one_thread": ("perf_validation/one_thread/perf_validation.json",
                                   paper.perf_validation),
    "perf_validation_one_thread_paired": (
        "perf_validation/one_thread/paired/perf_validation.json",
        paper.perf_validation_paired),
    "perf_validation_one_thread_2": ("perf_validation/one_thread_2/perf_validation.json",
                                     paper.perf_validation),
    "perf_validation_one_thread_3": ("perf_validation/one_thread_3/perf_validation.json",
                                     paper.perf_validation),
    "perf_validation_one_thread_2_paired": (
        "perf_validation/one_thread_2/paired/perf_validation.json",
        paper.perf_validation_paired),
    "perf_validation_quiet_one_thread": (
        "perf_validation/quiet_one_thread/perf_validation.json", paper.perf_validation),
    "perf_validation_median_factor": (_RESULTS_DIR, paper.perf_validation_repredicted),
    "perf_validation_speed_normalized": (_RESULTS_DIR, paper.perf_validation_speed_normalized),
    "perf_validation_normalized_1": ("perf_validation/normalized_1/perf_validation.json",
                                     paper.perf_validation),
    "perf_validation_normalized_2": ("perf_validation/normalized_2/perf_validation.json",
                                     paper.perf_validation),
    "perf_validation_interleaved_1": ("perf_validation/interleaved_1/perf_validation.json",
                                      paper.perf_validation),
    "perf_validation_interleaved_2": ("perf_validation/interleaved_2/perf_validation.json",
                                      paper.perf_validation),
    "perf_validation_interleaved_3_busy": (
        "perf_validation/interleaved_3_busy/perf_validation.json", paper.perf_validation),
}


def doc_paths(root: str = ROOT) -> List[str]:
  """The files DOCS names under `root`, each once, in DOCS order."""
  out: List[str] = []
  for pattern in DOCS:
    for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
      if path not in out:
        out.append(path)
  return out


def render_section(name: str, results_dir: str = RESULTS) -> str:
  """The Markdown table of section `name` from the JSON under `results_dir`."""
  if name not in SECTIONS:
    raise ValueError(f"unknown results section {name!r}; known: {sorted(SECTIONS)}")
  source, render = SECTIONS[name]
  return _compact(render(load(results_dir, source) if isinstance(source, str)
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
  files = args.files or doc_paths()
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
