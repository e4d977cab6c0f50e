"""Test support for the Mosaic GPU kernels: race-detector verdict and ptxas resources.

`races_found()` reads GPU interpret mode's race-detection state (private jax API, read only:
the kernels run with `InterpretGPUParams(detect_races=True)`), so a test can fail on a race.
`mosaic_resources(fn, *abstract_args)` compiles `fn` for the compile-only H200 of
pallas_kernels/compile_target.py with MOSAIC_GPU_DUMP_TO / MOSAIC_GPU_DUMP_PTXAS set and
returns, per Mosaic kernel, its ptxas registers and spill bytes and Mosaic's shared-memory
scratch bytes.
"""

import contextlib
import dataclasses
import glob
import os
import re
import shutil
import tempfile

import jax

from pallas_kernels import compile_target


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


@contextlib.contextmanager
def _env(**values):
  old = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def mosaic_resources(fn, *args):
  """Compiles jax.jit(fn)(*args) deviceless for sm_90a; returns ([MosaicKernel], report)."""
  dump = tempfile.mkdtemp(prefix="pj_mosaic_dump_")
  try:
    with _env(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1"):
      report = compile_target.compile_report(jax.jit(fn), *args)
    kernels = []
    for path in sorted(glob.glob(os.path.join(dump, "*.ptxas"))):
      text = open(path).read()
      name = os.path.basename(path)[:-len(".ptxas")]
      regs = int(re.search(r"Used (\d+) registers", text).group(1))
      props = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
      spills = int(props.group(1)) + int(props.group(2))
      res = open(path[:-len(".ptxas")] + ".resources.txt").read()
      smem = int(re.search(r"smem_scratch_bytes=(\d+)", res).group(1))
      kernels.append(MosaicKernel(name, regs, spills, smem))
    return kernels, report
  finally:
    shutil.rmtree(dump, ignore_errors=True)
