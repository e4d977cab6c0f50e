r"""KV blocks saved by sharing: parallel sampling and beam search (paper Sec. 6.3, Fig. 15).

    python -m experiments.sharing --workloads=sharegpt,alpaca --widths=2,4,6 \
        --num_requests=12 --block_size=16 --kv_budget_tokens=2048 --out=results/sharing

The engine (shipped tiny model) serves one stream per workload with, per request,
parallel sampling (`SamplingParams(n=w, temperature=1)`: the w samples fork the
prompt's blocks) or beam search (`beam_width=w`: beams fork and copy-on-write
their last block), for each width w. After every engine step the block state is
read (`paged_jax.bench.memory.sharing_savings`): without sharing each live sequence
would hold cdiv(len, block_size) blocks; with it the pool holds the distinct
blocks. Savings = 1 - sum(used) / sum(unshared) over the steps. A width-1 greedy
run gives the throughput baseline. Writes `DIR/sharing.json`, `DIR/sharing.png`.

Paper (OPT-13B, Fig. 15): parallel sampling saves 6.1-9.8% (Alpaca) and
16.2-30.5% (ShareGPT); beam search 37.6-55.2% (Alpaca) and 44.3-66.3% (ShareGPT).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import engines
from paged_jax.bench import serving
from paged_jax.bench import workloads
from paged_jax.bench.scale import TINY

MODES = ("parallel", "beam")
# Paper Fig. 15 ranges over widths 2-6, as fractions.
PAPER_SAVINGS = {("alpaca", "parallel"): (0.061, 0.098), ("alpaca", "beam"): (0.376, 0.552),
                 ("sharegpt", "parallel"): (0.162, 0.305), ("sharegpt", "beam"): (0.443, 0.663)}


def sampling_params(mode: str, width: int, request):
  """SamplingParams of `request` for parallel sampling (n = width) or beam search."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  if mode == "parallel":
    return SamplingParams(max_tokens=request.output_len, temperature=1.0, n=width,
                          seed=1000 * request.request_id)
  if mode == "beam":
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, beam_width=width)
  raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.sharing."""
  workloads: Tuple[str, ...] = configs.flag(("sharegpt", "alpaca"), "streams to serve",
                                            choices=("sharegpt", "alpaca"))
  widths: Tuple[int, ...] = configs.flag((2, 4, 6), "n for parallel sampling and beam widths",
                                         lower=1, upper=TINY.max_beam_width)
  num_requests: int = configs.flag(12, "requests per stream", lower=1)
  block_size: int = configs.flag(16, "tokens per KV block", lower=1)
  kv_budget_tokens: int = configs.flag(2048, "KV pool in token slots", lower=1)
  max_seqs: int = configs.flag(64, "sequence slots", lower=1)
  max_len: int = configs.flag(TINY.max_len, "context limit of the streams", lower=2)
  seed: int = configs.flag(0, "stream seed")
  attention_backend: str = configs.flag("auto", "auto|reference|pallas|pallas_interpret")
  out: str = configs.flag("results/sharing", "output directory")


def run(f: Optional[Config] = None, *, show_progress=None) -> List[Dict]:
  """List of rows {workload, mode, width, savings, tokens_per_s, ...} (width 1 = baseline)
  for settings `f` (default `Config()`)."""
  f = f or Config()
  rows = []
  for name in f.workloads:
    requests = workloads.scaled_requests(name, f.num_requests, seed=f.seed, max_len=f.max_len)
    settings = [("greedy", 1)] + [(m, w) for m in MODES for w in f.widths]
    for mode, width in settings:
      engine = engines.make_engine(block_size=f.block_size, kv_budget_tokens=f.kv_budget_tokens,
                                   max_seqs=f.max_seqs, max_len=f.max_len,
                                   attention_backend=f.attention_backend)
      params_fn = (engines.greedy if mode == "greedy"
                   else (lambda r, m=mode, w=width: sampling_params(m, w, r)))
      bar = common.progress(total=f.num_requests, desc=f"{name} {mode} {width}",
                            disable=None if show_progress is None else not show_progress)
      with bar:
        res = serving.serve(engine, requests, params_fn, track_sharing=True, progress=bar)
      paper = PAPER_SAVINGS.get((name, mode))
      rows.append(dict(workload=name, mode=mode, width=width, block_size=f.block_size,
                       seed=f.seed, savings=res["sharing_savings"], paper_savings=paper, **{
                           k: res[k] for k in ("tokens_per_s", "requests_per_s",
                                               "generated_tokens", "seconds", "steps",
                                               "mean_running_seqs", "preemptions")}))
  return rows


HEADERS = ["workload", "mode", "width", "blocks saved", "paper (w=2..6)", "tok/s", "req/s",
           "mean running seqs", "preempt"]


def summary_rows(rows):
  out = []
  for r in rows:
    paper = r["paper_savings"]
    out.append([r["workload"], r["mode"], r["width"], f"{100 * r['savings']:.1f}%",
                f"{100 * paper[0]:.1f}-{100 * paper[1]:.1f}%" if paper else "",
                f"{r['tokens_per_s']:.0f}", f"{r['requests_per_s']:.2f}",
                f"{r['mean_running_seqs']:.1f}", r["preemptions"]])
  return out


def plot(rows, path):
  plt = common.pyplot()
  names = sorted({r["workload"] for r in rows}, key=["sharegpt", "alpaca"].index)
  fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.5), squeeze=False)
  colors = {"parallel": "#3d5a80", "beam": "#e07a5f"}
  for ax, name in zip(axes[0], names):
    for mode in MODES:
      sel = [r for r in rows if r["workload"] == name and r["mode"] == mode]
      ax.plot([r["width"] for r in sel], [100 * r["savings"] for r in sel], "o-",
              color=colors[mode], label=f"{mode} (ours)")
      lo, hi = PAPER_SAVINGS[(name, mode)]
      ax.axhspan(100 * lo, 100 * hi, color=colors[mode], alpha=0.15,
                 label=f"{mode} (paper range)")
    ax.set_title(f"{name}-like", fontsize=10)
    ax.set_xlabel("n (parallel) / beam width")
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_ylim(0, 100)
  axes[0][0].legend(fontsize=7, frameon=False)
  return common.save_png(fig, path)


def main(f: Config, out):
  """Runs with settings `f` and writes under the output directory `out`."""
  start = time.time()
  rows = run(f)
  common.write_json(out / "sharing.json", {
      "rows": rows, "seconds": time.time() - start,
      **provenance.run_metadata(f, ("workloads", "widths", "num_requests", "block_size",
                                    "kv_budget_tokens", "max_seqs", "seed"))})
  png = plot(rows, out / "sharing.png")
  print(common.table(summary_rows(rows), HEADERS))
  print(f"wrote {out / 'sharing.json'}, {png}")


if __name__ == "__main__":
  common.run_app(main, Config)
