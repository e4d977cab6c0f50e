r"""Recompute vs swap preemption by block size (paper Sec. 7.3, Fig. 19).

    python -m experiments.preemption --block_sizes=8,16,32,64 --num_requests=24 \
        --kv_budget_tokens=512 --seq_len=200 --out=results/preemption

Two measurements per block size, side by side in one run, on the shipped tiny model:

  (a) time per preemption (Fig. 19a; `bench.step_costs.time_per_preemption`): one
      sequence of --seq_len tokens. swap =
      `engine.swap.swap_out` (its blocks to host memory) + free + `swap_in`
      (fresh blocks, pages scattered back); recompute = one engine prefill step
      of the same --seq_len tokens (what a recomputed sequence pays on return).
      Fastest of --repeats, after compiling.
  (b) end to end under memory pressure (Fig. 19b): the scaled ShareGPT-like
      stream (`serving`) served by the engine with a KV pool of only
      --kv_budget_tokens slots, preemption_mode recompute and swap: mean / p90
      request latency (finish time, all arriving at 0), tokens/s, preemptions.

On a GPU, swap crosses PCIe and small blocks mean many small copies (the paper's
reason swap loses at small block sizes); here "host memory" is the same DRAM, so
swap is a gather + device_get. Writes `DIR/preemption.json` and `DIR/preemption.png`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import engines
from paged_jax.bench import serving
from paged_jax.bench import step_costs
from paged_jax.bench import workloads
from paged_jax.bench.scale import TINY

MODES = ("recompute", "swap")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.preemption."""
  block_sizes: Tuple[int, ...] = configs.flag((8, 16, 32, 64), "block sizes", lower=1)
  num_requests: int = configs.flag(24, "requests of the end-to-end stream", lower=1)
  kv_budget_tokens: int = configs.flag(512, "KV pool (slots): small, to force preemption",
                                       lower=1)
  seq_len: int = configs.flag(200, "tokens of the preempted sequence in (a)", lower=1)
  repeats: int = configs.flag(5, "timed repeats in (a) (fastest kept)", lower=1)
  seed: int = configs.flag(0, "stream seed")
  out: str = configs.flag("results/preemption", "output directory")


def run(f: Optional[Config] = None, *, show_progress=None) -> list:
  """One row per block size: (a) time per preemption, (b) end-to-end per mode."""
  f = f or Config()
  requests = workloads.scaled_requests("sharegpt", f.num_requests, seed=f.seed)
  seq_len = min(f.seq_len, TINY.max_len - 1)
  rows = []
  for bs in common.progress(f.block_sizes, desc="block sizes",
                            disable=None if show_progress is None else not show_progress):
    row = {"block_size": bs}
    row.update(step_costs.time_per_preemption(bs, seq_len=seq_len, repeats=f.repeats,
                                              kv_budget_tokens=f.kv_budget_tokens,
                                              seed=f.seed))
    for mode in MODES:
      engine = engines.make_engine(block_size=bs, kv_budget_tokens=f.kv_budget_tokens,
                                   preemption_mode=mode)
      res = serving.serve(engine, requests)
      for key in ("mean_latency_s", "p90_latency_s", "tokens_per_s", "preemptions", "swaps",
                  "seconds"):
        row[f"{mode}_{key}"] = res[key]
    rows.append(row)
  return rows


HEADERS = ["block", "swap ms (out+in)", "recompute ms", "swap/recompute", "recompute latency s",
           "swap latency s", "recompute tok/s", "swap tok/s", "preempt (rec/swap)"]


def summary_rows(rows):
  return [[r["block_size"], f"{r['swap_ms']:.2f}", f"{r['recompute_ms']:.2f}",
           f"{r['swap_ms'] / r['recompute_ms']:.2f}x", f"{r['recompute_mean_latency_s']:.2f}",
           f"{r['swap_mean_latency_s']:.2f}", f"{r['recompute_tokens_per_s']:.0f}",
           f"{r['swap_tokens_per_s']:.0f}",
           f"{r['recompute_preemptions']}/{r['swap_preemptions']}"] for r in rows]


def plot(rows, path, seq_len: int):
  plt = common.pyplot()
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
  bs = [r["block_size"] for r in rows]
  ax1.plot(bs, [r["swap_out_ms"] for r in rows], "o-", label="swap out")
  ax1.plot(bs, [r["swap_in_ms"] for r in rows], "o-", label="swap in")
  ax1.plot(bs, [r["swap_ms"] for r in rows], "o-", label="swap in + out")
  ax1.plot(bs, [r["recompute_ms"] for r in rows], "s--", label="recompute (prefill)")
  ax1.set_title(f"(a) time per preemption, {seq_len}-token sequence", fontsize=9)
  ax1.set_ylabel("ms")
  for mode, marker in (("recompute", "s--"), ("swap", "o-")):
    ax2.plot(bs, [r[f"{mode}_mean_latency_s"] for r in rows], marker, label=mode)
  ax2.set_title("(b) mean request latency under memory pressure", fontsize=9)
  ax2.set_ylabel("s")
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.legend(fontsize=8, frameon=False)
  return common.save_png(fig, path)


def main(f: Config, out):
  """Runs with settings `f` and writes under the output directory `out`."""
  start = time.time()
  rows = run(f)
  common.write_json(out / "preemption.json", {
      "rows": rows, "seconds": time.time() - start,
      **provenance.run_metadata(f, ("block_sizes", "num_requests", "kv_budget_tokens",
                                    "seq_len", "repeats", "seed"))})
  png = plot(rows, out / "preemption.png", f.seq_len)
  print(common.table(summary_rows(rows), HEADERS))
  print(f"wrote {out / 'preemption.json'}, {png}")


if __name__ == "__main__":
  common.run_app(main, Config)
