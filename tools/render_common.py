"""Helpers shared by the renderers of tools/render_results.py: loading committed results,
Markdown tables and the cell formats."""

from __future__ import annotations

import json
import os
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")


def load(results_dir: str, rel: str):
  """A committed result: JSON, JSON lines (.jsonl) or, for other suffixes, text."""
  path = os.path.join(results_dir, rel)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no committed result (run the experiment first)")
  with open(path) as f:
    if rel.endswith(".jsonl"):
      return [json.loads(line) for line in f if line.strip()]
    return json.load(f)


def with_files(*parts: str) -> Callable:
  """A loader for several text files of one directory, as {stem: content}."""
  def load_all(results_dir: str):
    out = {}
    for rel in parts:
      path = os.path.join(results_dir, rel)
      if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no committed result (run the experiment first)")
      with open(path) as f:
        out[os.path.splitext(os.path.basename(rel))[0]] = f.read()
    return out
  return load_all


def table(rows, headers) -> str:
  from experiments import common  # pylint: disable=g-import-not-at-top
  return common.table(rows, headers)


def cell(v, digits: int = 2) -> str:
  """A ratio cell; '-' where there is none (a missing or NaN figure)."""
  return "-" if v is None or v != v else f"{v:.{digits}f}"


def pct(v: float) -> str:
  return f"{100 * v:.1f}%"


def median_ms(timings, name):
  t = timings.get(name, {})
  return t["median_s"] * 1e3 if "median_s" in t else None


def ratio(a, b):
  return None if a is None or b is None else a / b
