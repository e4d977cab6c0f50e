"""The Triton kernel configurations a GPU run can meet, compiled deviceless for sm_90
(H200).

Shared by tests/gpu_compile_kernels_test.py (asserts: compiles, no spill, shared memory in
budget, no pool-sized temp buffer) and experiments/gpu_compile_report.py (the table).

    case = Case("decode", "llama8b", dtype="bfloat16", block_size=16, batch=64, context=4096)
    row = measure(case)     # grid, warps, stages, shared memory, registers, spills, ...

The shapes and workloads are cases.py's (MODELS, WORKLOADS).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List

import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import sm90
from pallas_kernels.deviceless import target as ct
from pallas_kernels.deviceless import cases
from pallas_kernels.deviceless.cases import MODELS, WORKLOADS, Case
from pallas_kernels.triton import ragged_paged_attention as rpa
from pallas_kernels.triton import tuning


def resolved(case: Case) -> Dict[str, Any]:
  """The knobs the kernel's defaults resolve to for this case."""
  hq, hkv, d, _ = MODELS[case.model]
  knobs = dict(case.knobs)
  dp = tuning.padded_head_dim(d)
  if case.kernel == "decode":
    dec = tuning.decode_defaults(case.dtype, dp, padded=dp != d, page_dtype=case.pdtype)
    return {"tile_tokens": knobs.get("tile_tokens", dec.tile_tokens),
            "num_stages": knobs.get("num_stages", dec.num_stages)}
  _, args = cases.build(case, "triton")
  shapes = checks.check_ragged(*args)
  cfg = rpa.TuningConfig.resolve(shapes, interpret=False, **knobs)
  # The semantics the report recorded (defaults: the knobs do not depend on them).
  return dict(sm_scale=checks.check_semantics(None, None, None, head_dim=d).sm_scale,
              soft_cap=None, sliding_window=None, **dataclasses.asdict(cfg))


def kv_bytes(case: Case) -> int:
  """K/V bytes the kernel must read (scales included): the modelled traffic."""
  if case.kernel == "decode":
    return cases.kv_bytes(case, q_per_tile=None)
  cfg = resolved(case)
  return cases.kv_bytes(case, lambda q_len: (cfg["q_per_tile"] if q_len > cfg["short_q_per_tile"]
                                             else cfg["short_q_per_tile"]))


def measure(case: Case, fail_on_spill: bool = True) -> Dict[str, Any]:
  """Compiles `case` for sm_90; one row per kernel launch of ours, plus totals."""
  fn, args = cases.build(case, "triton")
  report = ct.compile_report(fn, *args, fail_on_spill=fail_on_spill)
  ours = [l for l in report.launches if l.name.startswith(("paged_decode", "ragged_paged"))]
  cfg = resolved(case)
  nbytes = kv_bytes(case)
  pool = 2 * args[1].size * jnp.dtype(args[1].dtype).itemsize
  launches = []
  for l in ours:
    threads = l.threads[0] * l.threads[1] * l.threads[2]
    programs = l.grid[0] * l.grid[1] * l.grid[2]
    blocks = (sm90.resident_blocks(l.registers, threads, l.shared_memory)
              if l.registers else None)
    launches.append({
        "kernel": l.name, "grid": list(l.grid), "warps": threads // 32,
        "stages": cfg.get("num_stages"), "shared_memory": l.shared_memory,
        "registers": l.registers, "spill_bytes": l.spill_bytes, "occupancy": l.occupancy,
        "resident_blocks_per_sm": blocks,
        "wave_efficiency": (sm90.wave_efficiency(programs, blocks * sm90.NUM_SMS)
                            if blocks else None)})
  hq, _, d, _ = MODELS[case.model]
  rows = case.batch if case.kernel == "decode" else WORKLOADS[case.workload][1]
  activation = rows * hq * tuning.padded_head_dim(d) * 4   # padded q / output rows in f32
  return {"case": case.name, "kernel": case.kernel, "model": case.model,
          "activation_bytes": activation,
          "dtype": case.dtype, "page_dtype": case.pdtype.name,
          "block_size": case.block_size, "resolved": cfg, "launches": launches,
          "temp_bytes": report.temp_bytes, "pool_bytes": pool, "kv_bytes_read": nbytes,
          "modelled_time_us": nbytes / sm90.HBM_BYTES_PER_S * 1e6,
          "max_shared_memory": max((l.shared_memory for l in ours), default=0),
          "spilled": [l.name for l in ours if l.spill_bytes]}


def default_cases() -> List[Case]:
  """A representative 20 compiles: each default tile class once per dtype family, plus
  the configurations that once spilled."""
  return [
      Case("decode", "llama8b", "bfloat16", batch=64),          # kernel_bench headline
      Case("decode", "llama8b", "float32", batch=8),            # finding 2 (was 270 KB)
      Case("decode", "llama8b", "float16", block_size=128, batch=8),
      Case("decode", "llama8b", "bfloat16", "int8", batch=8),
      Case("decode", "qwen", "bfloat16", "float8_e4m3fn", block_size=64, batch=256),
      Case("decode", "gemma", "bfloat16", block_size=32, batch=8),
      Case("decode", "gemma", "float32", block_size=8, batch=8),
      Case("decode", "d80", "bfloat16", batch=8),
      Case("ragged", "llama8b", "bfloat16", workload="mixed"),
      Case("ragged", "llama8b", "float32", workload="engine256"),   # finding 3 (spilled)
      Case("ragged", "llama8b", "float32", "int8", block_size=128, workload="engine8"),
      Case("ragged", "qwen", "float32", workload="engine256"),
      Case("ragged", "gemma", "bfloat16", block_size=64, workload="engine256"),
      Case("ragged", "gemma", "float32", block_size=8, workload="engine8"),
      Case("ragged", "d96", "bfloat16", "float8_e4m3fn", workload="engine256"),
      # Spilled on jax 0.10.2 before the bf16-parts path / occupancy-aware defaults
      # (triton/tuning.py): f32 q over int8 pages at D 256, Qwen-like f32.
      Case("decode", "gemma", "float32", "int8", block_size=8, batch=64),
      Case("ragged", "gemma", "float32", "int8", block_size=64, workload="engine256"),
      Case("ragged", "qwen", "float32", block_size=128, workload="mixed"),
      Case("ragged", "qwen", "float32", "int8", block_size=64, workload="engine256"),
      Case("ragged", "llama8b", "float32", "int8", block_size=128, workload="mixed"),
  ]


def full_cases() -> List[Case]:
  """The slow grid: models x dtypes x page dtypes x block sizes 8..128 for the decode
  kernel (B 64, 4K context) and two ragged workloads per pair (block sizes alternating),
  plus the block sizes 1, 4, 256 that gpu_check.sh's decode tests use."""
  out = []
  dtypes = [("bfloat16", None), ("float16", None), ("float32", None),
            ("bfloat16", "int8"), ("bfloat16", "float8_e4m3fn"), ("float32", "int8")]
  for i, (model, (dt, pdt)) in enumerate(itertools.product(MODELS, dtypes)):
    for bs in (8, 16, 32, 64, 128):
      out.append(Case("decode", model, dt, pdt, bs, batch=64))
    out.append(Case("ragged", model, dt, pdt, (8, 32, 128)[i % 3], workload="mixed"))
    out.append(Case("ragged", model, dt, pdt, (16, 64)[i % 2], workload="engine256"))
  for dt, bs in itertools.product(("bfloat16", "float32"), (1, 4, 256)):
    out.append(Case("decode", "llama8b", dt, block_size=bs, batch=8, context=2048))
  return out
