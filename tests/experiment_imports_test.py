"""Every experiments/*.py module imports in one process without touching absl's global flags.

Experiment scripts declare their command-line flags as the fields of a `Config` dataclass;
`common.run_app(main, Config)` (called only under `if __name__ == "__main__":`) defines them.
Defining flags at import time on the global `flags.FLAGS` makes a second module with the
same flag name (--out, --seed, --block_size ...) raise `DuplicateFlagError` in notebooks,
pytest workers and benches that import each other.

The imports run in a fresh interpreter so that modules already imported by other tests in
this pytest process cannot hide a definition.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__")

_PROBE = r"""
import importlib, json, sys, traceback
from absl import app, flags, logging  # absl's own flags (--v, --logtostderr ...) count as
import chex                           # the baseline, as do chex's (it defines --chex_* and
report = {}                           # absl.testing's at import): only the experiments' count
for name in sys.argv[1:]:
  before = set(flags.FLAGS)
  try:
    importlib.import_module("experiments." + name)
    error = None
  except Exception:  # pylint: disable=broad-except
    error = traceback.format_exc(limit=3)
  report[name] = {"new_flags": sorted(set(flags.FLAGS) - before), "error": error}
print("REPORT" + json.dumps(report))
"""


def _import_all(names):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _PROBE, *names], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len("REPORT"):])


def test_glob_finds_the_experiments():
  # The glob is what keeps new scripts covered; make sure it sees known ones.
  assert {"generate", "kernel_bench", "ragged_bench", "memory_waste"} <= set(EXPERIMENTS)


def test_all_experiments_import_together_without_global_flags():
  report = _import_all(EXPERIMENTS)
  assert sorted(report) == EXPERIMENTS
  errors = {n: r["error"] for n, r in report.items() if r["error"]}
  assert not errors, f"import failed: {errors}"
  defined = {n: r["new_flags"] for n, r in report.items() if r["new_flags"]}
  assert not defined, (
      f"importing these modules defined flags on absl's global FLAGS: {defined}; "
      "declare them as Config fields; common.run_app defines them under "
      "`if __name__ == '__main__':`")


# Files that name experiments without running them: this one, and the bad-flag cases.
_NOT_RUNS = {"experiment_imports_test.py", "cli_errors_test.py"}


def _runners(name):
  """Test files (and the Makefile) that name experiment `name` as a module they import or
  run: `from experiments import name`, `experiments.name` or `experiments/name.py`."""
  pattern = re.compile(rf"(from experiments import (\w+, )*{name}\b|experiments[./]{name}\b)")
  files = [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name not in _NOT_RUNS]
  return [p.name for p in files + [ROOT / "Makefile"] if pattern.search(p.read_text())]


def test_every_experiment_is_run_by_a_test_or_make_target():
  # An experiment is a module with a `__main__` block; the others are its parts (BUILD's
  # EXPERIMENT_HELPERS), run through it. A script no test runs breaks unseen when the
  # library moves under it (compile_maps imported a module that was gone).
  assert {"generate", "demo", "compile_maps"} <= set(_apps())
  unrun = [n for n in _apps() if not _runners(n)]
  assert not unrun, f"experiments no test or make target runs: {unrun}"


def _apps():
  """The experiments: modules of experiments/ with an `if __name__ == "__main__":` block."""
  main = re.compile(r'^if __name__ == "__main__":', re.M)
  return [n for n in EXPERIMENTS if main.search((ROOT / "experiments" / f"{n}.py").read_text())]


def test_build_helpers_are_the_modules_without_a_main():
  # BUILD makes a py_binary of every other module: a part listed there as a binary, or an
  # app listed as a helper (no binary), is a mistake.
  build = (ROOT / "experiments" / "BUILD").read_text()
  listed = re.search(r"EXPERIMENT_HELPERS = \[(.*?)\]", build, re.S).group(1)
  helpers = sorted(n[:-len(".py")] for n in re.findall(r'"(\w+\.py)"', listed))
  assert helpers == sorted(set(EXPERIMENTS) - set(_apps()))


def test_probe_detects_a_global_flag_definition(tmp_path):
  # The check above can fail: a module defining a global flag at import is reported.
  pkg = tmp_path / "experiments"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "bad.py").write_text(
      "from absl import flags\nflags.DEFINE_integer('probe_only_flag', 1, 'x')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _PROBE, "bad"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=60)
  line = [l for l in proc.stdout.splitlines() if l.startswith("REPORT")][-1]
  assert json.loads(line[len("REPORT"):])["bad"]["new_flags"] == ["probe_only_flag"]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
