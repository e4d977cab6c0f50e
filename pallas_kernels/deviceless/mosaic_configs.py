"""The Mosaic GPU kernel configurations, compiled deviceless for sm_90a (H200).

Shared by experiments/gpu_compile_report.py (the resource table, `--backends=mosaic_gpu`)
and tests/mosaic_compile_configs_test.py (0 spills, shared memory within budget). The Triton
configurations are triton_configs.py; the shapes are the same real models' (cases.py:
(Llama-3-8B 32/8 x 128, Qwen-like 14/2 x 64, Gemma-like 8/4 x 256 with soft cap 50 and a
4096-token sliding window), restricted to what the Mosaic kernels accept (bf16 / f16 q;
pages of q's dtype or int8 / fp8 with scales; block sizes: powers of two >= 16; D 64 / 128
/ 256). `unsupported_cases()` are recorded with the reason they fall back to Triton.

    row = measure(MosaicCase("decode", "llama8b", block_size=64))
    row["registers"], row["spill_bytes"], row["shared_memory"], row["occupancy"]

Registers and spills come from ptxas (`MOSAIC_GPU_DUMP_PTXAS`), shared memory from Mosaic's
`smem_scratch_bytes` (buffers + barriers), threads from the PTX `.maxntid`. Needs jax >=
0.11.2 and the jax-cuda12 plugin / pjrt wheels (`unavailable_reason()` says why not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shutil
import tempfile
from typing import Any, Dict, List, Optional

import jax

from pallas_kernels import common
from pallas_kernels import sm90
from pallas_kernels.deviceless import cases
from pallas_kernels.deviceless import target as ct
from pallas_kernels.mosaic_gpu import paged_attention as mpa
from pallas_kernels.mosaic_gpu import pipeline as core
from pallas_kernels.mosaic_gpu import ragged_paged_attention as mrpa

# The models and ragged workloads of cases.py that Mosaic is measured on: "d80"
# (D % 64 != 0) is recorded as unsupported (Triton's).
MODELS = {k: cases.MODELS[k] for k in ("llama8b", "qwen", "gemma", "d80")}
WORKLOADS = {k: cases.WORKLOADS[k] for k in ("decode64", "prefill2k", "mixed", "engine256")}
QUANT = cases.QUANT
SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "int8",
         "float8_e4m3fn": "fp8"}


@dataclasses.dataclass(frozen=True)
class MosaicCase(cases.Case):
  """One Mosaic kernel call: `cases.Case` with Mosaic's default block size
  and short names (dtypes abbreviated, context in k); knobs: the kernel's tuning keywords."""
  block_size: int = 64

  @property
  def name(self) -> str:
    pages = f"/{SHORT[self.page_dtype]}" if self.page_dtype else ""
    work = (f"B{self.batch}x{self.context // 1024}k" if self.kernel == "decode"
            else self.workload)
    knobs = "".join(f",{k}={v}" for k, v in self.knobs)
    return (f"{self.kernel}:{self.model}:{SHORT[self.dtype]}{pages}:bs{self.block_size}:"
            f"{work}{knobs}")

  def supported_reason(self) -> Optional[str]:
    hq, hkv, d, _ = MODELS[self.model]
    return core.supported_reason(hq, hkv, d, self.block_size, self.dtype, self.pdtype,
                                 self.page_dtype in QUANT)


def default_cases() -> List[MosaicCase]:
  """The report's configs: every accepted block size at the Llama-3-8B headline (B 64,
  4K context), f16, int8 / fp8 pages, a wide KV tile, Qwen's group of 7 (split-K), Gemma's
  D 256 with soft cap + window (8K context, split-K); ragged prefill, mixed and the
  engine's 256-token step."""
  d, r = "decode", "ragged"
  return [
      *(MosaicCase(d, "llama8b", block_size=bs) for bs in (16, 32, 64, 128, 256)),
      MosaicCase(d, "llama8b", knobs=(("tile_kv", 128),)),
      MosaicCase(d, "llama8b", "float16"),
      MosaicCase(d, "llama8b", page_dtype="int8"),
      MosaicCase(d, "llama8b", page_dtype="float8_e4m3fn", block_size=16),
      MosaicCase(d, "qwen"),
      MosaicCase(d, "qwen", "float16", "int8", block_size=32, batch=256),
      MosaicCase(d, "gemma", batch=16, context=8192),
      MosaicCase(d, "gemma", page_dtype="int8", batch=16, context=8192),
      MosaicCase(r, "llama8b", workload="prefill2k"),
      MosaicCase(r, "llama8b", block_size=16, workload="mixed"),
      MosaicCase(r, "llama8b", page_dtype="int8", workload="engine256"),
      MosaicCase(r, "qwen", block_size=32, workload="engine256"),
      MosaicCase(r, "gemma", workload="engine256"),
      MosaicCase(r, "gemma", "float16", "float8_e4m3fn", block_size=16, workload="engine256"),
  ]


def unsupported_cases() -> List[MosaicCase]:
  """Configs the Mosaic kernels refuse (the engine uses Triton for them): the reason is
  recorded, nothing is compiled."""
  return [MosaicCase("decode", "llama8b", block_size=8),
          MosaicCase("decode", "llama8b", "float32"),
          MosaicCase("decode", "d80")]


def unavailable_reason() -> Optional[str]:
  """None when the Mosaic configs can be compiled here, else a one-line reason."""
  if core.plgpu is None or common.jax_version() < (0, 11, 2):
    return f"the Mosaic GPU kernels need jax >= 0.11.2, this is jax {jax.__version__}"
  return ct.unavailable_reason()


def resolved(case: MosaicCase) -> Dict[str, Any]:
  """The knobs the kernel's defaults resolve to, and its grid."""
  hq, hkv, d, _ = MODELS[case.model]
  knobs = dict(case.knobs)
  tile_kv = knobs.get("tile_kv", 64)
  quant = 1 if case.quantized else None
  stages = knobs.get("num_stages") or core.default_num_stages(d, tile_kv, quant)
  if case.kernel == "decode":
    pages = -(-case.context // case.block_size)
    splits = knobs.get("num_splits") or mpa.default_num_splits(
        case.batch, hkv, pages, case.block_size, tile_kv)
    return {"tile_kv": tile_kv, "num_stages": stages, "num_splits": splits,
            "grid": [hkv, case.batch, splits]}
  seqs, tokens = WORKLOADS[case.workload]
  q_per_tile = knobs.get("q_per_tile") or core.Q_ROWS // (hq // hkv)
  splits = knobs.get("num_splits", 1)
  n_max = mrpa.num_query_tiles(tokens, len(seqs), q_per_tile)
  return {"tile_kv": tile_kv, "num_stages": stages, "num_splits": splits,
          "q_per_tile": q_per_tile, "grid": [hkv, n_max, splits]}


def kv_bytes(case: MosaicCase) -> int:
  """K/V bytes (scales included) of the live keys each program must read
  (`cases.kv_bytes`, tiles of the resolved q_per_tile)."""
  tq = resolved(case)["q_per_tile"] if case.kernel == "ragged" else None
  return cases.kv_bytes(case, lambda q_len: tq)


def build(case: MosaicCase):
  """(fn, abstract args on the compile-only H200) through the package entry points."""
  return cases.build(case, "mosaic_gpu")


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


def _read_dump(dump: str) -> List[Dict[str, Any]]:
  kernels = []
  for path in sorted(glob.glob(os.path.join(dump, "*.ptxas"))):
    stem = path[:-len(".ptxas")]
    text = open(path).read()
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    smem = re.search(r"smem_scratch_bytes=(\d+)", open(stem + ".resources.txt").read())
    ntid = re.search(r"\.maxntid (\d+), (\d+), (\d+)", open(stem + ".ptx").read())
    kernels.append({"kernel": re.sub(r"_\d+$", "", os.path.basename(stem)),  # dump's _0
                    "registers": int(re.search(r"Used (\d+) registers", text).group(1)),
                    "spill_bytes": int(spill.group(1)) + int(spill.group(2)),
                    "shared_memory": int(smem.group(1)),
                    "threads": int(ntid.group(1)) * int(ntid.group(2)) * int(ntid.group(3))})
  return kernels


def compile_with_dump(fn, args, *, fail_on_spill: bool = True):
  """Compiles jax.jit(fn)(*args) for the compile-only sm_90a with Mosaic's PTX / ptxas
  dumps on. Returns (per Mosaic kernel {"kernel", "registers", "spill_bytes",
  "shared_memory", "threads"}, compile_target's report)."""
  dump = tempfile.mkdtemp(prefix="pj_mosaic_dump_")
  try:
    with _env(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1"):
      report = ct.compile_report(jax.jit(fn), *args, fail_on_spill=fail_on_spill)
    return _read_dump(dump), report
  finally:
    shutil.rmtree(dump, ignore_errors=True)


def measure(case: MosaicCase, hbm_bytes_per_s: float = sm90.HBM_BYTES_PER_S,
            copy_bytes_per_s: Optional[float] = None) -> Dict[str, Any]:
  """Compiles `case` for sm_90a; its one Mosaic kernel's resources and the modelled bound
  (K/V bytes over `hbm_bytes_per_s` and, if given, the measured `copy_bytes_per_s`)."""
  kernels, report = compile_with_dump(*build(case), fail_on_spill=False)
  if len(kernels) != 1:
    raise RuntimeError(f"{case.name}: expected one Mosaic kernel, got {kernels}")
  k = kernels[0]
  cfg = resolved(case)
  if f"_bs{case.block_size}_" not in k["kernel"] or \
      not k["kernel"].endswith(f"_splits{cfg['num_splits']}"):
    raise RuntimeError(f"{case.name}: kernel {k['kernel']} is not the resolved {cfg}")
  blocks = sm90.resident_blocks(k["registers"], k["threads"], k["shared_memory"])
  programs = cfg["grid"][0] * cfg["grid"][1] * cfg["grid"][2]
  slots = blocks * sm90.NUM_SMS
  nbytes = kv_bytes(case)
  row = {"case": case.name, "kernel": case.kernel, "model": case.model, "dtype": case.dtype,
         "page_dtype": case.pdtype.name, "block_size": case.block_size,
         "workload": (f"B{case.batch} ctx {case.context}" if case.kernel == "decode"
                      else case.workload),
         "resolved": cfg, **k, "resident_blocks_per_sm": blocks,
         "occupancy": blocks * k["threads"] / sm90.MAX_THREADS_PER_SM,
         "wave_efficiency": sm90.wave_efficiency(programs, slots) if slots else None,
         "temp_bytes": report.temp_bytes, "kv_bytes_read": nbytes,
         "modelled_us_at_hbm_spec": nbytes / hbm_bytes_per_s * 1e6}
  if copy_bytes_per_s:
    row["modelled_us_at_measured_copy"] = nbytes / copy_bytes_per_s * 1e6
  return row
