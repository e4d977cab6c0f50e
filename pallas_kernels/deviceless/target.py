"""Compile for an H100/H200 that is not there: XLA's whole GPU pipeline, run on a CPU host.

`lower(lowering_platforms=("cuda",))` only proves that Pallas can emit a kernel. This module
runs the compiler a GPU run would use (Triton IR / Mosaic MLIR -> PTX -> SASS, shared-memory
and launch planning, the XLA fusions around the kernels) for a compile-only device described
by a `GpuTargetConfigProto`, and reads back what a GPU run would meet: compile failures
(shared memory over budget), register spills, the launches (grid, threads, shared memory per
kernel) and XLA's temp buffers. Nothing is allocated, so an 8B-model KV pool costs nothing.

    report = compile_report(jax.jit(f), *abstract_args(dev, shapes...))
    report.spilled_kernels, report.max_shared_memory, report.temp_bytes

Needs the `jax-cuda12-plugin` / `jax-cuda12-pjrt` wheels of the installed jaxlib version
(`requirements-compile.txt`); `unavailable_reason()` says why when they are missing. Keep
`JAX_PLATFORMS=cpu`: the plugin finds no driver and nothing tries to open a GPU.
ptxas (for per-kernel registers and spill bytes) is taken from $PTXAS, PATH or
/usr/local/cuda/bin; without it the report still has XLA's own spill check (compile fails).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax

from pallas_kernels import sm90

# H100 SXM / H200: 132 SMs, 227 KiB opt-in shared memory per block, 64K registers per SM.
# Only the fields XLA's GPU compiler reads for planning; bandwidth is H200's 4.8 TB/s.
SM90_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""
# Other compile-only GPUs (cost analysis across the paper's and today's cards): the same
# fields from the vendors' datasheets and CUDA occupancy tables. H100 SXM: sm_90 as above,
# 80 GB at 3.35 TB/s, 50 MiB L2. A100 SXM4 40GB: sm_80, 108 SMs, 164 KiB shared memory
# per SM (163 KiB opt-in per block), 40 MiB L2, 1,555 GB/s, 1.41 GHz.
_GPU_FIELDS = {
    "h200": SM90_TARGET_CONFIG,
    "h100": SM90_TARGET_CONFIG.replace("memory_bandwidth: 4800000000000",
                                       "memory_bandwidth: 3350000000000")
    .replace("device_memory_size: 150754820096", "device_memory_size: 85520809984")
    .replace("NVIDIA H200", "NVIDIA H100 80GB HBM3"),
    "a100": SM90_TARGET_CONFIG.replace("shared_memory_per_core: 233472",
                                       "shared_memory_per_core: 167936")
    .replace("shared_memory_per_block_optin: 232448", "shared_memory_per_block_optin: 166912")
    .replace("core_count: 132 fpus_per_core: 128", "core_count: 108 fpus_per_core: 64")
    .replace("memory_bandwidth: 4800000000000", "memory_bandwidth: 1555000000000")
    .replace("l2_cache_size: 52428800 clock_rate_ghz: 1.98",
             "l2_cache_size: 41943040 clock_rate_ghz: 1.41")
    .replace("device_memory_size: 150754820096", "device_memory_size: 42505273344")
    .replace("major: 9 minor: 0", "major: 8 minor: 0")
    .replace("NVIDIA H200", "NVIDIA A100-SXM4-40GB"),
}
GPU_TARGETS = tuple(_GPU_FIELDS)

SM90_SHARED_MEMORY_BYTES = sm90.SHARED_MEMORY_BYTES      # opt-in limit per thread block
SM90_REGISTERS_PER_SM = sm90.REGISTERS_PER_SM
SM90_MAX_THREADS_PER_SM = sm90.MAX_THREADS_PER_SM
H200_HBM_BYTES_PER_S = sm90.HBM_BYTES_PER_S

_SPILL_OPTION = "xla_gpu_fail_ptx_compilation_on_register_spilling"


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
  """None when a compile-only H200 can be built here, else a one-line reason."""
  try:
    sm90_device()
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ("deviceless GPU compile unavailable (install requirements-compile.txt: "
            f"jax-cuda12-plugin/pjrt=={jax.__version__}): {first}")
  return None


def sm90_device():
  """A compile-only NVIDIA H200 (sm_90) device: a valid sharding target, never run on."""
  return gpu_device("h200")


@functools.lru_cache(maxsize=None)
def gpu_device(name: str = "h200"):
  """A compile-only GPU of GPU_TARGETS ("h200", "h100", "a100"), never run on."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if name not in _GPU_FIELDS:
    raise ValueError(f"gpu target must be one of {GPU_TARGETS}, got {name!r}")
  topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                      target_config=_GPU_FIELDS[name])
  return topo.devices[0]


def abstract(shape: Sequence[int], dtype, device=None) -> jax.ShapeDtypeStruct:
  """A `ShapeDtypeStruct` placed on the compile-only device (nothing is allocated)."""
  device = sm90_device() if device is None else device
  return jax.ShapeDtypeStruct(tuple(shape), dtype,
                              sharding=jax.sharding.SingleDeviceSharding(device))


def place(tree: Any, device=None) -> Any:
  """Puts every array-like leaf of `tree` (arrays or ShapeDtypeStructs) on the device."""
  return jax.tree_util.tree_map(lambda x: abstract(x.shape, x.dtype, device), tree)


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel launch of the compiled program (from XLA's thunk sequence).

  Attributes:
    name: kernel name (Pallas kernels carry their `name=`; XLA fusions their fusion name).
    grid: (x, y, z) thread blocks.
    threads: (x, y, z) threads per block.
    shared_memory: bytes of shared memory per block.
    registers: registers per thread (ptxas), or None where no PTX was read.
    spill_bytes: spill stores + loads per thread (ptxas), or None.
  """
  name: str
  grid: Tuple[int, int, int]
  threads: Tuple[int, int, int]
  shared_memory: int
  registers: Optional[int] = None
  spill_bytes: Optional[int] = None

  @property
  def occupancy(self) -> Optional[float]:
    """Resident threads per SM over the maximum (registers and shared memory bound)."""
    threads = self.threads[0] * self.threads[1] * self.threads[2]
    if not threads or self.registers is None:
      return None
    blocks = sm90.resident_blocks(self.registers, threads, self.shared_memory)
    return blocks * threads / sm90.MAX_THREADS_PER_SM


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What XLA's GPU compiler made of one jitted function.

  Attributes:
    launches: every kernel launch, in thunk order.
    temp_bytes: XLA temp buffer bytes (`memory_analysis().temp_size_in_bytes`).
    argument_bytes / output_bytes: bytes of the arguments / outputs.
    alias_bytes: output bytes aliased to donated arguments.
  """
  launches: Tuple[Launch, ...]
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int

  @property
  def spilled_kernels(self) -> List[str]:
    return [l.name for l in self.launches if l.spill_bytes]

  @property
  def max_shared_memory(self) -> int:
    return max((l.shared_memory for l in self.launches), default=0)

  def launch(self, prefix: str) -> List[Launch]:
    """Launches whose kernel name starts with `prefix`."""
    return [l for l in self.launches if l.name.startswith(prefix)]


_THUNK_RE = re.compile(
    r"(?P<kind>kCustomKernel|kKernel)\s*\[[^\]]*\]\s+(?P<name>\S+)\s+grid:\s*\[(?P<grid>[^\]]+)\]"
    r"\s+threads:\s*\[(?P<threads>[^\]]+)\]\s+shared_memory:\s*(?P<smem>\d+)")


def _parse_thunks(text: str) -> List[Launch]:
  launches = []
  for m in _THUNK_RE.finditer(text):
    grid = tuple(int(x) for x in m["grid"].split(","))
    threads = tuple(int(x) for x in m["threads"].split(","))
    launches.append(Launch(m["name"], grid, threads, int(m["smem"])))
  return launches


def ptxas_path() -> Optional[str]:
  for candidate in (os.environ.get("PTXAS"), shutil.which("ptxas"),
                    "/usr/local/cuda/bin/ptxas"):
    if candidate and os.path.exists(candidate):
      return candidate
  return None


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _ptxas_resources(ptx_files: Sequence[str]) -> Dict[str, Tuple[int, int]]:
  """{kernel name: (registers, spill bytes)} from `ptxas -v` on the dumped PTX."""
  ptxas = ptxas_path()
  if ptxas is None:
    return {}
  out: Dict[str, Tuple[int, int]] = {}
  for path in ptx_files:
    proc = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                          capture_output=True, text=True, check=False)
    name, spill = None, 0
    for line in (proc.stderr + proc.stdout).splitlines():
      if (m := _PTXAS_ENTRY.search(line)):
        name, spill = m["name"], 0
      elif (m := _PTXAS_SPILL.search(line)):
        spill = int(m[1]) + int(m[2])
      elif (m := _PTXAS_REGS.search(line)) and name is not None:
        out[name] = (int(m[1]), spill)
  return out


def gpu_target_context(device=None):
  """Context in which Pallas lowers for the compile-only GPU rather than the host.

  jax >= 0.11's Triton lowering asks the *default* device for its GPU kind (the CPU here)
  unless an abstract mesh names the target; jax 0.10 takes it from the lowering platform.
  An abstract mesh carrying the target's device kind serves both (no-op where unknown).
  """
  device = sm90_device() if device is None else device
  sharding = jax.sharding
  if not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
    return contextlib.nullcontext()
  abstract_device = sharding.AbstractDevice(device_kind=device.device_kind, num_cores=None,
                                            platform="cuda")
  mesh = sharding.AbstractMesh((1,), ("_gpu_target",), abstract_device=abstract_device)
  return sharding.use_abstract_mesh(mesh)


def lower_for_gpu(jitted, *args, **kwargs):
  """`jitted.trace(...).lower()` for the device the args are placed on (see above)."""
  with gpu_target_context():
    return jitted.trace(*args, **kwargs).lower()


def compile_report(jitted, *args, fail_on_spill: bool = True,
                   extra_options: Optional[Dict[str, Any]] = None,
                   dump_dir: Optional[str] = None, **kwargs) -> CompileReport:
  """Lowers and compiles `jitted(*args, **kwargs)` for the device its args are placed on.

  Raises whatever XLA raises for a program that cannot run there (shared memory over the
  limit, a spill when `fail_on_spill`). Mosaic GPU kernels are compiled inside their custom
  call; their registers come from MOSAIC_GPU_DUMP_PTXAS (see `mosaic_resources`).
  """
  owned = dump_dir is None
  dump_dir = tempfile.mkdtemp(prefix="pj_gpu_compile_") if owned else dump_dir
  try:
    options = {"xla_dump_to": dump_dir, _SPILL_OPTION: bool(fail_on_spill)}
    options.update(extra_options or {})
    compiled = lower_for_gpu(jitted, *args, **kwargs).compile(compiler_options=options)
    thunks = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))
    launches = _parse_thunks(open(thunks[-1]).read()) if thunks else []
    resources = _ptxas_resources(sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))))
    launches = [dataclasses.replace(l, registers=resources.get(l.name, (None, None))[0],
                                    spill_bytes=resources.get(l.name, (None, None))[1])
                for l in launches]
    mem = compiled.memory_analysis()
    return CompileReport(tuple(launches), int(mem.temp_size_in_bytes),
                         int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                         int(mem.alias_size_in_bytes))
  finally:
    if owned:
      shutil.rmtree(dump_dir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def pallas_gpu_call_targets() -> Tuple[str, ...]:
  """Custom-call target(s) a Pallas Triton kernel lowers to under this JAX version.

  Read from a one-line kernel lowered for the GPU, so tests never hard-code one version's
  name (jax 0.10 / 0.11 both say `__gpu$xla.gpu.triton` today; nothing relies on it).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  def f(x):
    spec = pl.BlockSpec((16,), lambda i: (0,))
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(1,), in_specs=[spec], out_specs=spec,
                          compiler_params=plgpu.CompilerParams(num_warps=1),
                          cost_estimate=pl.CostEstimate(flops=16, transcendentals=0,
                                                        bytes_accessed=2 * x.size * x.dtype.itemsize),
                          name="probe_kernel")(x)
  text = lower_for_gpu_or_platform(jax.jit(f), jax.ShapeDtypeStruct((16,), jnp.float32))
  return tuple(sorted(set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))))


def lower_for_gpu_or_platform(jitted, *args) -> str:
  """StableHLO text of `jitted(*args)` lowered for CUDA without a GPU.

  With the compile plugin: args placed on the compile-only H200 and `lower_for_gpu`
  (works on jax 0.10 and 0.11). Without it, jax 0.10's `lowering_platforms=("cuda",)`
  (0.11's Triton lowering needs the GPU target); raises RuntimeError where neither works.
  """
  if unavailable_reason() is None:
    return lower_for_gpu(jitted, *place(args)).as_text()
  try:
    return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(f"cannot lower for CUDA here: {unavailable_reason()}") from e
