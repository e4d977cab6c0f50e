"""Small helpers every experiment shares: output dir, JSON, progress bar, table, PNG.

    from experiments import common
    out = common.out_dir(FLAGS.out)                 # creates it
    common.write_json(out / "result.json", results)
    for x in common.progress(items, desc="runs"):   # tqdm on stderr
      ...
    print(common.table(rows, headers=["name", "value"]))
    plt = common.pyplot()                           # matplotlib with the Agg backend
    fig, ax = plt.subplots(); ...; common.save_png(fig, out / "plot.png")
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import Any, Iterable, Optional, Sequence

import numpy as np


def out_dir(path: str) -> pathlib.Path:
  """`path` as a Path, created (with parents) if missing."""
  if not path:
    raise ValueError("--out must name a directory, got an empty string")
  p = pathlib.Path(path)
  p.mkdir(parents=True, exist_ok=True)
  return p


def _plain(x: Any) -> Any:
  """JSON-ready: numpy scalars/arrays, tuples, Paths and dataclass-free dicts."""
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if isinstance(x, np.ndarray):
    return _plain(x.tolist())
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, pathlib.Path):
    return str(x)
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)   # JSON has no inf/nan
  return x


def write_json(path, obj: Any) -> pathlib.Path:
  """Writes `obj` as indented JSON (numpy values converted); returns the path."""
  p = pathlib.Path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  p.write_text(json.dumps(_plain(obj), indent=2, sort_keys=False) + "\n")
  return p


def progress(iterable: Optional[Iterable] = None, *, total: Optional[int] = None,
             desc: str = "", disable: Optional[bool] = None):
  """A tqdm progress bar on stderr (off when stderr is not a terminal, unless disable=False)."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  if disable is None:
    disable = not sys.stderr.isatty()
  return tqdm(iterable, total=total, desc=desc, disable=disable, file=sys.stderr,
              dynamic_ncols=True, leave=False)


def _cell(x: Any, digits: int) -> str:
  if isinstance(x, (float, np.floating)):
    return f"{x:.{digits}f}"
  return str(x)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], digits: int = 3) -> str:
  """A Markdown table (also readable in a terminal); floats with `digits` decimals."""
  cells = [[_cell(x, digits) for x in row] for row in rows]
  for row in cells:
    if len(row) != len(headers):
      raise ValueError(f"row {row} has {len(row)} cells, headers have {len(headers)}")
  widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
  line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
  sep = "| " + " | ".join("-" * w for w in widths) + " |"
  return "\n".join([line(headers), sep] + [line(r) for r in cells])


def pyplot():
  """matplotlib.pyplot with the non-interactive Agg backend (no display needed)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_png(fig, path, dpi: int = 150) -> pathlib.Path:
  """Saves a matplotlib figure as PNG and closes it; returns the path."""
  p = pathlib.Path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(p, dpi=dpi, bbox_inches="tight", format="png")
  pyplot().close(fig)
  return p
