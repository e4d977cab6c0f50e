r"""Block-size sweep: what the KV block size trades off (paper Sec. 7.2, Fig. 18).

    python -m experiments.block_size_sweep --workloads=sharegpt,alpaca \
        --block_sizes=1,2,4,8,16,32,64,128,256 --num_requests=sharegpt:200,alpaca:1000 \
        --engine_block_sizes=4,16,64,256 --out=results/block_size_sweep

One row per (workload, block size) in `DIR/block_size_sweep.jsonl`:

  memory (the real block manager, `baselines.simulate.simulate_paged`, the
  unscaled stream: Table 1 mean lengths, clipped to --max_len, all queued at 0,
  KV budget --kv_budget_tokens slots):
    token_utilization, internal_fragmentation, reservation  fractions of the budget
    max_concurrent, mean_concurrent                         requests in memory
    preemptions                                             recompute preemptions
  block table:
    mean_blocks_per_seq   mean cdiv(prompt + output, block_size) over the stream
    block_table_width     cdiv(max_len, block_size) entries per row
  attention_ms            one decode attention call (paged_jax.attention, backend
                          auto: the reference gather on CPU, the Pallas kernel on
                          GPU) for --attn_batch sequences of --attn_context tokens,
                          fastest of --attn_repeats, pages in random order
  engine (only for --engine_block_sizes; the tiny model, `serving` scaled stream,
  KV budget --engine_kv_budget_tokens):
    engine_tokens_per_s, engine_requests_per_s, engine_tokens_per_step

Prefix-cache hit rate is not reported yet (paged_jax.prefix_cache has not landed).

The best block size per workload is the one with the highest engine tokens/s
(the paper picks by serving throughput); block sizes within 5% of it form the
"good range", beside the paper's 16-128 (ShareGPT) and 16-32 (Alpaca).
Also `DIR/block_size_sweep.png` (multi-panel) and `DIR/block_size_sweep_best.json`.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from experiments import common
from experiments import serving
from paged_jax import workloads

PAPER_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Memory-simulation stream lengths: Alpaca-like requests are ~6x shorter, so it
# takes more of them to keep the queue waiting (the averaged, saturated steps).
DEFAULT_NUM_REQUESTS = {"sharegpt": 200, "alpaca": 1000}


def block_table_stats(requests: Sequence, block_size: int, max_len: int) -> Dict:
  """Mean blocks a sequence ends with, and the width of a block-table row."""
  totals = np.array([r.total_len for r in requests])
  return {"mean_blocks_per_seq": float(np.mean(-(-totals // block_size))),
          "block_table_width": -(-max_len // block_size)}


def memory_stats(requests: Sequence, block_size: int, kv_budget_tokens: int,
                 max_len: int) -> Dict:
  """Paged memory partition and concurrency at a fixed KV budget (the real block manager)."""
  from paged_jax.baselines import simulate  # pylint: disable=g-import-not-at-top
  res = simulate.simulate_paged(requests, block_size, kv_budget_tokens, max_len)
  return {k: res[k] for k in ("token_utilization", "reservation", "internal_fragmentation",
                              "max_concurrent", "mean_concurrent", "preemptions")}


def attention_ms(block_size: int, *, batch: int = 8, context: int = 512, num_q_heads: int = 8,
                 num_kv_heads: int = 2, head_dim: int = 64, repeats: int = 5, seed: int = 0,
                 backend: str = "auto") -> float:
  """Fastest of `repeats` ms of one jitted decode paged-attention call at this block size.

  Every sequence holds `context` tokens in `context / block_size` pages placed in
  a random permutation of the pool (fresh random K/V).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax import attention  # pylint: disable=g-import-not-at-top
  if context % block_size:
    raise ValueError(f"attn context {context} must be a multiple of block_size={block_size}")
  pages_per_seq = context // block_size
  num_blocks = batch * pages_per_seq
  rng = np.random.default_rng(seed)
  shape = (num_kv_heads, num_blocks, block_size, head_dim)
  k = jax.numpy.asarray(rng.standard_normal(shape, np.float32))
  v = jax.numpy.asarray(rng.standard_normal(shape, np.float32))
  q = jax.numpy.asarray(rng.standard_normal((batch, num_q_heads, head_dim), np.float32))
  tables = jax.numpy.asarray(rng.permutation(num_blocks).reshape(batch, pages_per_seq)
                             .astype(np.int32))
  lengths = jax.numpy.full((batch,), context, jax.numpy.int32)
  fn = jax.jit(functools.partial(attention.paged_attention, backend=backend))
  fn(q, k, v, tables, lengths).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn(q, k, v, tables, lengths).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.min(times))   # the machine is shared: min is the stable statistic


def engine_stats(requests: Sequence, block_size: int, kv_budget_tokens: int,
                 attention_backend: str = "auto") -> Dict:
  """Tiny-model engine throughput at this block size on a scaled stream."""
  engine = serving.make_engine(block_size=block_size, kv_budget_tokens=kv_budget_tokens,
                               attention_backend=attention_backend)
  res = serving.serve(engine, requests)
  return {"engine_tokens_per_s": res["tokens_per_s"],
          "engine_requests_per_s": res["requests_per_s"],
          "engine_tokens_per_step": res["tokens_per_step"],
          "engine_mean_running_seqs": res["mean_running_seqs"]}


def run(workload_names: Sequence[str] = ("sharegpt", "alpaca"), *,
        block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
        num_requests: Optional[Dict[str, int]] = None,
        kv_budget_tokens: int = 8192, max_len: int = 1024,
        engine_block_sizes: Sequence[int] = (4, 16, 64, 256), engine_num_requests: int = 32,
        engine_kv_budget_tokens: int = 2048, attn_batch: int = 8, attn_context: int = 512,
        attn_repeats: int = 7, seed: int = 0, attention_backend: str = "auto",
        show_progress: Optional[bool] = None) -> List[Dict]:
  """The sweep's rows (one dict per (workload, block size)); see the module docstring.

  `num_requests` maps workload -> stream length (default `DEFAULT_NUM_REQUESTS`:
  enough Alpaca-like requests to saturate the budget too).
  """
  num_requests = {**DEFAULT_NUM_REQUESTS, **(num_requests or {})}
  for bs in list(block_sizes) + list(engine_block_sizes):
    if bs < 1 or bs & (bs - 1):
      raise ValueError(f"block sizes must be powers of two >= 1, got {bs}")
    if kv_budget_tokens % bs or engine_kv_budget_tokens % bs:
      raise ValueError(f"block size {bs} must divide kv_budget_tokens={kv_budget_tokens} and "
                       f"engine_kv_budget_tokens={engine_kv_budget_tokens}")
  extra = sorted(set(engine_block_sizes) - set(block_sizes))
  if extra:
    raise ValueError(f"engine_block_sizes {extra} are not in block_sizes {list(block_sizes)}")
  attn = {}
  rows = []
  bar = common.progress(total=len(workload_names) * len(block_sizes), desc="block sizes",
                        disable=None if show_progress is None else not show_progress)
  with bar:
    for name in workload_names:
      requests = workloads.synthetic(name, num_requests[name], seed=seed, max_len=max_len)
      engine_requests = serving.scaled_requests(name, engine_num_requests, seed=seed)
      for bs in block_sizes:
        row = {"workload": name, "block_size": bs}
        row.update(memory_stats(requests, bs, kv_budget_tokens, max_len))
        row.update(block_table_stats(requests, bs, max_len))
        if bs not in attn:   # the attention call does not depend on the stream
          attn[bs] = (attention_ms(bs, batch=attn_batch, context=attn_context,
                                   repeats=attn_repeats, seed=seed, backend=attention_backend)
                      if attn_context % bs == 0 else None)
        row["attention_ms"] = attn[bs]
        if bs in engine_block_sizes:
          row.update(engine_stats(engine_requests, bs, engine_kv_budget_tokens,
                                  attention_backend))
        rows.append(row)
        bar.update(1)
  return rows


def best_block_sizes(rows: Sequence[Dict], tolerance: float = 0.05) -> Dict:
  """{workload: {"best", "good_range", "by", "paper"}}: highest engine tokens/s (within tolerance).

  Falls back to token utilization x (1 / attention time) when no engine column was measured.
  """
  out = {}
  for name in dict.fromkeys(r["workload"] for r in rows):
    sel = [r for r in rows if r["workload"] == name]
    measured = [r for r in sel if r.get("engine_tokens_per_s") is not None]
    if measured:
      key, by = (lambda r: r["engine_tokens_per_s"]), "engine tokens/s"
    else:
      measured = [r for r in sel if r.get("attention_ms")]
      key, by = (lambda r: r["token_utilization"] / r["attention_ms"]), "utilization / attn ms"
    best = max(measured, key=key)
    good = sorted(r["block_size"] for r in measured if key(r) >= (1 - tolerance) * key(best))
    out[name] = {"best": best["block_size"], "good_range": [good[0], good[-1]], "by": by,
                 "measured_block_sizes": [r["block_size"] for r in measured],
                 "paper": list(PAPER_BEST.get(name, ()))}
  return out


HEADERS = ["workload", "block", "token util", "int frag", "max conc", "mean conc", "blocks/seq",
           "attn ms", "engine tok/s"]


def summary_rows(rows):
  fmt = lambda x, f: "" if x is None else f.format(x)
  return [[r["workload"], r["block_size"], f"{100 * r['token_utilization']:.1f}%",
           f"{100 * r['internal_fragmentation']:.1f}%", r["max_concurrent"],
           f"{r['mean_concurrent']:.1f}", f"{r['mean_blocks_per_seq']:.1f}",
           fmt(r["attention_ms"], "{:.2f}"), fmt(r.get("engine_tokens_per_s"), "{:.0f}")]
          for r in rows]


PANELS = (("token_utilization", "KV memory holding tokens (%)", 100),
          ("internal_fragmentation", "internal fragmentation (%)", 100),
          ("mean_concurrent", "mean concurrent requests", 1),
          ("mean_blocks_per_seq", "blocks per sequence (table length)", 1),
          ("prefix_hit_rate", "prefix-cache hit rate (%)", 100),
          ("attention_ms", "decode attention (ms)", 1),
          ("engine_tokens_per_s", "engine tokens / s (tiny model)", 1))


def figure(rows, best: Optional[Dict] = None):
  """A matplotlib figure: one panel per measured column against block size (log2 x)."""
  plt = common.pyplot()
  panels = [p for p in PANELS if any(r.get(p[0]) is not None for r in rows)]
  ncols = 3
  nrows = -(-len(panels) // ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(13, 3.5 * nrows), squeeze=False)
  colors = {"sharegpt": "#3d5a80", "alpaca": "#e07a5f"}
  for ax, (key, label, mult) in zip(axes.flat, panels):
    for name in dict.fromkeys(r["workload"] for r in rows):
      sel = [r for r in rows if r["workload"] == name and r.get(key) is not None]
      ax.plot([r["block_size"] for r in sel], [mult * r[key] for r in sel], "o-",
              color=colors.get(name), label=f"{name}-like")
      if best and key == "engine_tokens_per_s" and name in best:
        lo, hi = best[name]["paper"]
        ax.axvspan(lo, hi, color=colors.get(name), alpha=0.1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel(label, fontsize=9)
    if key in ("mean_blocks_per_seq", "attention_ms"):
      ax.set_yscale("log")
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=8, frameon=False)
  fig.suptitle("Block-size sweep" + (" (shaded in the engine panel: the paper's best range)"
                                     if best else ""), fontsize=10)
  fig.tight_layout()
  return fig


def plot(rows, path, best: Optional[Dict] = None):
  """Saves `figure(rows, best)` as a PNG; returns the path."""
  return common.save_png(figure(rows, best), path)


def write_jsonl(rows, path):
  import json  # pylint: disable=g-import-not-at-top
  path = common.out_dir(str(path.parent)) / path.name
  path.write_text("".join(json.dumps(common._plain(r)) + "\n" for r in rows))  # pylint: disable=protected-access
  return path


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_list("workloads", ["sharegpt", "alpaca"], "streams")
  flags.DEFINE_list("block_sizes", [str(b) for b in DEFAULT_BLOCK_SIZES], "powers of two")
  flags.DEFINE_list("num_requests", [f"{k}:{v}" for k, v in DEFAULT_NUM_REQUESTS.items()],
                    "workload:requests of the memory simulation streams")
  flags.DEFINE_integer("kv_budget_tokens", 8192, "memory simulation KV budget (slots)",
                       lower_bound=1)
  flags.DEFINE_integer("max_len", 1024, "context limit of the memory stream", lower_bound=2)
  flags.DEFINE_list("engine_block_sizes", ["4", "16", "64", "256"],
                    "block sizes also served by the engine (each compiles once)")
  flags.DEFINE_integer("engine_num_requests", 32, "requests served by the engine", lower_bound=1)
  flags.DEFINE_integer("engine_kv_budget_tokens", 2048, "engine KV pool (slots)", lower_bound=1)
  flags.DEFINE_integer("attn_batch", 8, "sequences in the attention timing", lower_bound=1)
  flags.DEFINE_integer("attn_context", 512, "tokens per sequence in the attention timing",
                       lower_bound=1)
  flags.DEFINE_integer("attn_repeats", 7, "timed attention calls (fastest kept)", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "stream seed")
  flags.DEFINE_string("attention_backend", "auto", "auto|reference|pallas|pallas_interpret")
  flags.DEFINE_string("out", "results/block_size_sweep", "output directory")


def main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    sys.exit(f"unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  out = common.out_dir(f.out)
  start = time.time()
  rows = run(f.workloads, block_sizes=[int(b) for b in f.block_sizes],
             num_requests={k: int(v) for k, v in (x.split(":") for x in f.num_requests)},
             kv_budget_tokens=f.kv_budget_tokens, max_len=f.max_len,
             engine_block_sizes=[int(b) for b in f.engine_block_sizes],
             engine_num_requests=f.engine_num_requests,
             engine_kv_budget_tokens=f.engine_kv_budget_tokens, attn_batch=f.attn_batch,
             attn_context=f.attn_context, attn_repeats=f.attn_repeats, seed=f.seed,
             attention_backend=f.attention_backend)
  best = best_block_sizes(rows)
  write_jsonl(rows, out / "block_size_sweep.jsonl")
  common.write_json(out / "block_size_sweep_best.json", {
      "best": best, "seconds": time.time() - start,
      "flags": {k: f[k].value for k in ("workloads", "block_sizes", "num_requests",
                                        "kv_budget_tokens", "max_len", "engine_block_sizes",
                                        "engine_num_requests", "engine_kv_budget_tokens",
                                        "attn_batch", "attn_context", "seed")}})
  png = plot(rows, out / "block_size_sweep.png", best)
  print(common.table(summary_rows(rows), HEADERS))
  for name, b in best.items():
    print(f"{name}-like: best block size {b['best']} (within 5%: {b['good_range'][0]}-"
          f"{b['good_range'][1]}, by {b['by']}); paper {b['paper'][0]}-{b['paper'][1]}")
  print(f"wrote {out / 'block_size_sweep.jsonl'}, {png}")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)
