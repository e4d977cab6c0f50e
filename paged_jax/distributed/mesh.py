"""Device meshes for tensor (`tp`) and data (`dp`) parallelism, validated up front.

    mesh = make_mesh(tp=4)              # Mesh(('tp',), 4 devices)
    mesh = make_mesh(tp=2, dp=2)        # Mesh(('dp', 'tp'), 2 x 2 devices)
    replicas = dp_submeshes(mesh)       # one 1-D `tp` mesh per dp replica

Tensor parallelism shards each layer's query / KV heads and the MLP's
intermediate features over `tp` (Megatron-style), so the model's head and
width counts must divide by `tp`; `validate_tp` says which one does not before
any device work. Data parallelism runs `dp` independent replicas (each its own
block manager and KV pages) on disjoint `tp`-sized groups of devices.

The devices of a `tp` group are consecutive in `jax.devices()` order, which on a
multi-process run keeps a group inside one process (host) when `tp` divides the
local device count: the per-layer all-reduces then stay on the fast local links.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from paged_jax.config import CacheConfig, ModelConfig

TP_AXIS = "tp"
DP_AXIS = "dp"
TP_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
  if value < 1:
    raise ValueError(f"{name} must be >= 1, got {value}")


def validate_tp(model_config: ModelConfig, tp: int,
                cache_config: Optional[CacheConfig] = None) -> None:
  """Raises ValueError unless `model_config` (and `cache_config`) can be split `tp` ways.

  Every query head, KV head and intermediate (SwiGLU) feature must land on
  exactly one shard: num_heads, num_kv_heads and intermediate_size must be
  divisible by tp. A cache config, when given, must describe this model's K/V
  (same layers, KV heads, head_dim).
  """
  _check_positive_int("tp", tp)
  if not isinstance(model_config, ModelConfig):
    raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
  c = model_config
  for name, value in (("num_kv_heads", c.num_kv_heads), ("num_heads", c.num_heads),
                      ("intermediate_size", c.intermediate_size)):
    if value % tp:
      allowed = [d for d in range(1, value + 1) if value % d == 0]
      raise ValueError(
          f"tp={tp} does not divide the model's {name}={value}: tensor parallelism gives each "
          f"shard {name}/tp of them; allowed tp for this model's {name}: {allowed}")
  if cache_config is not None:
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
    if cache_config.hybrid:
      raise ValueError("tensor-parallel engines keep one KV pool: pass hybrid_kv=False to "
                       "ModelConfig.cache_config (cache_config.sliding_layers must be ())")
    for name in ("num_layers", "num_kv_heads", "head_dim"):
      got, want = getattr(cache_config, name), getattr(c, name)
      if got != want:
        raise ValueError(f"cache_config.{name}={got} does not match the model's {name}={want}")


def make_mesh(tp: int = 1, dp: int = 1, devices: Optional[Sequence[jax.Device]] = None,
              *, model_config: Optional[ModelConfig] = None) -> Mesh:
  """A (dp, tp) mesh (axes ('dp', 'tp')), or a 1-D ('tp',) mesh when dp == 1.

  Args:
    tp: tensor-parallel shards per replica (>= 1).
    dp: data-parallel replicas (>= 1).
    devices: devices to use, default `jax.devices()` (all processes' devices on a
      multi-process run). The first dp * tp are used, in order; replica r owns
      devices[r * tp:(r + 1) * tp].
    model_config: when given, checked with `validate_tp`.
  Raises:
    ValueError: tp / dp < 1, fewer than dp * tp devices, or a model that does not
      split tp ways; TypeError for non-int sizes.
  """
  _check_positive_int("tp", tp)
  _check_positive_int("dp", dp)
  devices = list(jax.devices() if devices is None else devices)
  need = tp * dp
  if len(devices) < need:
    raise ValueError(
        f"mesh dp={dp} x tp={tp} needs {need} devices, only {len(devices)} available "
        f"({devices[0].platform if devices else 'no'} devices). On CPU, simulate more with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N set before JAX initializes.")
  if len({d.id for d in devices[:need]}) != need:
    raise ValueError("devices must not repeat a device")
  if model_config is not None:
    validate_tp(model_config, tp)
  grid = np.asarray(devices[:need], dtype=object)
  if dp == 1:
    return Mesh(grid.reshape(tp), (TP_AXIS,))
  return Mesh(grid.reshape(dp, tp), (DP_AXIS, TP_AXIS))


def tp_size(mesh: Mesh) -> int:
  """Size of the mesh's `tp` axis (ValueError if it has none)."""
  if TP_AXIS not in mesh.shape:
    raise ValueError(f"mesh must have a '{TP_AXIS}' axis, got axes {tuple(mesh.axis_names)}")
  return int(mesh.shape[TP_AXIS])


def dp_size(mesh: Mesh) -> int:
  """Size of the mesh's `dp` axis (1 when it has none)."""
  return int(mesh.shape.get(DP_AXIS, 1))


def dp_submeshes(mesh: Mesh) -> List[Mesh]:
  """One 1-D ('tp',) mesh per data-parallel replica, in replica order."""
  tp_size(mesh)
  if DP_AXIS not in mesh.shape:
    return [mesh]
  extra = set(mesh.axis_names) - {DP_AXIS, TP_AXIS}
  if extra:
    raise ValueError(f"mesh axes must be ('dp', 'tp'), got {tuple(mesh.axis_names)}")
  grid = mesh.devices if mesh.axis_names[0] == DP_AXIS else mesh.devices.T
  return [Mesh(np.asarray(row), (TP_AXIS,)) for row in grid]
