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
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import numpy as np


def out_dir(path: str) -> pathlib.Path:
  """`path` as a Path, created (with parents) if missing; ValueError if it names a file."""
  if not path:
    raise ValueError("--out must name a directory, got an empty string")
  p = pathlib.Path(path)
  for parent in [p, *p.parents]:
    if parent.exists() and not parent.is_dir():
      raise ValueError(f"--out={path}: {parent} is a file, not a directory")
  p.mkdir(parents=True, exist_ok=True)
  return p


def json_ready(x: Any) -> Any:
  """JSON-ready: numpy scalars/arrays, tuples, Paths and dataclass-free dicts."""
  if isinstance(x, dict):
    return {str(k): json_ready(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_ready(v) for v in x]
  if isinstance(x, np.ndarray):
    return json_ready(x.tolist())
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
  p.write_text(json.dumps(json_ready(obj), indent=2, sort_keys=False) + "\n")
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


def time_interleaved(fns: Dict[str, tuple], repeats: int, calls: int,
                     clock: Callable[[], float] = time.perf_counter) -> Dict[str, dict]:
  """Times several (fn, args) pairs with their samples interleaved round-robin, so load
  from other processes hits every method alike.

  Each fn is run twice untimed (compile + warm-up); then `repeats` rounds, each timing
  `calls` back-to-back calls of every method and blocking on the last output. Returns
  {name: {"median_s", "min_s", "samples"}} in seconds per call. A method that fails to
  compile or run gets {"error": "<type>: <message>"} and is dropped from the rounds.
  `clock` reads seconds (tests pass a fake one).
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
      t0 = clock()
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
      samples[name].append((clock() - t0) / calls)
  for name, xs in samples.items():
    results[name] = {"median_s": statistics.median(xs), "min_s": min(xs), "samples": len(xs)}
  return results


def time_call(fn: Callable, args, repeats: int, calls: int,
              clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
  """Median / min seconds per call of `fn(*args)` after warm-up (see time_interleaved)."""
  return time_interleaved({"f": (fn, args)}, repeats, calls, clock)["f"]


def copy_bandwidth(repeats: int, calls: int, nbytes: int = 2 << 30,
                   clock: Callable[[], float] = time.perf_counter) -> float:
  """Device copy bandwidth in bytes/s: x * 2 over an `nbytes` float32 array reads and
  writes it once (2 * nbytes moved per call), median over `repeats` samples."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda x: x * 2)
  t = time_call(f, (x,), repeats, calls, clock)["median_s"]
  del x
  return 2 * nbytes / t


# Errors a bad flag value or input file raises inside a run: printed as one line, not a
# traceback. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


def one_line(error: BaseException) -> str:
  """`error`'s message on one line (newlines folded), for a CLI's last words."""
  return " ".join(str(error).split())


def own_flags(flag_values) -> list:
  """The flags an experiment defined on `flag_values` (absl's own left out), by name."""
  return sorted({f.name: f for module, fs in flag_values.flags_by_module_dict().items()
                 if not module.startswith("absl.") for f in fs}.values(), key=lambda f: f.name)


def short_help(doc: Optional[str], flag_values) -> str:
  """A --help that fits a screen: the docstring's first paragraph (what it does and how to
  call it) and one line per flag (`--name=default  help`)."""
  lines = []
  if doc:
    first = doc.strip().split("\n\n")
    lines += [first[0]] + ([first[1]] if len(first) > 1 and first[1].startswith("    ") else [])
    lines.append("")
  lines.append("flags:")
  for flag in own_flags(flag_values):
    default = "" if flag.default is None else f"={flag.default_as_str.strip(chr(39))}"
    lines.append(f"  --{flag.name}{default}  {flag.help}")
  return "\n".join(lines)


def versions(extra: Sequence[str] = ()) -> Dict[str, str]:
  """Versions of Python and the packages a result depends on (plus `extra` ones,
  e.g. the peer's torch; a package that is not installed is left out)."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  import platform  # pylint: disable=g-import-not-at-top
  out = {"python": platform.python_version()}
  for pkg in ("jax", "jaxlib", "flax", "numpy", "safetensors", "tokenizers", *extra):
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def machine() -> Dict[str, Any]:
  """The host and the first JAX device a result was measured on, and the host's load
  average when it was read (the machine is shared)."""
  import platform  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  return {"platform": platform.platform(), "processor": platform.machine(),
          "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
          "device": getattr(dev, "device_kind", str(dev)), "device_count": jax.device_count(),
          "load_avg_1_5_15": list(os.getloadavg())}


def run_metadata(flag_values, names: Optional[Sequence[str]] = None, *,
                 packages: Sequence[str] = ()) -> Dict[str, Any]:
  """{"flags": {name: value}, "versions": ..., "machine": ...} for a results JSON.

  `names` picks the flags (default: every flag the experiment defined on `flag_values`,
  absl's own left out)."""
  if names is None:
    names = [f.name for f in own_flags(flag_values)]
  return {"flags": {n: flag_values[n].value for n in sorted(names)},
          "versions": versions(packages), "machine": machine(), "code": code_version()}


_CODE_AT_START: Dict[str, Any] = {}   # run_app's reading, before the run could change it


def code_version(root: Optional[str] = None) -> Dict[str, Any]:
  """{"git_commit": HEAD, "dirty": uncommitted changes to tracked code} of the checkout
  the experiment ran from (None where git or the repository is absent). Results under
  experiments/results/ and Markdown do not count: a run that rewrites an earlier
  run's JSON, or docs edited meanwhile, does not change the code that ran. `root`: the
  checkout (default: this repository's). Inside `run_app` it is the reading taken when
  the run started: the code that ran, not what HEAD became while it ran."""
  import subprocess  # pylint: disable=g-import-not-at-top
  if root is None and _CODE_AT_START:
    return dict(_CODE_AT_START)
  root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)experiments/results", ":(exclude)*.md"],
                           cwd=root, capture_output=True, text=True, timeout=10,
                           check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return {"git_commit": None, "dirty": None}
  return {"git_commit": head, "dirty": bool(dirty)}


def use_compilation_cache(value: str) -> Optional[str]:
  """Applies a `--compilation_cache` value: 'auto' (the default directory), 'none' or ''
  (off), else a directory; returns the directory in use (None: off). A directory that
  cannot be written is a ValueError naming it."""
  from paged_jax import compile_cache  # pylint: disable=g-import-not-at-top
  if value in ("none", ""):
    compile_cache.disable()
    return None
  return str(compile_cache.enable(None if value == "auto" else value))


def run_app(main, define_flags, *, flag_values=None, doc: Optional[str] = None,
            argv: Optional[Sequence[str]] = None):
  """The `__main__` of an experiment: defines its absl flags, parses them, then runs
  `main(flag_values, out)` with `out` the created `--out` directory (None without --out).

  Flags are defined here, not at import, so experiment modules import side by side (tests,
  notebooks); `flag_values` is the registry `define_flags` fills (default absl's global
  FLAGS). `--help` prints `short_help(doc)`. A bad flag value, a stray argument, or a
  `USER_ERRORS` exception from `main` (a bad value found by the library, a missing file)
  ends the run with one line `error: ...` and exit status 1 instead of a traceback.
  Every experiment also takes `--compilation_cache` (default 'auto': compiled steps are
  kept on disk and loaded by later runs; `use_compilation_cache`).
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  registry = flags.FLAGS if flag_values is None else flag_values
  if doc is None:
    doc = getattr(sys.modules.get("__main__"), "__doc__", None)

  def parse(args):
    if any(a in ("-h", "--help", "-help", "--helpfull", "--helpshort") for a in args[1:]):
      print(short_help(doc, registry))
      sys.exit(0)
    try:
      rest = registry(list(args))
      if registry is not flags.FLAGS and not flags.FLAGS.is_parsed():
        flags.FLAGS(list(args[:1]))   # absl logging reads the global flags
    except flags.Error as e:
      sys.exit(f"error: {one_line(e)}")
    if len(rest) > 1:
      sys.exit(f"error: unexpected arguments {rest[1:]}")
    return rest

  def guarded(_):
    try:
      use_compilation_cache(registry.compilation_cache)
      out = out_dir(registry.out) if "out" in registry else None
      return main(registry, out)
    except (app.UsageError,) + USER_ERRORS as e:
      sys.exit(f"error: {one_line(e)}")

  define_flags()
  if "compilation_cache" not in registry:
    flags.DEFINE_string("compilation_cache", "auto",
                        "JAX's persistent compilation cache directory: compiled engine steps "
                        "load in later runs instead of compiling ('auto': "
                        "$PAGED_JAX_CACHE/xla or ~/.cache/paged_jax/xla; 'none': off)",
                        flag_values=registry)
  _CODE_AT_START.update(code_version())
  try:
    app.run(guarded, argv=None if argv is None else list(argv), flags_parser=parse)
  finally:   # the reading belongs to this run only
    _CODE_AT_START.clear()
