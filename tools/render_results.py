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

Each section renders with the experiment's own `summary_rows` / `summary_table`, so a
table in the docs reads exactly as the experiment printed it when it ran. An unknown
section name, a missing JSON file or an unclosed marker is an error naming the file.
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


def _summary(doc) -> str:
  return _table(doc["rows"], ["what", "ours", "paper"])


# name: (JSON under experiments/results/, renderer of its parsed content -> Markdown)
SECTIONS: Dict[str, Tuple[str, Callable]] = {
    "summary": ("summary.json", _summary),
    "memory_waste": ("memory_waste/memory_waste.json", _memory_waste),
    "block_size_sweep": ("block_size_sweep/block_size_sweep.jsonl", _rows_with("block_size_sweep")),
    "sharing": ("sharing/sharing.json", _rows_with("sharing", "rows")),
    "preemption": ("preemption/preemption.json", _rows_with("preemption", "rows")),
    "throughput": ("throughput/throughput.json", _rows_with("throughput", "results")),
    "hf_peer": ("hf_peer/hf_peer.json", _hf_peer),
}


def render_section(name: str, results_dir: str = RESULTS) -> str:
  """The Markdown table of section `name` from the JSON under `results_dir`."""
  if name not in SECTIONS:
    raise ValueError(f"unknown results section {name!r}; known: {sorted(SECTIONS)}")
  rel, render = SECTIONS[name]
  return render(_load(results_dir, rel))


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
    for name, (rel, _) in SECTIONS.items():
      print(f"{name}\t{rel}")
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
