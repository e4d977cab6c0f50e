"""Small helpers every experiment shares: output dir, JSON, progress bar, table, PNG, timing.

    from experiments import common
    out = common.out_dir(FLAGS.out)                 # creates it
    common.write_json(out / "result.json", results)
    for x in common.progress(items, desc="runs"):   # tqdm on stderr
      ...
    print(common.table(rows, headers=["name", "value"]))
    plt = common.pyplot()                           # matplotlib with the Agg backend
    fig, ax = plt.subplots(); ...; common.save_png(fig, out / "plot.png")
    t = common.time_interleaved({"a": (f, args), "b": (g, args)}, repeats=5, calls=1)
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

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


def time_interleaved(fns: Dict[str, tuple], repeats: int, calls: int) -> Dict[str, dict]:
  """Times several (fn, args) pairs with their samples interleaved round-robin, so load
  from other processes hits every method alike.

  Each fn is run twice untimed (compile + warm-up); then `repeats` rounds, each timing
  `calls` back-to-back calls of every method and blocking on the last output. Returns
  {name: {"median_s", "min_s", "samples"}} in seconds per call. A method that fails to
  compile or run gets {"error": "<type>: <message>"} and is dropped from the rounds.
  """
  import jax  # pylint: disable=g-import-not-at-top
  results: Dict[str, dict] = {}
  live = {}
  for name, (fn, args) in fns.items():
    try:
      jax.block_until_ready(fn(*args))  # compile + first run
      jax.block_until_ready(fn(*args))
      live[name] = (fn, args)
    except Exception as e:  # pylint: disable=broad-except
      results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  samples = {name: [] for name in live}
  for _ in range(repeats):
    for name, (fn, args) in live.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - t0) / calls)
  for name, xs in samples.items():
    results[name] = {"median_s": statistics.median(xs), "min_s": min(xs), "samples": len(xs)}
  return results


def time_call(fn: Callable, args, repeats: int, calls: int) -> Dict[str, float]:
  """Median / min seconds per call of `fn(*args)` after warm-up (see time_interleaved)."""
  return time_interleaved({"f": (fn, args)}, repeats, calls)["f"]


def copy_bandwidth(repeats: int, calls: int, nbytes: int = 2 << 30) -> float:
  """Device copy bandwidth in bytes/s: x * 2 over an `nbytes` float32 array reads and
  writes it once (2 * nbytes moved per call), median over `repeats` samples."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda x: x * 2)
  t = time_call(f, (x,), repeats, calls)["median_s"]
  del x
  return 2 * nbytes / t


def run_app(main, define_flags):
  """The `__main__` of an experiment: defines its absl flags, parses them, then runs
  `main(flags.FLAGS, out)` with `out` the created `--out` directory.

  Flags are defined here, not at import, so experiment modules import side by side (tests,
  notebooks). Stray positional arguments, or a ValueError from `main` (a bad flag value found
  by the library), end the run with one line naming the problem instead of a traceback.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top

  def guarded(argv):
    if len(argv) > 1:
      sys.exit(f"unexpected arguments {argv[1:]}")
    try:
      return main(flags.FLAGS, out_dir(flags.FLAGS.out))
    except ValueError as e:
      sys.exit(f"error: {e}")

  define_flags()
  app.run(guarded)
