r"""What libtpu's compiler makes of the TPU kernels, for a v5e / v6e that is not here.

    /work/venvs/tpu/bin/python -m experiments.tpu_compile_report --cases=report \
        --out=experiments/results/tpu_compile_report --compilation_cache=none   # 24 configs
    python -m experiments.tpu_compile_report --out=DIR      # the tests' 4 default configs
    python -m experiments.tpu_compile_report --cases=full --out=DIR   # the 100-config grid

Compiles each configuration (pallas_kernels/tpu/compile_configs.py) for a compile-only TPU
(pallas_kernels/tpu/compile_target.py) three times: our kernel; JAX's own ragged paged
attention on the same shape with its tuned block sizes for that chip (what a user of it
gets); and JAX's RPA with our tile sizes (the same K/V tokens and queries per step, so
VMEM compares like for like). Per kernel: VMEM used (Mosaic's used scoped memory) and the
scope it was compiled under, HBM arguments / outputs / temporaries, the largest buffer the
module allocates, and a *modelled* time: the K/V bytes the call must read over the chip's
HBM bandwidth (nothing runs: achieved bandwidth needs a TPU, experiments/tpu_check.sh).
JAX's RPA is first compiled under the chip's default VMEM scope; where its blocks do not
fit there it is retried with 64 MiB, and both outcomes are recorded.

Writes DIR/tpu_compile_report.json (flags, versions, machine, rows, failures, and per case
the VMEM ratio ours / JAX's with the reason where ours is larger) and prints a table.
Needs libtpu (requirements-compile.txt); without it the run ends with a one-line error.
"""

from __future__ import annotations

import dataclasses

import jax

from experiments import common
from experiments import configs

# Why our VMEM can exceed JAX's at the same tiles (filled in per row by _vmem_reason).
REASONS = {
    "scale_rows": "int8/fp8: our per-token scale rows (2 x 2 x heads x pages x 128 lanes "
                  "f32) and the lane-vector scratch; JAX's RPA takes one scalar k/v scale",
    "decode_rows": "decode: each sequence's G query rows padded to a 16-row bf16 tile in "
                   "the [seqs, heads, G, D] query / output blocks",
}


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.tpu_compile_report."""
  out: str = configs.flag("results/tpu_compile_report", "output directory")
  cases: str = configs.flag("default", "default: the tests' 4 configs; report: 24 (each chip x "
                            "kernel x model x block 16/64, plus int8 / fp8 and 256 x 8K); "
                            "full: the 100-config grid", choices=("default", "report", "full"))
  only: str = configs.flag("", "substring filter on case names (empty: all)")
  with_jax: bool = configs.flag(True, "also compile JAX's RPA on each shape")


def _vmem_reason(row):
  ours = row["ours"]["vmem_bytes"]
  theirs = (row.get("jax_rpa_matched") or {}).get("vmem_bytes")
  if not theirs or ours <= theirs:
    return None
  reasons = []
  if row["page_dtype"] != "bfloat16":
    reasons.append(REASONS["scale_rows"])
  if row["kernel"] == "decode":
    reasons.append(REASONS["decode_rows"])
  return "; ".join(reasons) or "not explained: investigate"


def _libtpu_version():
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return None


def _cells(row):
  def vm(k):
    r = row.get(k) or {}
    return common.mib(r.get("vmem_bytes")) if "vmem_bytes" in r else ("fail" if r else "-")
  return [row["case"], common.mib(row["ours"]["vmem_bytes"]), vm("jax_rpa"),
          vm("jax_rpa_matched"), common.mib(row["ours"]["temp_bytes"]),
          common.mib(row["ours"]["largest_buffer_bytes"]),
          round(row["pool_bytes"] / 2**30, 2), round(row["modelled_time_us"], 1)]


def main(config, out):
  from pallas_kernels.tpu import compile_configs as cc  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tpu import compile_target as ct  # pylint: disable=g-import-not-at-top
  reason = ct.unavailable_reason()
  if reason is not None:
    raise ValueError(reason)
  cases = {"default": cc.default_cases, "report": cc.report_cases,
           "full": cc.full_cases}[config.cases]()
  cases = [c for c in cases if config.only in c.name]
  if not cases:
    raise ValueError(f"--only={config.only!r} matches no case")
  rows, failures = common.compile_each(cases, lambda c: cc.measure(c, with_jax=config.with_jax))
  for row in rows:
    matched = (row.get("jax_rpa_matched") or {}).get("vmem_bytes")
    row["vmem_ours_over_jax_matched"] = (round(row["ours"]["vmem_bytes"] / matched, 3)
                                         if matched else None)
    row["vmem_reason"] = _vmem_reason(row)
  result = dict(common.run_metadata(config),
                target={"chips": sorted({c.chip for c in cases}), "jax": jax.__version__,
                        "libtpu": _libtpu_version(),
                        "hbm_bytes_per_s": ct.HBM_BYTES_PER_S,
                        "default_scoped_vmem_bytes": ct.DEFAULT_SCOPED_VMEM_BYTES,
                        "jax_rpa_retry_vmem_bytes": cc.JAX_RPA_RETRY_VMEM_BYTES},
                bandwidth_model={"modelled": True,
                                 "what": "K/V bytes (scales included) one call must read at "
                                         "full context, over the chip's spec HBM bandwidth"},
                rows=rows, failures=failures)
  path = common.write_json(out / "tpu_compile_report.json", result)
  print(common.table([_cells(r) for r in rows],
                     headers=["case", "ours VMEM MiB", "JAX tuned MiB", "JAX same tiles MiB",
                              "ours temp MiB", "largest buf MiB", "pool GiB", "model us"]))
  over = [r for r in rows if r["vmem_reason"]]
  for r in over:
    print(f"VMEM above JAX's (same tiles) {r['case']}: {r['vmem_reason']}")
  print(f"{len(rows)} compiled, {len(failures)} failed, {len(over)} above JAX's VMEM "
        f"-> {path}")


if __name__ == "__main__":
  common.run_app(main, Config)
