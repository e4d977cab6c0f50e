"""What a result records about how it was made: settings, versions, machine, code.

    meta = provenance.run_metadata(config)    # {"flags", "versions", "machine", "code"}

`code_version` inside `common.run_app` is the reading taken when the run started (the
code that ran), not what HEAD became while it ran.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional, Sequence


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


def run_metadata(settings, names: Optional[Sequence[str]] = None, *,
                 packages: Sequence[str] = ()) -> Dict[str, Any]:
  """{"flags": {name: value}, "versions": ..., "machine": ..., "code": ...} for a results
  JSON.

  Args:
    settings: the experiment's Config (`configs.ExperimentConfig`), or parsed absl flags.
    names: the flags to record (default: every field of the Config, or every flag the
      experiment defined, absl's own left out), sorted by name.
    packages: extra packages whose versions matter (e.g. the peer's torch).
  """
  if dataclasses.is_dataclass(settings):
    values = settings.flags()
  else:
    values = {f.name: f.value for f in own_flags(settings)}
  if names is not None:
    values = {n: values[n] for n in names}
  return {"flags": dict(sorted(values.items())), "versions": versions(packages),
          "machine": machine(), "code": code_version()}


def own_flags(flag_values) -> list:
  """The flags an experiment defined on `flag_values` (absl's own left out), by name."""
  return sorted({f.name: f for module, fs in flag_values.flags_by_module_dict().items()
                 if not module.startswith("absl.") for f in fs}.values(), key=lambda f: f.name)


_CODE_AT_START: Dict[str, Any] = {}   # run_app's reading, before the run could change it


def remember_code() -> None:
  """Takes the reading `code_version()` returns until `forget_code()` (a run's start)."""
  _CODE_AT_START.update(code_version())


def remember_code_as(reading: Dict[str, Any]) -> None:
  """Takes `reading` (another process's `code_version()` at its run's start: a worker's
  parent) as the reading `code_version()` returns until `forget_code()`."""
  _CODE_AT_START.clear()
  _CODE_AT_START.update(reading)


def forget_code() -> None:
  _CODE_AT_START.clear()


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
