"""The device an attention call runs or is compiled on: what "auto" decides by.

    device = target_device(where)        # where: a Device, a Sharding, an array, or None
    platform(device)                     # "cpu" | "gpu" | "tpu"
    compute_capability(device)           # (9, 0) on an H100 / H200, None off CUDA

Never the host alone: `where` when given (the sharding of a deviceless compile, a
committed array), else the device of the abstract mesh in use (a deviceless compile sets
one: `deviceless.target.gpu_target_context`), else jax's default device
(`jax.default_device(...)`), else the first device of the default backend.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

import jax

# Hopper device kinds by name, for targets that only carry a kind (abstract devices).
_SM90_KIND = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")


def _is_tracer(x) -> bool:
  tracer = getattr(jax.core, "Tracer", None)
  return tracer is not None and isinstance(x, tracer)


def _device_of(where):
  """The (first) device of a Device / AbstractDevice, a Sharding, or an array's sharding."""
  if where is None or _is_tracer(where):
    return None
  if hasattr(where, "platform") and hasattr(where, "device_kind"):
    return where                                    # a Device or an AbstractDevice
  sharding = where if hasattr(where, "device_set") else getattr(where, "sharding", None)
  if sharding is None:
    return None
  mesh = getattr(sharding, "mesh", None)
  abstract = getattr(mesh, "abstract_device", None)
  if getattr(abstract, "device_kind", None):
    return abstract
  try:
    devices = sharding.device_set
  except (AttributeError, RuntimeError, ValueError):  # an abstract mesh without devices
    return None
  return min(devices, key=lambda d: d.id) if devices else None


def _abstract_mesh_device():
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get_mesh() if get_mesh is not None else None
  device = getattr(mesh, "abstract_device", None) if mesh is not None else None
  return device if getattr(device, "device_kind", None) else None


def _default_device():
  default = getattr(jax.config, "jax_default_device", None)
  try:
    if isinstance(default, str):                    # jax.default_device("gpu")
      return jax.devices(default)[0]
    if default is not None:
      return default
    return jax.devices()[0]
  except RuntimeError:  # pragma: no cover - no backend of that name
    return None


def target_device(where=None):
  """The device the call runs or is compiled on (module docstring), or None."""
  return _device_of(where) or _abstract_mesh_device() or _default_device()


def platform(device) -> str:
  """"gpu" (CUDA or ROCm), "tpu" or "cpu" (anything else, and no device)."""
  name = getattr(device, "platform", "cpu") or "cpu"
  if name in ("gpu", "cuda", "rocm"):
    return "gpu"
  return "tpu" if name == "tpu" else "cpu"


def compute_capability(device=None) -> Optional[Tuple[int, int]]:
  """(major, minor) of a CUDA device (or of an abstract device's kind), else None;
  `device` None: the target device."""
  if device is None:
    device = target_device()
  if device is None or getattr(device, "platform", "gpu") not in ("gpu", "cuda"):
    return None
  cc = getattr(device, "compute_capability", None)
  if cc:
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)
  return (9, 0) if _SM90_KIND.search(getattr(device, "device_kind", "") or "") else None
