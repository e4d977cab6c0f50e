"""Shared pytest setup: CPU only, deterministic, x64 off (as on accelerators)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Hypothesis: bounded, deterministic example counts so the suite fits CI time.
try:
  from hypothesis import settings
  settings.register_profile("ci", max_examples=25, deadline=None, derandomize=False)
  settings.load_profile("ci")
except ImportError:  # pragma: no cover
  pass


import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position
# Per-file wall and CPU seconds at the end of every run (tests/suite_timing.py).
from suite_timing import (pytest_runtest_makereport, pytest_runtest_setup,  # pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
                          pytest_sessionstart, pytest_terminal_summary)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
  """Drops every compiled executable after each test module.

  XLA:CPU maps each executable's machine code into memory regions of its own, and JAX's
  caches keep every executable alive. An xdist worker that runs hundreds of modules
  (one ragged-kernel module alone leaves ~5,000 maps) reached Linux's per-process limit
  (vm.max_map_count, 65,530), and LLVM aborted mid-compile: CI's "Fatal Python error:
  Aborted" in whichever test compiled next. Module-level jitted helpers recompile in the
  next module that uses them; nothing else changes. (The engine's steps are bounded by
  `paged_jax.executables` anyway; the kernels' and helpers' jits are not.)
  """
  yield
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  release_compiled()


def _long_tier() -> set:
  """Node ids listed in tests/long_tier.txt (comments and blank lines skipped)."""
  path = os.path.join(os.path.dirname(__file__), "long_tier.txt")
  with open(path, encoding="utf-8") as f:
    return {line.split("#")[0].strip() for line in f} - {""}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """An `exhaustive` test is also `slow` (pytest.ini): it never runs in the default tier.
  A test listed in tests/long_tier.txt is `long`: out of `make test`, in CI's other parts.
  A listed id that a whole collected file no longer holds (a renamed test or parameter) is
  an error: it would otherwise silently move back into make test."""
  long_ids = _long_tier()
  seen, files = set(), set()
  for item in items:
    if item.get_closest_marker("exhaustive") and not item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.slow)
    nodeid = item.nodeid if item.nodeid.startswith("tests/") else "tests/" + item.nodeid
    files.add(nodeid.split("::")[0])
    if nodeid in long_ids:
      seen.add(nodeid)
      item.add_marker(pytest.mark.long)
  # Only when whole files were asked for: `pytest tests/x.py::test_y` collects part of one.
  if any("::" in arg for arg in config.args):
    return
  stale = sorted(i for i in long_ids - seen if i.split("::")[0] in files)
  if stale:
    raise pytest.UsageError(f"tests/long_tier.txt lists tests that do not exist: {stale}")
