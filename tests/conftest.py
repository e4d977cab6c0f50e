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
