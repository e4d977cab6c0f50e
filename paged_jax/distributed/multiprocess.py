"""Multi-process (multi-host) start-up helpers around `jax.distributed`.

Every process runs the same program (SPMD, "multi-controller" JAX): it calls
`initialize(...)` before any other JAX call, then builds the same global mesh
over `jax.devices()` (all processes' devices) and the same engine; each process
feeds identical host inputs and reads back replicated outputs.

    from paged_jax.distributed import multiprocess
    multiprocess.initialize("10.0.0.1:1234", num_processes=2, process_id=RANK,
                            cpu_devices_per_process=None)
    mesh = make_mesh(tp=jax.device_count())

CPU-only runs (tests, CI): `cpu_devices_per_process=N` sets
`--xla_force_host_platform_device_count=N` and `jax_cpu_collectives_implementation`
to "gloo", which cross-process CPU collectives need (measured on jax 0.10.2:
without it, 2 processes x 2 CPU devices cannot all-reduce over a 4-device mesh).
Both must happen before JAX creates its backends, hence before `initialize`.
See docs/distributed.md for GPU clusters (SLURM, Kubernetes, manual).
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Optional, Sequence

import numpy as np


def free_port() -> int:
  """A TCP port that was free on localhost a moment ago (for the coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def set_cpu_device_count(n: int) -> None:
  """Makes the CPU backend expose `n` devices. Call before JAX initializes its backends."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"cpu device count must be an int >= 1, got {n!r}")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", "")).strip()
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # pylint: disable=broad-except
    return False


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, cpu_devices_per_process: Optional[int] = None,
               local_device_ids: Optional[Sequence[int]] = None,
               initialization_timeout: int = 120) -> None:
  """`jax.distributed.initialize` with the CPU settings multi-process CPU runs need.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service (None:
      auto-detected on SLURM / Open MPI / Kubernetes / Cloud TPU).
    num_processes: processes in the job (>= 1; None: auto-detected).
    process_id: this process's rank in [0, num_processes) (None: auto-detected).
    cpu_devices_per_process: when set, run on CPU with this many devices per
      process and gloo collectives (tests / CI).
    local_device_ids: GPUs this process drives (None: all visible).
    initialization_timeout: seconds to wait for every process to join.
  Raises:
    ValueError: bad ranks/counts, or JAX already initialized its backends.
  """
  if num_processes is not None and (not isinstance(num_processes, int) or num_processes < 1):
    raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes - 1}], got {process_id}")
  if _backends_initialized():
    raise ValueError("initialize() must run before any JAX computation or jax.devices() call "
                     "(JAX's backends are already initialized in this process)")
  import jax  # pylint: disable=g-import-not-at-top
  if cpu_devices_per_process is not None:
    set_cpu_device_count(cpu_devices_per_process)
    jax.config.update("jax_platforms", "cpu")
    # Cross-process CPU collectives (jax 0.10.x needs this; later versions may default to it).
    try:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):  # the option was removed: gloo is built in
      pass
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids,
                             initialization_timeout=initialization_timeout)


def shutdown() -> None:
  """Leaves the job cleanly (waits for the other processes at the barrier)."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.shutdown()


def global_array(host_value, sharding) -> Any:
  """A global jax.Array from a host value that is IDENTICAL on every process.

  Each process fills only its addressable shards (no cross-host transfer).
  """
  import jax  # pylint: disable=g-import-not-at-top
  value = np.asarray(host_value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def to_host(x) -> np.ndarray:
  """Numpy value of a global array on every process (replicated: local copy; else allgather)."""
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
