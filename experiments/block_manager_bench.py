r"""Block-manager scaling: jitted functional append vs a host-side Python allocator.

    python -m experiments.block_manager_bench --batch=256 \
        --num_blocks_list=1024,16384,262144,1048576 --iters=1000 --out=results/block_manager

A decode-like workload: `batch` sequence slots, each grows by one token per step
(block_size 16, so about batch/16 slots cross a block boundary every step); a
sequence that reaches its target length (at most 64 tokens, so even the 1K pool
never runs dry) is freed and its slot restarts as a new prompt or, with
`--fork_prob`, as a fork of a running sequence (then copy-on-write). The same
pre-generated schedule is replayed, side by side in one process, by:

  * jit (donated): `block_manager.append` jitted with the state donated, plus a
    separate donated recycle op (free + allocate); also the fused step (recycle
    and append in one jit), which is how the engine uses it;
  * jit (not donated): the same append without donation, for contrast: every
    O(num_blocks) array the op updates is copied each step;
  * host: a Python allocator as vLLM / nano-vllm keep one (a deque free list, a
    per-block ref-count list, per-sequence block lists); "host + upload" also
    builds the [batch, max_blocks_per_seq] block-table array and puts it on the
    device, which a host allocator must do every step before attention.

All pool sizes and variants take turns, `--chunk` steps at a time in a rotating
order, so load from other processes hits them alike; the process is pinned to
one core (`--cpu_cores`). Each call is timed alone with `block_until_ready`;
medians over `--iters` steps after `--warmup` steps. At the end jit and host
must agree on lengths, free blocks and copies. The schedule and the runners are
`experiments.block_manager_timing`'s. Writes DIR/block_manager_bench.json and
DIR/block_manager_bench.png and prints a table.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import sys
from typing import Dict, Optional, Tuple

import jax
import numpy as np

from experiments import block_manager_timing as timing
from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.config import CacheConfig, cdiv


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.block_manager_bench."""
  batch: int = configs.flag(256, "sequence slots, all decoding every step", lower=1)
  num_blocks_list: Tuple[int, ...] = configs.flag((1024, 16384, 262144, 1048576),
                                                  "pool sizes (blocks) to time", lower=1)
  iters: int = configs.flag(1000, "timed steps per variant", lower=1)
  warmup: int = configs.flag(100, "untimed steps before timing (compile + caches)", lower=0)
  block_size: int = configs.flag(16, "tokens per block", lower=1)
  max_len: int = configs.flag(64, "longest sequence (tokens) before it is recycled", lower=2)
  recycle_width: int = configs.flag(64, "static width of the free/allocate slot vector",
                                    lower=1)
  seed: int = configs.flag(0, "schedule seed")
  chunk: int = configs.flag(50, "steps each variant runs before the next takes a turn",
                            lower=1)
  fork_prob: float = configs.flag(
      0.0, "chance that a recycled slot restarts as a fork of a running sequence (sharing, "
      "then copy-on-write) instead of a new prompt", lower=0.0, upper=1.0)
  cpu_cores: int = configs.flag(
      1, "pin the process to this many cores before JAX starts (0: leave as is). One core "
      "matches the single-threaded host allocator, and stops XLA:CPU from splitting each "
      "in-place scatter over a num_blocks-long array into thread-pool tasks (its cost model "
      "counts the array, not the updates)", lower=0)
  out: str = configs.flag("results/block_manager", "output directory")

  def check(self) -> None:
    for nb in self.num_blocks_list:
      if nb < self.batch * cdiv(self.max_len, self.block_size):
        raise ValueError(f"--num_blocks_list: {nb} blocks is too small for --batch={self.batch} "
                         f"at --max_len={self.max_len}")


def _pin_cores(n):
  """Restricts this process to its first `n` allowed cores; returns the core list."""
  cores = sorted(os.sched_getaffinity(0))
  if n > 0:
    cores = cores[:n]
    os.sched_setaffinity(0, cores)
  return cores


def run(f: Optional[Config] = None) -> Dict:
  """{"meta", "results": one row per pool size, "summary": scaling ratios} for settings `f`
  (default `Config()`); the jit and host paths must agree (AssertionError otherwise)."""
  f = f or Config()
  cores = _pin_cores(f.cpu_cores)
  batch, bs = f.batch, f.block_size
  steps = f.warmup + f.iters
  with_fork = f.fork_prob > 0
  init_lens, sched = timing.make_schedule(batch, steps, f.max_len, f.recycle_width,
                                   f.seed, f.fork_prob)
  # Two blocks of slack: a recycle deferred by a full --recycle_width overshoots max_len.
  max_blocks = cdiv(f.max_len, bs) + 2
  sizes = list(f.num_blocks_list)
  runners, split_ops = {}, {}
  rows = jax.block_until_ready(timing.device_rows(sched))
  for nb in sizes:
    cfg = CacheConfig(block_size=bs, num_blocks=nb, max_seqs=batch, max_blocks_per_seq=max_blocks)
    runners[nb] = {"jit": timing.JitRunner(cfg, init_lens, rows, with_fork, donate=True),
                   "no_donate": timing.JitRunner(cfg, init_lens, rows, with_fork, donate=False),
                   "fused": timing.FusedRunner(cfg, init_lens, rows, with_fork),
                   "host": timing.HostRunner(cfg, init_lens, sched)}
    split_ops[nb] = timing.thread_split_ops(cfg)
  # Interleaved in chunks of --chunk steps: each pool size and variant runs a chunk
  # in turn (rotating order), so load from other processes hits all of them alike,
  # while caches stay warm within a chunk (per-step interleaving measured cold
  # caches: the 1M-block non-donated copies alone flush them).
  order = [(nb, name) for nb in sizes for name in runners[nb]]
  chunk = max(1, f.chunk)
  for c, start in enumerate(common.progress(range(0, steps, chunk), desc="chunks")):
    k = c % len(order)
    for nb, name in order[k:] + order[:k]:
      for t in range(start, min(start + chunk, steps)):
        runners[nb][name].step(t, record=t >= f.warmup)
  results = []
  for nb in sizes:
    jit, nod, fused, host = (runners[nb][k] for k in ("jit", "no_donate", "fused", "host"))
    j_copies = jit.finish()
    nod.finish()
    fused.finish()
    assert j_copies == host.copies, (j_copies, host.copies)  # same copy-on-write work
    # Both did the same bookkeeping: same lengths, same number of free blocks.
    np.testing.assert_array_equal(np.asarray(jit.state.seq_lens), host.host.lens)
    assert int(jit.state.num_free) == len(host.host.stack)
    spread = {}
    j_app = timing.median_us(jit.times["append"], spread, "jit_append")
    j_rec = timing.median_us(jit.times["recycle"], spread, "jit_recycle")
    n_app = timing.median_us(nod.times["append"], spread, "jit_append_no_donate")
    n_rec = timing.median_us(nod.times["recycle"], spread, "jit_recycle_no_donate")
    f_step = timing.median_us(fused.times["step"], spread, "jit_fused_step")
    h_app = timing.median_us(host.times["append"], spread, "host_append")
    h_rec = timing.median_us(host.times["recycle"], spread, "host_recycle")
    h_upload = timing.median_us(host.times["upload"], spread, "host_append_plus_upload")
    results.append({
        "num_blocks": nb, "jit_append_us": j_app, "jit_append_no_donate_us": n_app,
        "jit_recycle_us": j_rec, "jit_recycle_no_donate_us": n_rec, "jit_fused_step_us": f_step,
        "host_append_us": h_app, "host_recycle_us": h_rec,
        "host_append_plus_upload_us": h_upload, "jit_over_host_append": j_app / h_app,
        "host_step_us": h_app + h_rec, "jit_fused_over_host_step": f_step / (h_app + h_rec),
        "copy_on_write_copies": j_copies, "xla_thread_split_ops_in_append": split_ops[nb],
        "spread_us": spread})
  first, last = results[0], results[-1]
  summary = {
      "scaling_jit_append": last["jit_append_us"] / first["jit_append_us"],
      "scaling_jit_fused_step": last["jit_fused_step_us"] / first["jit_fused_step_us"],
      "scaling_jit_append_no_donate": (last["jit_append_no_donate_us"]
                                       / first["jit_append_no_donate_us"]),
      "scaling_host_append": last["host_append_us"] / first["host_append_us"],
      "scaling_from_to_blocks": [first["num_blocks"], last["num_blocks"]],
  }
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
      "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
      "jax": jax.__version__, "python": platform.python_version(), "cpu_cores_used": cores,
      "command": " ".join(sys.argv), "versions": provenance.versions(),
      "flags": {"batch": batch, "block_size": bs, "iters": f.iters, "warmup": f.warmup,
                "max_len": f.max_len, "recycle_width": f.recycle_width,
                "fork_prob": f.fork_prob, "chunk": f.chunk,
                "max_blocks_per_seq": max_blocks, "seed": f.seed},
  }
  return {"meta": meta, "results": results, "summary": summary}


def main(f: Config, out):
  """Runs with settings `f` into `out` (the `common.run_app` main)."""
  result = run(f)
  results, summary = result["results"], result["summary"]
  first, last = results[0], results[-1]
  common.write_json(out / "block_manager_bench.json", result)
  _plot(results, out / "block_manager_bench.png", f.batch)
  table_rows = [[r["num_blocks"], r["jit_append_us"], r["jit_append_no_donate_us"],
                 r["jit_fused_step_us"], r["host_append_us"], r["host_append_plus_upload_us"],
                 r["jit_over_host_append"]] for r in results]
  print()
  print(common.table(table_rows, ["num_blocks", "jit append us", "no-donate us", "fused us",
                            "host append us", "host+upload us", "jit/host"], digits=1))
  print(f"\ntime ratio {last['num_blocks']} / {first['num_blocks']} blocks: "
        f"jit append {summary['scaling_jit_append']:.2f}x (target <= 2x), "
        f"fused step {summary['scaling_jit_fused_step']:.2f}x, "
        f"no donation {summary['scaling_jit_append_no_donate']:.2f}x, "
        f"host append {summary['scaling_host_append']:.2f}x")


def _plot(results, path, batch):
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  nb = [r["num_blocks"] for r in results]
  for key, label in [("jit_append_us", "jit append (donated)"),
                     ("jit_append_no_donate_us", "jit append (not donated)"),
                     ("jit_fused_step_us", "jit recycle+append (donated)"),
                     ("host_append_us", "host Python append"),
                     ("host_append_plus_upload_us", "host append + table upload")]:
    ax.plot(nb, [r[key] for r in results], marker="o", label=label)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("num_blocks in the pool")
  ax.set_ylabel("median time per step (us)")
  ax.set_title(f"Block bookkeeping per decode step, batch {batch}")
  ax.legend(fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  common.save_png(fig, path)


if __name__ == "__main__":
  common.run_app(main, Config)
