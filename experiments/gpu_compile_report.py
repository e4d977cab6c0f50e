r"""What XLA's GPU compiler makes of every kernel configuration, for an H200 that is not here.

    python -m experiments.gpu_compile_report --backends=triton --out=experiments/results/gpu_compile_report
    .venv312/bin/python -m experiments.gpu_compile_report --backends=mosaic_gpu \
        --out=experiments/results/gpu_compile_report          # Mosaic GPU: jax >= 0.11.2
    python -m experiments.gpu_compile_report --cases=full --out=DIR     # the slow Triton grid

Compiles each case for a compile-only sm_90 device (pallas_kernels/deviceless/target.py: XLA's
own Triton -> PTX -> SASS or Mosaic MLIR -> PTX -> SASS pipeline on this CPU host) and
records per kernel launch: grid, threads / warps, pipeline stages, shared memory, registers,
spill bytes, occupancy (resident threads per SM over 2048), resident blocks and wave
efficiency (busy fraction of the SM slots over the waves the grid takes), plus XLA's temp
bytes and a *modelled* bandwidth bound: the K/V bytes the kernel must read over H200's
4.8 TB/s (and, for Mosaic, over the copy bandwidth measured on an H200 when
results/gpu_check_h200/kernel_bench.json has it). Nothing runs: achieved bandwidth needs a
GPU (experiments/gpu_check.sh). Spills are reported, not fatal (the tests fail on them).

Each backend writes its own JSON, with the flags, versions and machine of its own run:
  triton:     DIR/gpu_compile_report.json        (pallas_kernels/deviceless/triton_configs.py)
  mosaic_gpu: DIR/mosaic_gpu_compile_report.json (pallas_kernels/deviceless/mosaic_configs.py)
The Mosaic GPU kernels need jax >= 0.11.2: under jax 0.10.2 that part is skipped with the
reason printed and recorded in the Triton JSON ("skipped"); asked for alone, it is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from typing import Tuple

import jax

from experiments import common
from experiments import configs

BACKENDS = ("triton", "mosaic_gpu")
COPY_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                          "gpu_check_h200", "kernel_bench.json")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.gpu_compile_report."""
  out: str = configs.flag("results/gpu_compile_report", "output directory")
  cases: str = configs.flag("default", "default: the ~16 representative Triton configs; full: "
                            "the slow test grid (Mosaic GPU has one list either way)",
                            choices=("default", "full"))
  only: str = configs.flag("", "substring filter on case names (empty: all)")
  backends: Tuple[str, ...] = configs.flag(BACKENDS, f"which kernels: any of {BACKENDS}")


def _row_cells(row):
  cells = []
  for l in row["launches"]:
    cells.append([row["case"], l["kernel"].split("_", 2)[-1], "x".join(map(str, l["grid"])),
                  l["warps"], l["stages"], l["shared_memory"], l["registers"],
                  l["spill_bytes"], l["occupancy"], l["wave_efficiency"],
                  round(row["modelled_time_us"], 1), round(row["temp_bytes"] / 2**20, 2)])
  return cells


def _target(compile_target, **extra):
  return {"device": "NVIDIA H200 (compile-only, sm_90)",
          "shared_memory_per_block_optin": compile_target.SM90_SHARED_MEMORY_BYTES,
          "registers_per_sm": compile_target.SM90_REGISTERS_PER_SM,
          "hbm_bytes_per_s": compile_target.H200_HBM_BYTES_PER_S,
          "ptxas": compile_target.ptxas_path(), "jax": jax.__version__, **extra}


def _triton(flag_values, out, skipped):
  # pylint: disable=g-import-not-at-top
  from pallas_kernels.deviceless import triton_configs as compile_configs
  from pallas_kernels.deviceless import target as compile_target
  cases = (compile_configs.default_cases() if flag_values.cases == "default"
           else compile_configs.full_cases())
  cases = [c for c in cases if flag_values.only in c.name]
  rows, failures = common.compile_each(
      cases, lambda c: compile_configs.measure(c, fail_on_spill=False))
  result = dict(common.run_metadata(flag_values), target=_target(compile_target),
                rows=rows, failures=failures, **({"skipped": skipped} if skipped else {}))
  path = common.write_json(out / "gpu_compile_report.json", result)
  headers = ["case", "launch", "grid", "warps", "stages", "smem B", "regs", "spill B",
             "occupancy", "wave eff", "model us", "temp MiB"]
  print(common.table([c for r in rows for c in _row_cells(r)], headers=headers, digits=3))
  print(f"triton: {len(rows)} compiled, {len(failures)} failed, "
        f"{sum(bool(r['spilled']) for r in rows)} with spills -> {path}")


def _measured_copy():
  """(bytes/s, source) of the H200 copy bandwidth measured by gpu_check.sh, or (None, why)."""
  if not os.path.exists(COPY_BENCH):
    return None, f"{COPY_BENCH}: absent"
  meta = json.load(open(COPY_BENCH)).get("meta", {})
  gbps = meta.get("copy_bandwidth_GBps")
  if not gbps:
    return None, "gpu_check_h200/kernel_bench.json has no copy_bandwidth_GBps"
  return gbps * 1e9, (f"gpu_check_h200/kernel_bench.json meta.copy_bandwidth_GBps "
                      f"({meta.get('device')}, jax {meta.get('jax')}, {meta.get('date')})")


def _ptxas_version(path):
  if not path:
    return None
  proc = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
  return (proc.stdout.strip().splitlines() or [None])[-1]


def _mosaic(flag_values, out):
  # pylint: disable=g-import-not-at-top
  from pallas_kernels.deviceless import target as compile_target
  from pallas_kernels.deviceless import mosaic_configs as mcc
  copy_bps, copy_source = _measured_copy()
  cases = [c for c in mcc.default_cases() if flag_values.only in c.name]
  rows, failures = common.compile_each(
      cases, lambda c: mcc.measure(c, compile_target.H200_HBM_BYTES_PER_S, copy_bps))
  unsupported = [{"case": c.name, "reason": c.supported_reason()}
                 for c in mcc.unsupported_cases() if flag_values.only in c.name]
  result = dict(
      common.run_metadata(flag_values),
      target=_target(compile_target, arch="sm_90a",
                     ptxas_version=_ptxas_version(compile_target.ptxas_path()),
                     resources="registers / spills: ptxas via MOSAIC_GPU_DUMP_PTXAS; shared "
                               "memory: Mosaic smem_scratch_bytes; threads: PTX .maxntid"),
      bandwidth_model={
          "modelled": True,
          "what": "not measured: K/V bytes (scales included) the kernel must read, over a "
                  "bandwidth; queries, outputs and split partials not counted",
          "hbm_spec_bytes_per_s": compile_target.H200_HBM_BYTES_PER_S,
          "measured_copy_bytes_per_s": copy_bps, "measured_copy_source": copy_source},
      rows=rows, unsupported=unsupported, failures=failures)
  path = common.write_json(out / "mosaic_gpu_compile_report.json", result)
  headers = ["case", "grid", "stages", "threads", "smem B", "regs", "spill B", "occupancy",
             "wave eff", "model us (4.8 TB/s)", "model us (copy bw)", "temp MiB"]
  print(common.table([[r["case"], "x".join(map(str, r["resolved"]["grid"])),
                       r["resolved"]["num_stages"], r["threads"], r["shared_memory"],
                       r["registers"], r["spill_bytes"], r["occupancy"], r["wave_efficiency"],
                       round(r["modelled_us_at_hbm_spec"], 1),
                       round(r.get("modelled_us_at_measured_copy") or float("nan"), 1),
                       round(r["temp_bytes"] / 2**20, 2)] for r in rows], headers=headers))
  for u in unsupported:
    print(f"unsupported (Triton path) {u['case']}: {u['reason']}")
  print(f"mosaic_gpu: {len(rows)} compiled, {len(failures)} failed, "
        f"{sum(bool(r['spill_bytes']) for r in rows)} with spills -> {path}")


def main(flag_values, out):
  # pylint: disable=g-import-not-at-top
  from pallas_kernels.deviceless import target as compile_target
  from pallas_kernels.deviceless import mosaic_configs as mcc
  backends = list(flag_values.backends)
  unknown = sorted(set(backends) - set(BACKENDS))
  if unknown or not backends:
    raise ValueError(f"--backends: unknown {unknown} (choose from {list(BACKENDS)})")
  reason = compile_target.unavailable_reason()
  if reason is not None:
    raise ValueError(reason)
  skipped = {}
  if "mosaic_gpu" in backends and (why := mcc.unavailable_reason()) is not None:
    if backends == ["mosaic_gpu"]:
      raise ValueError(f"mosaic_gpu: {why}")
    skipped["mosaic_gpu"] = why
    print(f"mosaic_gpu: skipped: {why}")
  if "triton" in backends:
    _triton(flag_values, out, skipped)
  if "mosaic_gpu" in backends and not skipped:
    _mosaic(flag_values, out)


if __name__ == "__main__":
  common.run_app(main, Config)
