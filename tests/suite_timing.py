"""pytest hooks (imported by conftest.py): where the suite's time goes, printed at its end.

Every test report carries `cpu_s`, the CPU seconds (all threads: XLA compiles on several)
its worker process and the child processes it waited for (a subprocess pytest, a notebook
kernel) spent in that phase. CPU time hardly depends on how loaded the shared
machine is; wall time does. At the end of a run, one table per file (slowest first):

  files by wall time (tests: N, wall W s, load average L at the start, L' at the end)
     wall s    cpu s  tests  file
  (one line per file: summed setup + call + teardown wall and CPU seconds, tests run)

`SUITE_TIMING_FILES=N` sets how many files are listed (default 25, 0 for none);
`SUITE_TIMING_JSON=path` also writes every file's and test's numbers as JSON.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time

import pytest

_LAST_CPU = pytest.StashKey[float]()
_START = {}


def _loadavg() -> float:
  try:
    return os.getloadavg()[0]
  except OSError:  # pragma: no cover  (not available on this platform)
    return float("nan")


def _cpu_s() -> float:
  """CPU seconds of this process (all threads) and of its waited-for children."""
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + children.ru_utime + children.ru_stime


def pytest_sessionstart(session):
  del session
  _START.update(wall=time.perf_counter(), load=_loadavg())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  item.stash[_LAST_CPU] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  del call
  outcome = yield
  now = _cpu_s()
  report = outcome.get_result()
  report.cpu_s = now - item.stash.get(_LAST_CPU, now)
  item.stash[_LAST_CPU] = now


def _per_file(reports):
  files = collections.defaultdict(lambda: {"wall_s": 0.0, "cpu_s": 0.0, "tests": set()})
  tests = collections.defaultdict(lambda: {"wall_s": 0.0, "cpu_s": 0.0})
  for rep in reports:
    path = rep.nodeid.split("::")[0]
    files[path]["wall_s"] += rep.duration
    files[path]["cpu_s"] += getattr(rep, "cpu_s", 0.0)
    files[path]["tests"].add(rep.nodeid)
    tests[rep.nodeid]["wall_s"] += rep.duration
    tests[rep.nodeid]["cpu_s"] += getattr(rep, "cpu_s", 0.0)
  return files, tests


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  del exitstatus
  if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
    return
  reports = [rep for key in ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
             for rep in terminalreporter.stats.get(key, []) if hasattr(rep, "duration")]
  if not reports:
    return
  files, tests = _per_file(reports)
  wall = time.perf_counter() - _START.get("wall", time.perf_counter())
  limit = int(os.environ.get("SUITE_TIMING_FILES", "25"))
  if limit:
    terminalreporter.write_sep(
        "-", f"files by wall time (tests: {len(tests)}, wall {wall:.0f} s, load average "
        f"{_START.get('load', float('nan')):.1f} at the start, {_loadavg():.1f} at the end)")
    terminalreporter.write_line("   wall s    cpu s  tests  file")
    ranked = sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])
    for path, f in ranked[:limit]:
      terminalreporter.write_line(
          f"{f['wall_s']:9.1f} {f['cpu_s']:8.1f} {len(f['tests']):6d}  {path}")
  out = os.environ.get("SUITE_TIMING_JSON")
  if out:
    with open(out, "w", encoding="utf-8") as fh:
      json.dump({"wall_s": wall, "load_start": _START.get("load"), "load_end": _loadavg(),
                 "files": {p: {"wall_s": f["wall_s"], "cpu_s": f["cpu_s"],
                               "tests": len(f["tests"])} for p, f in files.items()},
                 "tests": tests}, fh, indent=1, sort_keys=True)
