r"""Automatic prefix caching: hit rates, prefill saved, memory, throughput (paper Sec. 6.4).

    python -m experiments.prefix_caching --system_prompt_lens=256,512 --num_requests=100 \
        --few_shot_requests=64 --block_size=16 --kv_budget_tokens=4096 --out=results/prefix_caching

(a) `num_requests` requests arrive at once, all starting with one random system
    prompt of each length in `system_prompt_lens` (256..896: the shipped tiny
    byte-level model has 1024 positions), followed by a ~30-token question and
    ~30 generated tokens; (b) the paper's few-shot translation prompts: a shared
    80-token (1-shot) and 341-token (5-shot) prefix (`workloads.shared_prefix`).
    For each, the same requests are served by `Engine` (caching off) and `Engine` with
    `enable_prefix_caching=True` (on), one after the other in one run, same KV budget,
    same model, greedy (`paged_jax.bench.prefix_serving.compare`); outputs must be
    identical. Reported: block hit rate,
    prefill tokens computed, peak / mean KV blocks held by running sequences,
    copies of the shared prefix cached, throughput (generated tokens/s) and its
    on/off ratio beside the paper's 1.67x (1-shot) and 3.58x (5-shot).
(c) hit rate against block size 1..256 (block-level, no model): pairs of
    prompts share a random-length common prefix and then differ; the second
    reuses only whole blocks of the first, so large blocks lose up to
    block_size - 1 shared tokens (`lost_tokens`; `bench.prefix_blocks`).
(d) cost of one lookup (per looked-up block) and of one eviction batch at
    num_blocks 1K..1M (`bench.prefix_blocks.lookup_cost`).

Writes DIR/prefix_caching.json and DIR/prefix_caching.png.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Dict, Optional, Tuple

import numpy as np

from experiments import common
from experiments import configs
from paged_jax.bench import prefix_blocks
from paged_jax.bench import prefix_serving

PAPER_SPEEDUP = {"1-shot": 1.67, "5-shot": 3.58}   # vLLM paper Fig. 16 (LLaMA-13B, translation)


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.prefix_caching."""
  system_prompt_lens: Tuple[int, ...] = configs.flag(
      (256, 512), "(a) system prompt lengths (1024-position model)", lower=1, upper=896)
  num_requests: int = configs.flag(100, "(a) requests per system prompt", lower=1)
  few_shot_requests: int = configs.flag(64, "(b) requests per few-shot prefix (0: skip)",
                                        lower=0)
  block_size: int = configs.flag(16, "tokens per KV block", lower=1)
  kv_budget_tokens: int = configs.flag(
      4096, "KV pool in token slots (small enough that memory bounds the batch without "
      "caching, as in the paper)", lower=1)
  max_seqs: int = configs.flag(64, "sequence slots", lower=1)
  max_num_batched_tokens: int = configs.flag(256, "tokens per step", lower=1)
  sweep_block_sizes: Tuple[int, ...] = configs.flag((1, 2, 4, 8, 16, 32, 64, 128, 256),
                                                    "(c) block sizes", lower=1)
  sweep_pairs: int = configs.flag(48, "(c) prompt pairs per block size", lower=1)
  lookup_num_blocks: Tuple[int, ...] = configs.flag(
      (1024, 16384, 262144, 1048576), "(d) pool sizes for the lookup / eviction cost",
      lower=128)
  seed: int = configs.flag(0, "workload seed")
  out: str = configs.flag("results/prefix_caching", "output directory")

  def check(self) -> None:
    configs.check_multiple(self, "kv_budget_tokens", "block_size")


def compare(name: str, prefix, requests, **engine_kw) -> Dict:
  """`prefix_serving.compare`'s row plus "paper_ratio" (Fig. 16's speed-up, if any)."""
  return dict(prefix_serving.compare(name, prefix, requests, **engine_kw),
              paper_ratio=PAPER_SPEEDUP.get(name))


def run(f: Optional[Config] = None) -> Dict:
  """(a)-(d) for settings `f` (default `Config()`): {"serving": rows, "block_size_sweep",
  "lookup_cost", "seconds", "flags"}."""
  f = f or Config()
  start = time.time()
  kw = dict(block_size=f.block_size, kv_budget_tokens=f.kv_budget_tokens, max_seqs=f.max_seqs,
            max_len=1024, budget=f.max_num_batched_tokens)
  jobs = [(f"system{n}", prefix_serving.system_prompt_requests(f.num_requests, n, f.seed))
          for n in f.system_prompt_lens]
  if f.few_shot_requests:
    jobs += [(f"{s}-shot", prefix_serving.few_shot_requests(f.few_shot_requests, s, f.seed))
             for s in (1, 5)]
  rows = []
  for name, (prefix, requests) in common.progress(jobs, desc="workloads"):
    rows.append(compare(name, prefix, requests, **kw))
    r = rows[-1]
    print(f"{name}: hit rate {r['hit_rate']:.3f}, prefill {r['prefill_tokens_off']} -> "
          f"{r['prefill_tokens_on']}, {r['throughput_ratio']:.2f}x", file=sys.stderr)
  sweep = prefix_blocks.hit_rate_by_block_size(f.sweep_block_sizes, num_pairs=f.sweep_pairs,
                                               seed=f.seed)
  cost = prefix_blocks.lookup_cost(f.lookup_num_blocks)
  return {"serving": rows, "block_size_sweep": sweep, "lookup_cost": cost,
          "seconds": time.time() - start,
          "flags": {k: v for k, v in f.flags().items() if k != "out"}}


def plot(result: Dict, path) -> str:
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  rows = result["serving"]
  names = [r["workload"] for r in rows]
  x = np.arange(len(rows))
  ax = axes[0]
  ax.bar(x - 0.2, [r["off"]["tokens_per_s"] for r in rows], 0.4, label="caching off")
  ax.bar(x + 0.2, [r["on"]["tokens_per_s"] for r in rows], 0.4, label="caching on")
  for i, r in enumerate(rows):
    label = f"{r['throughput_ratio']:.2f}x" + (f"\n(paper {r['paper_ratio']}x)"
                                              if r["paper_ratio"] else "")
    ax.annotate(label, (i + 0.2, r["on"]["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
  ax.set_xticks(x, names, rotation=15)
  ax.set_ylabel("generated tokens / s")
  ax.set_title("throughput, tiny model on CPU")
  ax.legend()
  ax = axes[1]
  ax.bar(x - 0.2, [r["prefill_tokens_off"] for r in rows], 0.4, label="prefill off")
  ax.bar(x + 0.2, [r["prefill_tokens_on"] for r in rows], 0.4, label="prefill on")
  ax.set_xticks(x, names, rotation=15)
  ax.set_ylabel("prompt tokens computed")
  ax.set_title("prefill work (hit rate above bars)")
  for i, r in enumerate(rows):
    ax.annotate(f"{r['hit_rate']:.2f}", (i + 0.2, r["prefill_tokens_on"]), ha="center",
                va="bottom", fontsize=8)
  ax.legend()
  ax = axes[2]
  sweep = result["block_size_sweep"]
  ax.plot([r["block_size"] for r in sweep], [r["hit_rate"] for r in sweep], "o-")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("block size (tokens)")
  ax.set_ylabel("hit tokens / shared tokens")
  ax.set_title("hit rate vs block size (prompts differ after a random point)")
  return str(common.save_png(fig, path))


HEADERS = ["workload", "hit rate", "prefill off", "prefill on", "saved", "peak blocks off/on",
           "tok/s off", "tok/s on", "ratio", "paper"]


def summary_rows(rows):
  return [[r["workload"], r["hit_rate"], r["prefill_tokens_off"], r["prefill_tokens_on"],
           r["prefill_reduction"], f"{r['off']['peak_blocks']}/{r['on']['peak_blocks']}",
           r["off"]["tokens_per_s"], r["on"]["tokens_per_s"], r["throughput_ratio"],
           r["paper_ratio"] or "-"] for r in rows]


def main(f: Config, out):
  """Runs with settings `f` and writes under the output directory `out`."""
  result = run(f)
  rows, sweep, cost = result["serving"], result["block_size_sweep"], result["lookup_cost"]
  common.write_json(out / "prefix_caching.json", result)
  png = plot(result, out / "prefix_caching.png")
  print(common.table(summary_rows(rows), HEADERS, digits=2))
  print(common.table([[r["block_size"], r["hit_rate"], r["lost_tokens"]] for r in sweep],
                     ["block size", "hit rate", "lost shared tokens"], digits=3))
  print(common.table([[r["num_blocks"], r["lookup_s_per_block"] * 1e6, r["evict16_s"] * 1e6,
                       r["topk16_s"] * 1e6, r["count_evictable_s"] * 1e6] for r in cost],
                     ["num_blocks", "lookup us/block", "evict 16 (ring) us",
                      "evict 16 (top-k scan) us", "count evictable us"], digits=1))
  print(f"wrote {out / 'prefix_caching.json'}, {png}")


if __name__ == "__main__":
  common.run_app(main, Config)
