"""Renderers of the GPU results for tools/render_results.py: the H200 run of
experiments/gpu_check.sh (gpu_check_h200/) and the deviceless sm_90 compile reports
(gpu_compile_report/: Triton and Mosaic GPU)."""

from __future__ import annotations

import re
from typing import Dict, List

from render_common import cell, median_ms, ratio, table


def gpu_kernel(doc) -> str:
  """kernel_bench.json of a GPU run: the decode kernel per (batch, context, block size)."""
  rows = []
  for r in doc["results"]:
    if "timings" not in r:
      continue
    t = r["timings"]
    ours = median_ms(t, "kernel_paged")
    rows.append([r["batch"], r["context"], r["block_size"], f"{ours:.3f}",
                 f"{t['kernel_paged']['GBps']:.0f}",
                 cell(t["kernel_paged"].get("fraction_of_copy_bw")),
                 cell(ratio(ours, median_ms(t, "kernel_contiguous"))),
                 cell(ratio(median_ms(t, "jax_paged"), ours)),
                 cell(ratio(median_ms(t, "dense"), ours))])
  return table(rows, ["batch", "context", "block", "paged ms", "GB/s", "of copy bw",
                       "paged/contig", "JAX paged op/ours", "dense/ours"])


def gpu_ragged(doc) -> str:
  """ragged_bench.json of a GPU run: the ragged (prefill + decode) kernel per scenario."""
  rows = []
  for r in doc["results"]:
    if "error" in r:
      rows.append([r["scenario"], r["block_size"], "error", "-", "-", "-", "-", "-", "-"])
      continue
    t = r["timings"]
    ours = median_ms(t, "ragged_paged")
    p = t["ragged_paged"]
    rows.append([r["scenario"], r["block_size"], f"{ours:.3f}", f"{p['GBps']:.0f}",
                 cell(p.get("fraction_of_copy_bw")), f"{p['TFLOPs']:.1f}",
                 cell(ratio(ours, median_ms(t, "ragged_contiguous"))),
                 cell(ratio(median_ms(t, "dense"), ours)),
                 cell(ratio(median_ms(t, "decode_kernel"), ours))])
  return table(rows, ["scenario", "block", "ms", "GB/s", "of copy bw", "TFLOP/s",
                       "paged/contig", "dense/ours", "decode kernel/ours"])


def gpu_env(text: str) -> str:
  """env.txt (+ summary.txt, tests.log beside it) of a gpu_check.sh run."""
  lines = [l.strip() for l in text.splitlines()]
  gpu_header = next(i for i, l in enumerate(lines) if l.startswith("name, memory.total"))
  gpu = dict(zip([h.strip() for h in lines[gpu_header].split(",")],
                 [v.strip() for v in lines[gpu_header + 1].split(",")]))
  jax_line = next(l for l in lines if l.startswith("jax "))
  python = next(l for l in lines if re.match(r"\d+\.\d+\.\d+ ", l)).split()[0]
  rows = [["date", " ".join(lines[0].split())], ["commit", lines[1][:12]],
          ["device", f"{gpu['name']}, {gpu['memory.total [MiB]']}, driver {gpu['driver_version']}"],
          ["software", f"Python {python}, {jax_line}"]]
  return table(rows, ["", "H200 run (experiments/gpu_check.sh)"])


def gpu_steps(doc) -> str:
  """summary.txt (step, status, rc, time) and the pytest summary line of tests.log."""
  tail = [l.strip("= ") for l in doc["tests"].splitlines()
          if re.search(r"\d+ (passed|failed)", l)]
  failed: Dict[str, List[str]] = {}   # test -> parameter ids
  for l in doc["tests"].splitlines():
    if l.startswith("FAILED "):
      m = re.match(r"(?P<test>[^\[\s]+)(?:\[(?P<param>[^\]]*)\])?", l.split()[1].split("::")[-1])
      failed.setdefault(m["test"], []).extend([m["param"]] if m["param"] else [])
  detail = (tail[-1].split(" in ")[0] if tail else "") + "".join(
      f"; {t}" + (f"[{','.join(sorted(p))}]" if p else "") for t, p in failed.items())
  rows = []
  for line in doc["summary"].splitlines():
    if line.strip():
      name, status, rc, secs = line.split()
      rows.append([name, status, rc.split("=")[-1], secs, detail if name == "tests" else ""])
  return table(rows, ["step", "status", "rc", "time", "detail"])


_SHORT = ((":bfloat16", ":bf16"), ("float16", "f16"), ("float32", "f32"),
          ("float8_e4m3fn", "fp8"), ("xctx4096", "x4k"))


def _short(case: str) -> str:
  """A Triton case name in the Mosaic report's spelling (bf16, fp8, B64x4k)."""
  for long, short in _SHORT:
    case = case.replace(long, short)
  return case


def gpu_compile(doc) -> str:
  """One row per config: its launches' tiles, the largest shared memory and register count,
  total spill bytes, XLA's temp bytes and the modelled time (K/V bytes over HBM bandwidth)."""
  rows = []
  for r in doc["rows"]:
    ls = r["launches"]
    tiles = ", ".join(re.sub(r"^(paged_decode_|ragged_paged_attention_)(bs\d+_)?", "",
                             l["kernel"]) for l in ls)
    rows.append([_short(r["case"]), tiles, "/".join(sorted({f"{l['warps']}w{l['stages']}s" for l in ls})),
                 f"{max(l['shared_memory'] for l in ls) / 1024:.0f}",
                 max(l["registers"] for l in ls), sum(l["spill_bytes"] for l in ls),
                 f"{r['modelled_time_us']:.1f}", f"{r['temp_bytes'] / 2**20:.1f}"])
  for f in doc["failures"]:
    rows.append([_short(f["case"]), "FAILED: " + f["error"][:60], "", "", "", "", "", ""])
  return table(rows, ["case", "launches", "warps, stages", "smem KiB", "regs", "spill B",
                       "modelled us", "temp MiB"])


def _group_block_sizes(rows):
  """Rows equal but for the block size and registers merged: bs16/32/..., registers in the
  same order."""
  out, index = [], {}
  for row in rows:
    key = (re.sub(r":bs\d+:", ":bs:", row[0]), *row[2:])
    if key not in index:
      index[key] = len(out)
      out.append([row[0], [row[1]], *row[2:]])
      continue
    merged = out[index[key]]
    old = re.search(r":bs([\d/]+):", merged[0]).group(1)
    new = re.search(r":bs(\d+):", row[0]).group(1)
    merged[0] = merged[0].replace(f":bs{old}:", f":bs{old}/{new}:")
    merged[1].append(row[1])
  for row in out:
    row[1] = "/".join(map(str, row[1]))
  return out


def mosaic_compile(doc) -> str:
  """One row per Mosaic GPU config (block sizes of an otherwise equal row merged): ptxas
  registers and spill bytes, Mosaic's shared memory, resident blocks per SM (occupancy =
  blocks x threads / 2048) and the modelled time at H200's 4.8 TB/s. Grid, ring depth, wave
  efficiency, the time at the measured copy bandwidth and the configs the kernels refuse
  (with the reason) are in the JSON (the docs stay small)."""
  rows = [[r["case"], r["registers"], r["spill_bytes"], f"{r['shared_memory'] / 1024:.0f}",
           r["resident_blocks_per_sm"], f"{r['modelled_us_at_hbm_spec']:.1f}"]
          for r in doc["rows"]]
  rows = _group_block_sizes(rows)
  for f in doc["failures"]:
    rows.append([f["case"], "FAILED: " + f["error"][:60], "", "", "", ""])
  return table(rows, ["case", "regs", "spill B", "smem KiB", "blocks/SM", "modelled us"])
