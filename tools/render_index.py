"""The claims index of the docs: one row per claim, every figure read from a committed JSON."""

from __future__ import annotations

import os
from typing import List

from render_common import cell, load, median_ms, pct, ratio, table
from render_engine import rate_ratio, serving_runs


def index_rows(results_dir: str) -> List[list]:
  get = lambda rel: load(results_dir, rel)
  rows = []
  mw = get("memory_waste/memory_waste.json")
  order = ("paged", "orca_oracle", "orca_pow2", "orca_max")
  rows.append(["KV memory holding tokens: paged / Orca Oracle / Pow2 / Max",
               " / ".join(pct(mw[k]["token_utilization"]) for k in order),
               "96.3% / 38.2% / 26.8% / 20.4%", "memory_waste/", "`experiments.memory_waste`"])
  real_path = os.path.join(results_dir, "serving_benchmark", "sharegpt_real_table1.json")
  if os.path.exists(real_path):
    real = get("serving_benchmark/sharegpt_real_table1.json")
    t1 = real["table1"]
    rmw = real["memory_waste_1000_requests_kv14336_block16"]["sharegpt-real"]
    rows.append([f"real ShareGPT trace ({t1['tokenizer'].split()[0]}): mean in / out tokens; "
                 "KV holding tokens as above",
                 f"{t1['mean_input']:.1f} / {t1['mean_output']:.1f}; "
                 + " / ".join(pct(rmw[k]["token_utilization"]) for k in order),
                 f"{t1['paper_mean_input']} / {t1['paper_mean_output']}; as above",
                 "serving_benchmark/", "`command` of its JSON"])
  conc = lambda k: mw["paged"]["mean_concurrent"] / mw[k]["mean_concurrent"]
  rows.append(["concurrent requests, paged over Orca Oracle; Max",
               f"{conc('orca_oracle'):.2f}x; {conc('orca_max'):.2f}x", "2.2x; 4.3x",
               "memory_waste/", "`experiments.memory_waste`"])
  tp = get("throughput/throughput.json")["results"]
  rows.append(["tokens per step, paged over Orca Max (ShareGPT; Alpaca)",
               "; ".join(f"{tp[w]['speedup_tokens_per_step']:.2f}x" for w in ("sharegpt", "alpaca")),
               "2-4x (throughput, Fig. 12)", "throughput/", "`experiments.demo`"])
  sh = get("sharing/sharing.json")["rows"]
  for mode in ("parallel", "beam"):
    ours, paper = [], []
    for w in ("sharegpt", "alpaca"):
      rs = [r for r in sh if r["workload"] == w and r["mode"] == mode]
      ours.append(f"{pct(min(r['savings'] for r in rs))}-{pct(max(r['savings'] for r in rs))}")
      paper.append("-".join(pct(x) for x in rs[0]["paper_savings"]))
    rows.append([f"blocks saved, {mode} width 2-6 (ShareGPT; Alpaca)", "; ".join(ours),
                 "; ".join(paper), "sharing/", "`experiments.demo`"])
  pc = {r["workload"]: r for r in get("prefix_caching/prefix_caching.json")["serving"]}
  shots = [k for k in pc if pc[k]["paper_ratio"]]
  rows.append(["prefix caching on over off (" + ", ".join(shots) + ")",
               "; ".join(f"{pc[k]['throughput_ratio']:.2f}x" for k in shots),
               "; ".join(f"{pc[k]['paper_ratio']}x" for k in shots), "prefix_caching/",
               "`experiments.prefix_caching`"])
  runs, ours, paper = [], [], {}   # one row: every serving run, in name order
  for run, doc in serving_runs(results_dir):
    runs.append(run)
    ours.append(", ".join(rate_ratio(doc, k) or "-" for k in ("orca_max", "orca_oracle")))
    sharegpt = doc["flags"]["workload"].startswith("sharegpt")
    paper["sharegpt" if sharegpt else "alpaca"] = "2.7-8x, 1.7-2.7x" if sharegpt else "2-4x"
  rows.append(["max req/s at SLO, paged over Orca Max, Oracle: " + "; ".join(runs),
               "; ".join(ours), "; ".join(f"{v} ({k})" for k, v in paper.items()),
               "serving_benchmark/<run>/", "`experiments.serving_benchmark`"])
  best = get("block_size_sweep/block_size_sweep_best.json")
  rows.append(["best block size (ShareGPT; Alpaca)",
               "; ".join(f"{best[w]['best']}" for w in ("sharegpt", "alpaca")),
               "; ".join("-".join(map(str, best[w]["paper"])) for w in ("sharegpt", "alpaca")),
               "block_size_sweep/", "`experiments.demo`"])
  kb = get("gpu_check_h200/kernel_bench.json")
  at = [r for r in kb["results"] if r.get("batch") == 64 and r.get("context") == 4096
        and r.get("block_size") == 16 and "timings" in r]
  if at:
    t = at[0]["timings"]
    ours = median_ms(t, "kernel_paged")
    rows.append(["H200 decode, B=64 ctx 4096 bs 16: of copy bandwidth; JAX's paged op / "
                 "ours (time); paged / contiguous",
                 f"{cell(t['kernel_paged']['fraction_of_copy_bw'])}; "
                 f"{cell(ratio(median_ms(t, 'jax_paged'), ours))}x; "
                 f"{cell(ratio(ours, median_ms(t, 'kernel_contiguous')))}",
                 "-; -; 1.20-1.26", "gpu_check_h200/", "`experiments/gpu_check.sh`"])
  gc = get("gpu_compile_report/gpu_compile_report.json")
  mg = get("gpu_compile_report/mosaic_gpu_compile_report.json")
  rows.append(["sm_90 configs compiled, not run (Triton; Mosaic GPU): failed, spilled, max smem",
               f"{len(gc['rows'])}: {len(gc['failures'])}, "
               f"{sum(1 for r in gc['rows'] if r['spilled'])}, "
               f"{max(r['max_shared_memory'] for r in gc['rows']):,} B; "
               f"{len(mg['rows'])}: {len(mg['failures'])}, "
               f"{sum(1 for r in mg['rows'] if r['spill_bytes'])}, "
               f"{max(r['shared_memory'] for r in mg['rows']):,} B "
               f"(of {gc['target']['shared_memory_per_block_optin']:,})",
               "-", "gpu_compile_report/", "`experiments.gpu_compile_report`"])
  hf = get("hf_peer/hf_peer.json")
  hf128 = get("hf_peer/batch128/hf_peer.json")
  rows.append(["tokens/s over transformers (32; 128 prompts, steady)",
               f"{hf['modes']['steady']['ratio_tokens_per_s']:.2f}x; "
               f"{hf128['modes']['steady']['ratio_tokens_per_s']:.2f}x", "-", "hf_peer/",
               "`experiments.hf_peer_bench`"])
  k1, k8 = get("hf_peer/random25m_k1/hf_peer.json"), get("hf_peer/random25m_k8/hf_peer.json")
  rows.append(["25M-param random model: tokens/s over transformers, steady (1; 8 steps/sync)"
               " and the bounds (compute floor; our kernels perfectly batched)",
               f"{k1['modes']['steady']['ratio_tokens_per_s']:.2f}x; "
               f"{k8['modes']['steady']['ratio_tokens_per_s']:.2f}x (bound "
               f"{k1['compute_floor']['max_ratio_over_transformers']:.1f}x; at our kernels "
               f"{k1['compute_floor']['max_ratio_at_kernels']:.1f}x)", "-",
               "hf_peer/random25m_k*/", "`experiments.hf_peer_bench --random_hidden_size=512`"])
  return rows


def index(results_dir: str) -> str:
  """The index table; the command is named only where it is not `experiments.<dir>` of the
  results directory (to keep the docs small)."""
  rows = []
  for claim, ours, paper, where, command in index_rows(results_dir):
    implied = command == f"`experiments.{where.split('/')[0]}`"
    rows.append([claim, ours, paper, where if implied else f"{where} {command}"])
  return table(rows, ["claim", "ours", "paper", "results/ (command: `experiments.<dir>` "
                                                "unless named)"])
