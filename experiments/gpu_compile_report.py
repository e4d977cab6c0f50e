r"""What XLA's GPU compiler makes of every kernel configuration, for an H200 that is not here.

    python -m experiments.gpu_compile_report --out=experiments/results/gpu_compile_report
    python -m experiments.gpu_compile_report --cases=full --out=DIR     # the slow grid

Compiles each case of pallas_kernels/compile_configs.py for a compile-only sm_90 device
(pallas_kernels/compile_target.py: XLA's own Triton -> PTX -> SASS pipeline on this CPU
host, ptxas for registers) and records per kernel launch: grid, warps, pipeline stages,
shared memory, registers, spill bytes, occupancy (resident threads per SM over 2048),
resident blocks and wave efficiency (busy fraction of the SM slots over the waves the grid
takes), plus XLA's temp bytes and a modelled bandwidth bound: the K/V bytes the kernel
must read over H200's 4.8 TB/s. Nothing runs: achieved bandwidth needs a GPU
(experiments/gpu_check.sh). Spills are reported, not fatal (the test suite fails on them).
Writes DIR/gpu_compile_report.json and prints a table.
"""

from __future__ import annotations

import time

from absl import flags
import jax

from experiments import common


def _define_flags():
  flags.DEFINE_string("out", "results/gpu_compile_report", "output directory")
  flags.DEFINE_enum("cases", "default", ["default", "full"],
                    "default: the ~16 representative configs; full: the slow test grid")
  flags.DEFINE_string("only", "", "substring filter on case names (empty: all)")


def _row_cells(row):
  cells = []
  for l in row["launches"]:
    cells.append([row["case"], l["kernel"].split("_", 2)[-1], "x".join(map(str, l["grid"])),
                  l["warps"], l["stages"], l["shared_memory"], l["registers"],
                  l["spill_bytes"], l["occupancy"], l["wave_efficiency"],
                  round(row["modelled_time_us"], 1), round(row["temp_bytes"] / 2**20, 2)])
  return cells


def main(flag_values, out):
  from pallas_kernels import compile_configs  # pylint: disable=g-import-not-at-top
  from pallas_kernels import compile_target  # pylint: disable=g-import-not-at-top
  reason = compile_target.unavailable_reason()
  if reason is not None:
    raise ValueError(reason)
  cases = (compile_configs.default_cases() if flag_values.cases == "default"
           else compile_configs.full_cases())
  cases = [c for c in cases if flag_values.only in c.name]
  rows, failures = [], []
  for case in common.progress(cases, desc="compiles"):
    t0 = time.perf_counter()
    try:
      row = compile_configs.measure(case, fail_on_spill=False)
    except Exception as e:  # pylint: disable=broad-except
      failures.append({"case": case.name, "error": common.one_line(e)[:500]})
      continue
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    rows.append(row)
  result = dict(common.run_metadata(flag_values),
                target={"device": "NVIDIA H200 (compile-only, sm_90)",
                        "shared_memory_per_block_optin": compile_target.SM90_SHARED_MEMORY_BYTES,
                        "registers_per_sm": compile_target.SM90_REGISTERS_PER_SM,
                        "hbm_bytes_per_s": compile_target.H200_HBM_BYTES_PER_S,
                        "ptxas": compile_target.ptxas_path(),
                        "jax": jax.__version__},
                rows=rows, failures=failures)
  path = common.write_json(out / "gpu_compile_report.json", result)
  headers = ["case", "launch", "grid", "warps", "stages", "smem B", "regs", "spill B",
             "occupancy", "wave eff", "model us", "temp MiB"]
  print(common.table([c for r in rows for c in _row_cells(r)], headers=headers, digits=3))
  for f in failures:
    print(f"FAILED {f['case']}: {f['error']}")
  print(f"{len(rows)} compiled, {len(failures)} failed, "
        f"{sum(bool(r['spilled']) for r in rows)} with spills -> {path}")


if __name__ == "__main__":
  common.run_app(main, _define_flags)
