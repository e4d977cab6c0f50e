"""Small helpers every experiment shares: the app runner, output dir, JSON, progress bar,
table, PNG.

    from experiments import common
    common.run_app(main, Config)                    # flags from Config; main(config, out)
    common.write_json(out / "result.json", results)
    for x in common.progress(items, desc="runs"):   # tqdm on stderr
      ...
    print(common.table(rows, headers=["name", "value"]))
    result = common.timed_result(lambda: run(f), f)  # + "seconds", flags, versions, machine
    common.report(result, out, "result.json", rows, headers, ["a closing line"])
    plt = common.pyplot()                           # matplotlib with the Agg backend
    fig, ax = plt.subplots(); ...; common.save_png(fig, out / "plot.png")

Flags from a Config dataclass: `experiments.configs`. Settings, versions and machine of a
result: `experiments.provenance`. Timing loops: `paged_jax.bench.timing`.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from experiments import configs
from experiments import provenance
from experiments.provenance import own_flags
# Kept under common's name for the kernel experiments (kernel_bench, ragged_bench,
# gpu_compile_report), which call them as common.<name>.
from experiments.provenance import run_metadata  # noqa: F401  pylint: disable=unused-import
from paged_jax.bench.timing import copy_bandwidth, time_interleaved  # noqa: F401  pylint: disable=unused-import


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


PROGRESS_BARS = True    # False: every bar off (a worker process of a parallel run)


def progress(iterable: Optional[Iterable] = None, *, total: Optional[int] = None,
             desc: str = "", disable: Optional[bool] = None):
  """A tqdm progress bar on stderr (off when stderr is not a terminal, unless disable=False;
  always off when PROGRESS_BARS is False)."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  if disable is None:
    disable = not sys.stderr.isatty()
  disable = disable or not PROGRESS_BARS
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


def timed_result(run: Callable[[], dict], settings) -> dict:
  """`run()`'s result dict with the wall seconds it took ("seconds") and the run's flags,
  versions, machine and code (`provenance.run_metadata(settings)`)."""
  t0 = time.perf_counter()
  result = run()
  result["seconds"] = time.perf_counter() - t0
  result.update(provenance.run_metadata(settings))
  return result


def report(result: dict, out: Optional[pathlib.Path], filename: str,
           rows: Sequence[Sequence[Any]], headers: Sequence[str], lines: Iterable[str] = (),
           *, digits: int = 3, wrote_suffix: str = "") -> Optional[pathlib.Path]:
  """An experiment's closing output: the table of `rows`, each of `lines`, then, when there
  is an output directory `out`, `result` written to out/filename and "wrote PATH" (+
  `wrote_suffix`, e.g. the plot's path). Returns the JSON's path (None without `out`)."""
  print(table(rows, headers, digits=digits))
  for line in lines:
    print(line)
  if out is None:
    return None
  path = write_json(out / filename, result)
  print(f"wrote {path}{wrote_suffix}")
  return path


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


# Errors a bad flag value or input file raises inside a run: printed as one line, not a
# traceback. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


def one_line(error: BaseException) -> str:
  """`error`'s message on one line (newlines folded), for a CLI's last words."""
  return " ".join(str(error).split())


def compile_each(cases: Sequence[Any], measure: Callable[[Any], dict],
                 desc: str = "compiles"):
  """(rows, failures) of `measure(case)` over `cases` (each with a `.name`), as the compile
  reports (gpu_compile_report, tpu_compile_report, tpu_engine_compile) run them: a case
  that raises is a failure {"case", "error" (one line, 500 chars)}, printed, and the next
  one still runs; each row gets "compile_s", the seconds of its `measure` call, unless
  `measure` timed the compile itself."""
  rows, failures = [], []
  for case in progress(cases, desc=desc):
    t0 = time.perf_counter()
    try:
      row = measure(case)
    except Exception as e:  # pylint: disable=broad-except
      failures.append({"case": case.name, "error": one_line(e)[:500]})
      print(f"FAILED {case.name}: {failures[-1]['error']}")
      continue
    row.setdefault("compile_s", round(time.perf_counter() - t0, 2))
    rows.append(row)
  return rows, failures


def mib(nbytes: Optional[float]) -> Optional[float]:
  """Bytes as MiB, 2 decimals (None stays None), for tables."""
  return None if nbytes is None else round(nbytes / 2**20, 2)


def short_help(doc: Optional[str], flag_values, names: Optional[Sequence[str]] = None) -> str:
  """A --help that fits a screen: the docstring's first paragraph (what it does and how to
  call it) and one line per flag (`--name=default  help`): the flags `names` (default:
  every flag not defined by absl), by name."""
  lines = []
  if doc:
    first = doc.strip().split("\n\n")
    lines += [first[0]] + ([first[1]] if len(first) > 1 and first[1].startswith("    ") else [])
    lines.append("")
  lines.append("flags:")
  flags = (own_flags(flag_values) if names is None else
           sorted((flag_values[n] for n in names), key=lambda f: f.name))
  for flag in flags:
    default = "" if flag.default is None else f"={flag.default_as_str.strip(chr(39))}"
    lines.append(f"  --{flag.name}{default}  {flag.help}")
  return "\n".join(lines)


def use_compilation_cache(value: str) -> Optional[str]:
  """Applies a `--compilation_cache` value: 'auto' (the default directory), 'none' or ''
  (off), else a directory; returns the directory in use (None: off). A directory that
  cannot be written is a ValueError naming it."""
  from paged_jax import compile_cache  # pylint: disable=g-import-not-at-top
  if value in ("none", ""):
    compile_cache.disable()
    return None
  return str(compile_cache.enable(None if value == "auto" else value))


def run_app(main: Callable, config_cls, *, flag_values=None, doc: Optional[str] = None,
            argv: Optional[Sequence[str]] = None):
  """The `__main__` of an experiment: defines one absl flag per field of `config_cls` (a
  `configs.ExperimentConfig` dataclass), parses them, builds the checked Config, then runs
  `main(config, out)` with `out` the created `--out` directory (None without an `out`
  field).

  Flags are defined here, not at import, so experiment modules import side by side (tests,
  notebooks); `flag_values` is the registry they go on (default absl's global FLAGS).
  `--help` prints `short_help(doc)`. A bad flag value (a field's type, range or choices,
  or `Config.check()`), a stray argument, or a `USER_ERRORS` exception from `main` (a bad
  value found by the library, a missing file) ends the run with one line `error: ...` and
  exit status 1 instead of a traceback. Every experiment also takes `--compilation_cache`
  (default 'auto': compiled steps are kept on disk and loaded by later runs;
  `use_compilation_cache`); it is how the run is done, not a setting of the result.
  """
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  registry = flags.FLAGS if flag_values is None else flag_values
  if doc is None:
    doc = getattr(sys.modules.get("__main__"), "__doc__", None)

  def parse(args):
    if any(a in ("-h", "--help", "-help", "--helpfull", "--helpshort") for a in args[1:]):
      print(short_help(doc, registry, [*configs.fields(config_cls), "compilation_cache"]))
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
      config = configs.from_flags(config_cls, registry)
      use_compilation_cache(registry.compilation_cache)
      out = out_dir(config.out) if "out" in configs.fields(config_cls) else None
      return main(config, out)
    except (app.UsageError,) + USER_ERRORS as e:
      sys.exit(f"error: {one_line(e)}")

  configs.define_flags(config_cls, registry)
  if "compilation_cache" not in registry:
    flags.DEFINE_string("compilation_cache", "auto",
                        "JAX's persistent compilation cache directory: compiled engine steps "
                        "load in later runs instead of compiling ('auto': "
                        "$PAGED_JAX_CACHE/xla or ~/.cache/paged_jax/xla; 'none': off)",
                        flag_values=registry)
  provenance.remember_code()
  try:
    app.run(guarded, argv=None if argv is None else list(argv), flags_parser=parse)
  finally:   # the reading belongs to this run only
    provenance.forget_code()
