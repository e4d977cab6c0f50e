r"""Recompute vs swap preemption by block size (paper Sec. 7.3, Fig. 19).

    python -m experiments.preemption --block_sizes=8,16,32,64 --num_requests=24 \
        --kv_budget_tokens=512 --seq_len=200 --out=results/preemption

Two measurements per block size, side by side in one run, on the shipped tiny model:

  (a) time per preemption (Fig. 19a): one sequence of --seq_len tokens. swap =
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

import time
from typing import Dict, Sequence

import numpy as np

from experiments import common
from paged_jax.bench import engines
from paged_jax.bench import serving
from paged_jax.bench import workloads
from paged_jax.bench.scale import TINY

MODES = ("recompute", "swap")


def _warm_swaps(engine, slot: int = 0) -> None:
  """Compiles swap_out / swap_in for every power-of-two block count they may pad to."""
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import swap  # pylint: disable=g-import-not-at-top
  c = engine.cache_config
  width = 1
  while True:
    tokens = min(width, c.max_blocks_per_seq) * c.block_size
    blocks, _ = bm.allocate(engine.state.blocks, slot, tokens)
    state = engine.state.replace(blocks=blocks)
    saved = swap.swap_out(state, slot, tokens)
    blocks, _ = bm.free(state.blocks, slot)
    state, _ = swap.swap_in(state.replace(blocks=blocks), slot, saved)
    blocks, _ = bm.free(state.blocks, slot)
    engine.state = state.replace(blocks=blocks)
    if width >= c.max_blocks_per_seq:
      break
    width *= 2


def time_per_preemption(block_size: int, *, seq_len: int = 256, repeats: int = 5,
                        kv_budget_tokens: int = 512, seed: int = 0) -> Dict:
  """{"swap_out_ms", "swap_in_ms", "swap_ms", "recompute_ms"} for one seq_len-token sequence."""
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import SamplingParams, swap  # pylint: disable=g-import-not-at-top
  engine = engines.make_engine(block_size=block_size, kv_budget_tokens=kv_budget_tokens)
  if seq_len > engine.max_model_len - 1:
    raise ValueError(f"seq_len must be < {engine.max_model_len}, got {seq_len}")
  _warm_swaps(engine)   # the recompute timing below keeps the fastest of `repeats` runs
  slot = 0
  outs, ins = [], []
  for _ in range(repeats):
    blocks, status = bm.allocate(engine.state.blocks, slot, seq_len)
    if int(status) != 0:
      raise RuntimeError(f"allocate failed with status {int(status)}")
    state = engine.state.replace(blocks=blocks)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    saved = swap.swap_out(state, slot, seq_len)
    t1 = time.perf_counter()
    blocks, _ = bm.free(state.blocks, slot)
    state = state.replace(blocks=jax.block_until_ready(blocks))
    t2 = time.perf_counter()
    state, status = swap.swap_in(state, slot, saved)
    jax.block_until_ready(state)
    t3 = time.perf_counter()
    blocks, _ = bm.free(state.blocks, slot)
    engine.state = state.replace(blocks=blocks)
    outs.append(t1 - t0)
    ins.append(t3 - t2)
  prompt = list(np.random.default_rng(seed).integers(0, 256, seq_len))
  recompute = []
  for _ in range(repeats):
    engine.timing.clear()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    recompute.append(engine.timing["step_s"])   # one prefill step (+ the free)
  ms = lambda xs: 1e3 * float(np.min(xs))
  return {"swap_out_ms": ms(outs), "swap_in_ms": ms(ins),
          "swap_ms": ms(np.array(outs) + np.array(ins)), "recompute_ms": ms(recompute),
          "swap_bytes": int(saved.nbytes)}


def run(block_sizes: Sequence[int] = (8, 16, 32, 64), *, num_requests: int = 24,
        kv_budget_tokens: int = 512, seq_len: int = 200, repeats: int = 5, seed: int = 0,
        show_progress=None) -> list:
  """One row per block size: (a) time per preemption, (b) end-to-end per mode."""
  requests = workloads.scaled_requests("sharegpt", num_requests, seed=seed)
  seq_len = min(seq_len, TINY.max_len - 1)
  rows = []
  for bs in common.progress(block_sizes, desc="block sizes",
                            disable=None if show_progress is None else not show_progress):
    row = {"block_size": bs}
    row.update(time_per_preemption(bs, seq_len=seq_len, repeats=repeats,
                                   kv_budget_tokens=kv_budget_tokens, seed=seed))
    for mode in MODES:
      engine = engines.make_engine(block_size=bs, kv_budget_tokens=kv_budget_tokens,
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


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_list("block_sizes", ["8", "16", "32", "64"], "block sizes")
  flags.DEFINE_integer("num_requests", 24, "requests of the end-to-end stream", lower_bound=1)
  flags.DEFINE_integer("kv_budget_tokens", 512, "KV pool (slots): small, to force preemption",
                       lower_bound=1)
  flags.DEFINE_integer("seq_len", 200, "tokens of the preempted sequence in (a)", lower_bound=1)
  flags.DEFINE_integer("repeats", 5, "timed repeats in (a) (fastest kept)", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "stream seed")
  flags.DEFINE_string("out", "results/preemption", "output directory")


def main(f, out):
  """Runs with parsed flags `f` and writes under the output directory `out`."""
  start = time.time()
  rows = run([int(b) for b in f.block_sizes], num_requests=f.num_requests,
             kv_budget_tokens=f.kv_budget_tokens, seq_len=f.seq_len, repeats=f.repeats,
             seed=f.seed)
  common.write_json(out / "preemption.json", {
      "rows": rows, "seconds": time.time() - start,
      **common.run_metadata(f, ("block_sizes", "num_requests", "kv_budget_tokens",
                                        "seq_len", "repeats", "seed"))})
  png = plot(rows, out / "preemption.png", f.seq_len)
  print(common.table(summary_rows(rows), HEADERS))
  print(f"wrote {out / 'preemption.json'}, {png}")


if __name__ == "__main__":
  common.run_app(main, _define_flags)
