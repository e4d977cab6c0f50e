"""Test support for the Mosaic GPU kernels: race-detector verdict and ptxas resources.

`races_found()` reads GPU interpret mode's race-detection state (private jax API, read only:
the kernels run with `InterpretGPUParams(detect_races=True)`), so a test can fail on a race.
`mosaic_resources(fn, *abstract_args)` compiles `fn` for the compile-only H200 of
pallas_kernels/deviceless/target.py with MOSAIC_GPU_DUMP_TO / MOSAIC_GPU_DUMP_PTXAS set and
returns, per Mosaic kernel, its ptxas registers and spill bytes and Mosaic's shared-memory
scratch bytes.
"""

import dataclasses


def races_found() -> bool:
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # pylint: disable=g-import-not-at-top
  races = getattr(gpu_callbacks, "_races", None)
  return bool(races is not None and races.races_found)


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
  name: str
  registers: int
  spill_bytes: int          # stores + loads
  shared_memory: int        # Mosaic's scratch (buffers and barriers), bytes


def mosaic_resources(fn, *args):
  """Compiles jax.jit(fn)(*args) deviceless for sm_90a; returns ([MosaicKernel], report)."""
  from pallas_kernels.deviceless import mosaic_configs  # pylint: disable=g-import-not-at-top
  kernels, report = mosaic_configs.compile_with_dump(fn, args)
  return [MosaicKernel(k["kernel"], k["registers"], k["spill_bytes"], k["shared_memory"])
          for k in kernels], report
