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
  block table (`bench.memory.block_table_stats`):
    mean_blocks_per_seq   mean cdiv(prompt + output, block_size) over the stream
    block_table_width     cdiv(max_len, block_size) entries per row
  attention_ms            one decode attention call (`bench.step_costs.attention_ms`, backend
                          auto: the reference gather on CPU, the Pallas kernel on
                          GPU) for --attn_batch sequences of --attn_context tokens,
                          fastest of --attn_repeats, pages in random order
  engine (only for --engine_block_sizes; the tiny model, `serving` scaled stream,
  KV budget --engine_kv_budget_tokens):
    engine_tokens_per_s, engine_requests_per_s, engine_tokens_per_step

  prefix_hit_rate         fraction of prompt tokens served by `paged_jax.prefix_cache`
                          (`bench.prefix_blocks.prefix_hit_rate`)
                          when the first --prefix_num_requests prompts of the stream
                          share a --prefix_len-token system prompt (whole blocks only;
                          --prefix_block_sizes, default all)

The best block size per workload is the one with the highest engine tokens/s
(the paper picks by serving throughput); block sizes within 5% of it form the
"good range", beside the paper's 16-128 (ShareGPT) and 16-32 (Alpaca).
Also `DIR/block_size_sweep.png` (multi-panel) and `DIR/block_size_sweep_best.json`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import engines
from paged_jax.bench import memory
from paged_jax.bench import prefix_blocks
from paged_jax.bench import serving
from paged_jax.bench import step_costs
from paged_jax.bench import workloads
from paged_jax.bench.baselines import simulate
from paged_jax.config import cdiv

PAPER_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Memory-simulation stream lengths: Alpaca-like requests are ~6x shorter, so it
# takes more of them to keep the queue waiting (the averaged, saturated steps).
DEFAULT_NUM_REQUESTS = {"sharegpt": 200, "alpaca": 1000}


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.block_size_sweep."""
  workloads: Tuple[str, ...] = configs.flag(("sharegpt", "alpaca"), "streams",
                                            choices=("sharegpt", "alpaca"))
  block_sizes: Tuple[int, ...] = configs.flag(DEFAULT_BLOCK_SIZES, "KV block sizes (powers of "
                                              "two)", lower=1, upper=1024)
  num_requests: Dict[str, int] = configs.flag(
      DEFAULT_NUM_REQUESTS, "workload:requests of the memory simulation streams (a workload "
      "left out keeps its default)", lower=1)
  kv_budget_tokens: int = configs.flag(8192, "memory simulation KV budget (slots)", lower=1)
  max_len: int = configs.flag(1024, "context limit of the memory stream", lower=2)
  engine_block_sizes: Tuple[int, ...] = configs.flag(
      (4, 16, 64, 256), "block sizes also served by the engine (each compiles once)", lower=1)
  engine_num_requests: int = configs.flag(32, "requests served by the engine", lower=1)
  engine_kv_budget_tokens: int = configs.flag(2048, "engine KV pool (slots)", lower=1)
  attn_batch: int = configs.flag(8, "sequences in the attention timing", lower=1)
  attn_context: int = configs.flag(512, "tokens per sequence in the attention timing", lower=1)
  attn_repeats: int = configs.flag(7, "timed attention calls (fastest kept)", lower=1)
  prefix_block_sizes: Optional[Tuple[int, ...]] = configs.flag(
      None, "block sizes of the prefix-cache hit rate (default: all of --block_sizes; empty "
      "string: none)", lower=1)
  prefix_num_requests: int = configs.flag(32, "prompts in the prefix-cache run", lower=1)
  prefix_len: int = configs.flag(80, "shared system-prompt tokens (paper 1-shot: 80)", lower=1)
  seed: int = configs.flag(0, "stream seed")
  attention_backend: str = configs.flag("auto", "auto|reference|pallas|pallas_interpret")
  out: str = configs.flag("results/block_size_sweep", "output directory")

  def check(self) -> None:
    for bs in self.block_sizes + self.engine_block_sizes:
      if bs & (bs - 1):
        raise ValueError(f"--block_sizes: block_size must be a power of two, got {bs}")
      if self.kv_budget_tokens % bs or self.engine_kv_budget_tokens % bs:
        raise ValueError(f"block size {bs} must divide --kv_budget_tokens="
                         f"{self.kv_budget_tokens} and --engine_kv_budget_tokens="
                         f"{self.engine_kv_budget_tokens}")
    extra = sorted(set(self.engine_block_sizes) - set(self.block_sizes))
    if extra:
      raise ValueError(f"--engine_block_sizes {extra} are not in --block_sizes "
                       f"{list(self.block_sizes)}")


def memory_stats(requests: Sequence, block_size: int, kv_budget_tokens: int,
                 max_len: int) -> Dict:
  """Paged memory partition and concurrency at a fixed KV budget (the real block manager)."""
  res = simulate.simulate_paged(requests, block_size, kv_budget_tokens, max_len)
  return {k: res[k] for k in ("token_utilization", "reservation", "internal_fragmentation",
                              "max_concurrent", "mean_concurrent", "preemptions")}


def engine_stats(requests: Sequence, block_size: int, kv_budget_tokens: int,
                 attention_backend: str = "auto") -> Dict:
  """Tiny-model engine throughput at this block size on a scaled stream."""
  engine = engines.make_engine(block_size=block_size, kv_budget_tokens=kv_budget_tokens,
                               attention_backend=attention_backend)
  res = serving.serve(engine, requests)
  return {"engine_tokens_per_s": res["tokens_per_s"],
          "engine_requests_per_s": res["requests_per_s"],
          "engine_tokens_per_step": res["tokens_per_step"],
          "engine_mean_running_seqs": res["mean_running_seqs"]}


def run(f: Optional[Config] = None, *, show_progress: Optional[bool] = None) -> List[Dict]:
  """The sweep's rows (one dict per (workload, block size)) for settings `f` (default:
  `Config()`); see the module docstring."""
  f = f or Config()
  num_requests = {**DEFAULT_NUM_REQUESTS, **f.num_requests}
  block_sizes = f.block_sizes
  prefix_block_sizes = block_sizes if f.prefix_block_sizes is None else f.prefix_block_sizes
  attn_sizes = [bs for bs in block_sizes if f.attn_context % bs == 0]
  attn = step_costs.attention_ms(attn_sizes, batch=f.attn_batch, context=f.attn_context,
                                 repeats=f.attn_repeats, seed=f.seed,
                                 backend=f.attention_backend)
  rows = []
  bar = common.progress(total=len(f.workloads) * len(block_sizes), desc="block sizes",
                        disable=None if show_progress is None else not show_progress)
  with bar:
    for name in f.workloads:
      requests = workloads.synthetic(name, num_requests[name], seed=f.seed, max_len=f.max_len)
      engine_requests = workloads.scaled_requests(name, f.engine_num_requests, seed=f.seed)
      prefix_requests = requests[:f.prefix_num_requests]
      for bs in block_sizes:
        row = {"workload": name, "block_size": bs}
        row.update(memory_stats(requests, bs, f.kv_budget_tokens, f.max_len))
        row.update(memory.block_table_stats(requests, bs, f.max_len))
        row["attention_ms"] = attn.get(bs)   # the same call for every stream
        if bs in prefix_block_sizes:
          row["prefix_hit_rate"] = prefix_blocks.prefix_hit_rate(
              prefix_requests, bs, prefix_len=f.prefix_len, max_len=f.max_len, seed=f.seed)
        if bs in f.engine_block_sizes:
          row.update(engine_stats(engine_requests, bs, f.engine_kv_budget_tokens,
                                  f.attention_backend))
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
           "prefix hit", "attn ms", "engine tok/s"]


def summary_rows(rows):
  fmt = lambda x, f: "" if x is None else f.format(x)
  return [[r["workload"], r["block_size"], f"{100 * r['token_utilization']:.1f}%",
           f"{100 * r['internal_fragmentation']:.1f}%", r["max_concurrent"],
           f"{r['mean_concurrent']:.1f}", f"{r['mean_blocks_per_seq']:.1f}",
           fmt(None if r.get("prefix_hit_rate") is None else 100 * r["prefix_hit_rate"],
               "{:.1f}%"),
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
  nrows = cdiv(len(panels), ncols)
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


def png_bytes(rows, best: Optional[Dict] = None) -> bytes:
  """`figure(rows, best)` as PNG bytes (for `IPython.display.Image` in notebooks)."""
  import io  # pylint: disable=g-import-not-at-top
  fig = figure(rows, best)
  buf = io.BytesIO()
  fig.savefig(buf, dpi=100, bbox_inches="tight", format="png")
  common.pyplot().close(fig)
  return buf.getvalue()


def write_jsonl(rows, path):
  import json  # pylint: disable=g-import-not-at-top
  path = common.out_dir(str(path.parent)) / path.name
  path.write_text("".join(json.dumps(common.json_ready(r)) + "\n" for r in rows))
  return path


def main(f: Config, out):
  """Runs with settings `f` and writes under the output directory `out`."""
  start = time.time()
  rows = run(f)
  best = best_block_sizes(rows)
  write_jsonl(rows, out / "block_size_sweep.jsonl")
  common.write_json(out / "block_size_sweep_best.json", {
      "best": best, "seconds": time.time() - start,
      **provenance.run_metadata(f, ("workloads", "block_sizes", "num_requests",
                                    "kv_budget_tokens", "max_len", "engine_block_sizes",
                                    "engine_num_requests", "engine_kv_budget_tokens",
                                    "attn_batch", "attn_context", "prefix_block_sizes",
                                    "prefix_num_requests", "prefix_len", "seed"))})
  png = plot(rows, out / "block_size_sweep.png", best)
  print(common.table(summary_rows(rows), HEADERS))
  for name, b in best.items():
    print(f"{name}-like: best block size {b['best']} (within 5%: {b['good_range'][0]}-"
          f"{b['good_range'][1]}, by {b['by']}); paper {b['paper'][0]}-{b['paper'][1]}")
  print(f"wrote {out / 'block_size_sweep.jsonl'}, {png}")


if __name__ == "__main__":
  common.run_app(main, Config)
