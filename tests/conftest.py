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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
  """Drops every compiled executable after each test module.

  XLA:CPU maps each executable's machine code into memory regions of its own, and JAX's
  caches keep every executable alive. An xdist worker that runs hundreds of modules
  (one ragged-kernel module alone leaves ~5,000 maps) reached Linux's per-process limit
  (vm.max_map_count, 65,530), and LLVM aborted mid-compile: CI's "Fatal Python error:
  Aborted" in whichever test compiled next. Module-level jitted helpers recompile in the
  next module that uses them; nothing else changes.
  """
  yield
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  release_compiled()
