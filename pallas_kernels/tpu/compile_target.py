"""Compile for a TPU that is not there: libtpu's compile-only topologies, on a CPU host.

    with tpu_target("v5e") as dev:
      report = compile_report(jax.jit(f), *place(args, dev))
    report.kernels      # every Mosaic kernel: name, VMEM used, scoped VMEM limit
    report.temp_bytes   # XLA's HBM temporaries (memory_analysis)
    report.large_buffers(min_bytes)   # every instruction result >= min_bytes, any memory

Needs `libtpu` (pip install "jax[tpu]==<the installed jax>", see requirements-compile.txt);
`unavailable_reason()` says why when it is missing (tests skip with it). libtpu prints a
few warnings about TPU_* environment variables at start-up: harmless here.

Why `large_buffers` and not only `temp_bytes`: XLA's TPU compiler may place a temporary
in VMEM (memory space S(1)), which memory_analysis does not count. A layout copy of a
whole scale array was found that way (tpu/scales.py). Every non-parameter instruction of
the optimized module whose result is at least `min_bytes` is listed, whatever its memory
space, so a pool-sized copy cannot hide (results a custom call writes in place of a
donated operand, `output_to_operand_aliasing`, are not new buffers and are not counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from typing import Any, List, Optional, Sequence, Tuple

import jax
import numpy as np

CHIPS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1", "v4": "v4:2x2x1"}
# Peak HBM bandwidth, bytes/s (public spec sheets: v5e 819 GB/s, v6e 1,640 GB/s).
HBM_BYTES_PER_S = {"v5e": 819e9, "v6e": 1640e9, "v5p": 2765e9, "v4": 1228e9}
# HBM capacity per chip (spec sheets): a pool that does not fit cannot compile.
HBM_BYTES = {"v5e": 16 * 2**30, "v6e": 32 * 2**30, "v5p": 95 * 2**30, "v4": 32 * 2**30}
# Mosaic's default scoped VMEM limit when a kernel sets none (Pallas TPU docs: 16 MiB
# before v6, 32 MiB on v6e); a kernel compiled with a limit carries it in its HLO.
DEFAULT_SCOPED_VMEM_BYTES = {"v5e": 16 * 2**20, "v6e": 32 * 2**20, "v5p": 16 * 2**20,
                             "v4": 16 * 2**20}


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
  """None when a compile-only TPU can be built here, else a one-line reason."""
  try:
    tpu_devices("v5e")
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ("deviceless TPU compile unavailable (install requirements-compile.txt: "
            f"jax[tpu]=={jax.__version__}): {first}")
  return None


@functools.lru_cache(maxsize=None)
def tpu_devices(chip: str = "v5e") -> Tuple[Any, ...]:
  """The compile-only devices of a small `chip` topology (never run on)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # libtpu takes a machine-wide lock file unless told otherwise: without this, a second
  # process (a pytest-xdist worker, a report beside a test run) finds no TPU compiler.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if chip not in CHIPS:
    raise ValueError(f"chip={chip!r} must be one of {sorted(CHIPS)}")
  return tuple(topologies.get_topology_desc(CHIPS[chip], "tpu").devices)


@contextlib.contextmanager
def tpu_target(chip: str = "v5e"):
  """Makes a compile-only `chip` device the default device (Pallas TPU reads the chip
  generation from it), yields it, and restores the previous default afterwards."""
  dev = tpu_devices(chip)[0]
  previous = jax.config.jax_default_device
  jax.config.update("jax_default_device", dev)
  try:
    yield dev
  finally:
    jax.config.update("jax_default_device", previous)


def abstract(shape: Sequence[int], dtype, device) -> jax.ShapeDtypeStruct:
  """A `ShapeDtypeStruct` on the compile-only device (nothing is allocated)."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype,
                              sharding=jax.sharding.SingleDeviceSharding(device))


def place(tree: Any, device) -> Any:
  """Every array-like leaf (array or ShapeDtypeStruct) of `tree` on `device`."""
  return jax.tree_util.tree_map(lambda x: abstract(x.shape, x.dtype, device), tree)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One Mosaic kernel (tpu_custom_call) of the compiled module.

  Attributes:
    name: the HLO instruction name (Pallas `name=` plus a suffix).
    vmem_bytes: VMEM the kernel uses (Mosaic's used scoped memory).
    vmem_limit_bytes: the scoped VMEM limit it was compiled with, None for the chip's
      default (DEFAULT_SCOPED_VMEM_BYTES).
  """
  name: str
  vmem_bytes: int
  vmem_limit_bytes: Optional[int]


@dataclasses.dataclass(frozen=True)
class Buffer:
  """An instruction result of the optimized module: name, op, shape text, bytes, memory
  space (0 HBM, 1 VMEM, ...)."""
  name: str
  op: str
  shape: str
  nbytes: int
  memory_space: int


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What the TPU compiler made of one jitted function.

  Attributes:
    kernels: Mosaic kernels, in module order.
    buffers: every non-parameter, non-bitcast instruction result (see `large_buffers`).
    temp_bytes / argument_bytes / output_bytes / alias_bytes: memory_analysis (HBM).
  """
  kernels: Tuple[Kernel, ...]
  buffers: Tuple[Buffer, ...]
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int

  @property
  def max_vmem_bytes(self) -> int:
    return max((k.vmem_bytes for k in self.kernels), default=0)

  def kernel(self, prefix: str) -> List[Kernel]:
    return [k for k in self.kernels if k.name.startswith(prefix)]

  def large_buffers(self, min_bytes: int) -> List[Buffer]:
    return [b for b in self.buffers if b.nbytes >= min_bytes]


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2,
                "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
                "u64": 8, "f64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*"
                    r"(?P<type>\(.*?\)|[^\s{]+)(?:\{(?P<layout>[^}]*)\})?"
                    r"\s+(?P<op>[\w\-]+)\(")
_ARRAY = re.compile(r"(?P<dt>[a-z]\w*)\[(?P<dims>[\d,]*)\]")
_SKIP_OPS = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant", "copy-done"}
_USED_VMEM = re.compile(r'"used_scoped_memory_configs":\[\{[^}]*?"size":"(\d+)"')
_LIMIT_VMEM = re.compile(r'"scoped_memory_configs":\[\{[^}]*?"size":"(\d+)"')


_ALIASED = re.compile(r"output_to_operand_aliasing=\{(?P<body>.*?)\}\s*(?:,|$)")
_ALIAS_KEY = re.compile(r"\{(?P<index>[\d,]*)\}:\s*\(")


def _array_bytes(type_text: str, skip=()) -> int:
  """Bytes of an instruction's result; tuple elements in `skip` (aliased) not counted."""
  total = 0
  for i, m in enumerate(_ARRAY.finditer(type_text)):
    if i in skip:
      continue
    dims = [int(d) for d in m["dims"].split(",") if d]
    total += int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES.get(m["dt"], 4)
  return total


def _aliased_outputs(line: str) -> Tuple[int, ...]:
  """Result tuple indices a custom call writes in place of an operand ({} = the whole
  result: index 0)."""
  m = _ALIASED.search(line)
  if not m:
    return ()
  return tuple(int(k["index"].split(",")[0] or 0) for k in _ALIAS_KEY.finditer(m["body"]))


def parse_module(text: str) -> Tuple[List[Kernel], List[Buffer]]:
  """(Mosaic kernels, instruction buffers) of an optimized TPU HLO module's text."""
  kernels, buffers = [], []
  for line in text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    if 'custom_call_target="tpu_custom_call"' in line:
      used = _USED_VMEM.search(line)
      limit = _LIMIT_VMEM.search(line)
      kernels.append(Kernel(m["name"], int(used[1]) if used else 0,
                            int(limit[1]) if limit else None))
    if m["op"] in _SKIP_OPS:
      continue
    space = re.search(r"S\((\d+)\)", m["layout"] or "")
    if m["op"].endswith("-start"):    # (destination, source, context): count the first
      nbytes = _array_bytes(_ARRAY.search(m["type"])[0]) if _ARRAY.search(m["type"]) else 0
    else:
      nbytes = _array_bytes(m["type"], _aliased_outputs(line))
    buffers.append(Buffer(m["name"], m["op"], m["type"], nbytes,
                          int(space[1]) if space else 0))
  return kernels, buffers


def compile_report(jitted, *args, chip: str = "v5e", **kwargs) -> CompileReport:
  """Lowers and compiles `jitted(*args, **kwargs)` for `chip` (args already placed on one
  of its devices, e.g. with `place`). Raises whatever Mosaic / XLA raise."""
  with tpu_target(chip):
    compiled = jitted.trace(*args, **kwargs).lower().compile()
  kernels, buffers = parse_module(compiled.as_text())
  mem = compiled.memory_analysis()
  return CompileReport(tuple(kernels), tuple(buffers), int(mem.temp_size_in_bytes),
                       int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                       int(mem.alias_size_in_bytes))
