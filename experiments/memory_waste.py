r"""Where the KV memory goes: paged blocks vs Orca's contiguous reservations (paper Fig. 2).

    python -m experiments.memory_waste --workload=sharegpt --num_requests=2000 \
        --block_size=16 --kv_budget_tokens=14336 --out=results/memory_waste

Serves one seeded synthetic stream (`paged_jax.bench.workloads`) with four allocators
under the same KV budget of `T = kv_budget_tokens` token slots, in a saturated
continuous-batching simulation (`paged_jax.bench.baselines.simulate`: all requests
queued at step 0, FCFS admission, one token per running request per step):

  paged        vLLM: the real `paged_jax.block_manager`, blocks on demand
  orca_max     Orca(Max): reserves max_len slots per request
  orca_pow2    Orca(Pow2): reserves the next power of two of prompt + output
  orca_oracle  Orca(Oracle): reserves exactly prompt + output

Writes `DIR/memory_waste.json` = {"paged": {...}, "orca_max": {...},
"orca_pow2": {...}, "orca_oracle": {...}}. Each entry's `token_utilization`,
`reservation`, `internal_fragmentation`, `external_fragmentation` and `free` are
fractions of the KV budget that partition it (they sum to 1): slot-steps
in each category over the saturated steps (a request still waiting after
admission) divided by T * steps; see `paged_jax.bench.memory` for the exact
definitions. `max_concurrent` is the peak number of requests in memory at once,
`mean_concurrent` the mean over the saturated steps; also `steps`,
`saturated_steps`, `preemptions`. `DIR/memory_waste_meta.json` holds the flags,
versions, machine and the paper's numbers; `DIR/memory_waste.png` the stacked bars.
A bad flag value ends with one line `error: ...` and exit status 1.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import workloads
from paged_jax.bench.baselines import simulate
from paged_jax.bench.memory import CATEGORIES

ALLOCATORS = ("orca_max", "orca_pow2", "orca_oracle", "paged")
LABELS = {"orca_max": "Orca (Max)", "orca_pow2": "Orca (Pow2)",
          "orca_oracle": "Orca (Oracle)", "paged": "vLLM (paged)"}
# KV memory holding token states, vLLM paper Fig. 2 (OPT-13B, A100, ShareGPT-like traces).
PAPER_TOKEN_STATES = {"orca_max": 0.204, "orca_pow2": 0.268, "orca_oracle": 0.382,
                      "paged": 0.963}



@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.memory_waste."""
  workload: str = configs.flag("sharegpt", "synthetic request stream",
                               choices=("sharegpt", "alpaca"))
  num_requests: int = configs.flag(500, "requests in the stream", lower=1)
  block_size: int = configs.flag(16, "tokens per KV block (paged; a power of two)", lower=1,
                                 upper=1024)
  kv_budget_tokens: int = configs.flag(
      14336, "KV budget in token slots, the same for every allocator (default: about "
      "OPT-13B's ~12 GB of KV on one A100-40GB at 800 KB/token)", lower=1)
  max_len: int = configs.flag(2048, "context limit (Orca(Max) reservation)", lower=2)
  seed: int = configs.flag(0, "workload seed")
  watermark: float = configs.flag(0.01, "fraction of blocks paged admission keeps free",
                                  lower=0.0, upper=1.0, upper_open=True)
  out: str = configs.flag("results/memory_waste", "output directory")

  def check(self) -> None:
    """ValueError naming the flag for values the simulation cannot take."""
    if self.block_size & (self.block_size - 1):
      raise ValueError(f"--block_size must be a power of two in [1, 1024], got {self.block_size}")
    configs.check_multiple(self, "kv_budget_tokens", "block_size")
    if self.kv_budget_tokens < self.max_len:
      raise ValueError(f"--kv_budget_tokens must be >= --max_len={self.max_len}, got "
                       f"{self.kv_budget_tokens}")


def run(f: Optional[Config] = None, *, show_progress: Optional[bool] = None
        ) -> Dict[str, Dict]:
  """The four allocators' memory summaries for the stream of settings `f` (default
  `Config()`): the JSON's content, {allocator: summary}."""
  f = f or Config()
  requests = workloads.synthetic(f.workload, f.num_requests, seed=f.seed, max_len=f.max_len)
  bar = lambda name: common.progress(total=len(requests), desc=name,
                                     disable=None if show_progress is None else not show_progress)
  return simulate.simulate_allocators(requests, ALLOCATORS, block_size=f.block_size,
                                      kv_budget_tokens=f.kv_budget_tokens, max_len=f.max_len,
                                      watermark=f.watermark, progress=bar)


def summary_table(results: Dict[str, Dict]) -> str:
  rows = []
  for name in ALLOCATORS:
    r = results[name]
    rows.append([LABELS[name], f"{100 * r['token_utilization']:.1f}%",
                 f"{100 * PAPER_TOKEN_STATES[name]:.1f}%", f"{100 * r['reservation']:.1f}%",
                 f"{100 * r['internal_fragmentation']:.1f}%",
                 f"{100 * r['external_fragmentation']:.1f}%", f"{100 * r['free']:.1f}%",
                 r["max_concurrent"], f"{r['mean_concurrent']:.1f}", r["preemptions"]])
  return common.table(rows, ["allocator", "token states", "paper", "reserved", "internal frag",
                             "external frag", "free", "max conc", "mean conc", "preempt"])


def plot(results: Dict[str, Dict], path, title: str):
  """Stacked bars of the partition per allocator (the paper's Figure 2)."""
  plt = common.pyplot()
  colors = {"token_utilization": "#4c9a2a", "reservation": "#f2c14e",
            "internal_fragmentation": "#e07a5f", "external_fragmentation": "#8d99ae",
            "free": "#e5e5e5"}
  names = {"token_utilization": "token states", "reservation": "reserved (future tokens)",
           "internal_fragmentation": "internal fragmentation",
           "external_fragmentation": "external fragmentation", "free": "free"}
  fig, ax = plt.subplots(figsize=(7, 4))
  xs = range(len(ALLOCATORS))
  bottom = [0.0] * len(ALLOCATORS)
  for cat in CATEGORIES:
    vals = [100 * results[a][cat] for a in ALLOCATORS]
    ax.bar(xs, vals, bottom=bottom, color=colors[cat], label=names[cat], edgecolor="white")
    bottom = [b + v for b, v in zip(bottom, vals)]
  for x, a in zip(xs, ALLOCATORS):
    ax.text(x, 100 * results[a]["token_utilization"] / 2, f"{100 * results[a]['token_utilization']:.1f}%",
            ha="center", va="center", fontsize=9, color="white", fontweight="bold")
  for x, a in zip(xs, ALLOCATORS):   # the paper's token-state share, for comparison
    ax.plot([x - 0.4, x + 0.4], [100 * PAPER_TOKEN_STATES[a]] * 2, color="black", ls="--",
            lw=1, label="paper: token states" if x == 0 else None)
  ax.set_xticks(list(xs), [LABELS[a] for a in ALLOCATORS])
  ax.set_ylabel("KV cache memory (%)")
  ax.set_ylim(0, 100)
  ax.set_title(title, fontsize=10)
  ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
  return common.save_png(fig, path)


def main(f: Config, out):
  """Runs the experiment with settings `f` into directory `out` (the `common.run_app` main)."""
  start = time.time()
  results = run(f)
  seconds = time.time() - start
  common.write_json(out / "memory_waste.json", results)
  meta = provenance.run_metadata(f)
  meta.update(seconds=round(seconds, 2), paper_token_states=PAPER_TOKEN_STATES,
              partition=list(CATEGORIES))
  common.write_json(out / "memory_waste_meta.json", meta)
  png = plot(results, out / "memory_waste.png",
             f"{f.workload}-like, {f.num_requests} requests, KV budget "
             f"{f.kv_budget_tokens} tokens, block size {f.block_size}")
  print(f"memory_waste: {f.workload}-like stream, {f.num_requests} requests, "
        f"T={f.kv_budget_tokens} slots, block_size={f.block_size} ({seconds:.1f} s)")
  print(summary_table(results))
  for name in ALLOCATORS:
    if results[name]["averaged_over"] != "saturated":
      print(f"note: {LABELS[name]} was never memory-bound (no request ever waited), so its "
            "fractions average all steps; raise --num_requests to saturate it")
  print(f"wrote {out / 'memory_waste.json'}, {png}")


if __name__ == "__main__":
  common.run_app(main, Config)
