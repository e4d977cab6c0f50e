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
must agree on lengths, free blocks and copies. Writes
DIR/block_manager_bench.json and DIR/block_manager_bench.png and prints a table.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, OK, cdiv
from paged_jax.testing import BlockModel

FLAGS = flags.FLAGS


def _define_flags():
  """Defines this script's flags on absl's global FLAGS (only when run as a script)."""
  flags.DEFINE_integer("batch", 256, "Sequence slots, all decoding every step.")
  flags.DEFINE_list("num_blocks_list", ["1024", "16384", "262144", "1048576"],
                    "Pool sizes (blocks) to time.")
  flags.DEFINE_integer("iters", 1000, "Timed steps per variant.")
  flags.DEFINE_integer("warmup", 100, "Untimed steps before timing (compile + caches).")
  flags.DEFINE_integer("block_size", 16, "Tokens per block.")
  flags.DEFINE_integer("max_len", 64, "Longest sequence (tokens) before it is recycled.")
  flags.DEFINE_integer("recycle_width", 64, "Static width of the free/allocate slot vector.")
  flags.DEFINE_integer("seed", 0, "Schedule seed.")
  flags.DEFINE_integer("chunk", 50, "Steps each variant runs before the next takes a turn.")
  flags.DEFINE_float("fork_prob", 0.0,
                     "Chance that a recycled slot restarts as a fork of a running sequence "
                     "(sharing, then copy-on-write) instead of a new prompt.")
  flags.DEFINE_integer("cpu_cores", 1,
                       "Pin the process to this many cores before JAX starts (0: leave as is). "
                       "One core matches the single-threaded host allocator, and stops XLA:CPU "
                       "from splitting each in-place scatter over a num_blocks-long array into "
                       "thread-pool tasks (its cost model counts the array, not the updates).")
  flags.DEFINE_string("out", "results/block_manager", "Output directory.")


def make_schedule(batch, steps, max_len, width, seed, fork_prob=0.0):
  """Per step, the slots to recycle and what they restart as, padded with -1 to `width`.

  A slot is recycled the step after it reaches its target length (overflow
  beyond `width` waits a step). It restarts as a new prompt, or with
  probability `fork_prob` as a fork of another running sequence (parallel
  sampling), which then triggers copy-on-write at the next append when the
  shared last block is partially filled. Returns (init_lens i32[batch], dict of
  i32[steps, width]: free, alloc, prompt, fork_src, fork_dst).
  """
  rng = np.random.default_rng(seed)
  prompt = rng.integers(1, 17, size=batch)
  target = rng.integers(prompt + 1, max_len + 1)
  lens = rng.integers(prompt, target)  # staggered start
  init_lens = lens.copy()
  sched = {k: np.full((steps, width), -1, np.int32)
           for k in ("free", "alloc", "prompt", "fork_src", "fork_dst")}
  for t in range(steps):
    due = np.flatnonzero(lens >= target)[:width]
    forked = rng.random(due.size) < fork_prob
    running = np.setdiff1d(np.arange(batch), due)
    src = rng.choice(running, size=due.size)
    new_prompt = rng.integers(1, 17, size=due.size)
    new_len = np.where(forked, lens[src], new_prompt)
    sched["free"][t, :due.size] = due
    sched["alloc"][t, :(~forked).sum()] = due[~forked]
    sched["prompt"][t, :(~forked).sum()] = new_prompt[~forked]
    sched["fork_src"][t, :forked.sum()] = src[forked]
    sched["fork_dst"][t, :forked.sum()] = due[forked]
    lens[due] = new_len
    target[due] = rng.integers(new_len + 1, max_len + 1)
    lens += 1
  return init_lens.astype(np.int32), sched


def _median_us(times, spread=None, key=None):
  """Median in us; with `spread`, also records p10 / p90 under `key` (noise check)."""
  us = np.asarray(times) * 1e6
  if spread is not None:
    spread[key] = {"p10": float(np.percentile(us, 10)), "median": float(np.median(us)),
                   "p90": float(np.percentile(us, 90)), "n": int(us.size)}
  return float(np.median(us))


def _recycle_fn(with_fork):
  """free -> allocate (-> fork): the slot turnover of one step; returns worst status."""
  def recycle(st, sched):
    worst = jnp.int32(OK)
    st, status = bm.free(st, sched["free"])
    worst = jnp.maximum(worst, jnp.max(jnp.where(sched["free"] >= 0, status, OK)))
    st, status = bm.allocate(st, sched["alloc"], sched["prompt"])
    worst = jnp.maximum(worst, jnp.max(jnp.where(sched["alloc"] >= 0, status, OK)))
    if with_fork:  # static: the no-sharing run does not pay for fork's loop
      st, status = bm.fork(st, sched["fork_src"], sched["fork_dst"])
      worst = jnp.maximum(worst, jnp.max(jnp.where(sched["fork_dst"] >= 0, status, OK)))
    return st, worst
  return recycle


def _steps(sched):
  """Per-step device copies of the schedule rows (staged before timing)."""
  on_device = {k: jnp.asarray(v) for k, v in sched.items()}
  steps = next(iter(sched.values())).shape[0]
  return [{k: v[t] for k, v in on_device.items()} for t in range(steps)]


class JitRunner:
  """Separate recycle and append calls per step, the state donated or not."""

  def __init__(self, cfg, init_lens, rows, with_fork, donate):
    kw = {"donate_argnums": 0} if donate else {}

    def append(st, mask):
      st, status, cow = bm.append(st, mask, 1)
      return st, jnp.max(status), jnp.sum(cow[:, 0] >= 0)

    self.append = jax.jit(append, **kw)
    self.recycle = jax.jit(_recycle_fn(with_fork), **kw)
    self.state = _initial_state(cfg, init_lens)
    self.mask = jnp.ones((cfg.max_seqs,), bool)
    self.rows = rows
    self.times = {"append": [], "recycle": []}
    self.statuses, self.copies = [], []

  def step(self, t, record):
    t0 = time.perf_counter()
    self.state, st_r = jax.block_until_ready(self.recycle(self.state, self.rows[t]))
    t1 = time.perf_counter()
    self.state, st_a, n_cow = jax.block_until_ready(self.append(self.state, self.mask))
    t2 = time.perf_counter()
    self.statuses += [st_r, st_a]
    self.copies.append(n_cow)
    if record:
      self.times["recycle"].append(t1 - t0)
      self.times["append"].append(t2 - t1)

  def finish(self):
    """Checks every op succeeded; returns the number of copy-on-write copies."""
    worst = int(np.max(np.asarray(self.statuses)))
    assert worst == OK, f"a jitted op failed with status {worst}"
    return int(np.sum(np.asarray(self.copies)))


class FusedRunner:
  """Recycle + append in one donated jit (the engine's shape of the work)."""

  def __init__(self, cfg, init_lens, rows, with_fork):
    recycle = _recycle_fn(with_fork)

    def step(st, row, mask):
      st, worst = recycle(st, row)
      st, status, _ = bm.append(st, mask, 1)
      return st, jnp.maximum(worst, jnp.max(status))

    self.fn = jax.jit(step, donate_argnums=0)
    self.state = _initial_state(cfg, init_lens)
    self.mask = jnp.ones((cfg.max_seqs,), bool)
    self.rows = rows
    self.times = {"step": []}
    self.statuses = []

  def step(self, t, record):
    t0 = time.perf_counter()
    self.state, worst = jax.block_until_ready(self.fn(self.state, self.rows[t], self.mask))
    if record:
      self.times["step"].append(time.perf_counter() - t0)
    self.statuses.append(worst)

  def finish(self):
    assert int(np.max(np.asarray(self.statuses))) == OK


class HostRunner:
  """A host-side Python allocator on the same schedule (`paged_jax.testing.BlockModel`, the
  tests' oracle: lists and ints, one request at a time); "upload" adds the block-table
  transfer."""

  def __init__(self, cfg, init_lens, sched):
    self.cfg = cfg
    self.host = BlockModel.from_config(cfg)
    assert self.host.allocate(range(cfg.max_seqs), init_lens.tolist()) == [OK] * cfg.max_seqs
    self.mask, self.ones = [True] * cfg.max_seqs, [1] * cfg.max_seqs
    self.plain = {k: v.tolist() for k, v in sched.items()}
    self.device = jax.devices()[0]
    self.times = {"append": [], "recycle": [], "upload": []}
    self.copies = 0

  def step(self, t, record):
    plain, host = self.plain, self.host
    free = [s for s in plain["free"][t] if s >= 0]
    alloc = [(s, n) for s, n in zip(plain["alloc"][t], plain["prompt"][t]) if s >= 0]
    forks = [(s, d) for s, d in zip(plain["fork_src"][t], plain["fork_dst"][t]) if d >= 0]
    t0 = time.perf_counter()
    status = (host.free(free) + host.allocate([s for s, _ in alloc], [n for _, n in alloc])
              + host.fork([s for s, _ in forks], [d for _, d in forks]))
    t1 = time.perf_counter()
    grown, cow = host.append(self.mask, self.ones)
    t2 = time.perf_counter()
    tables = host.block_table_array()
    jax.block_until_ready(jax.device_put(tables, self.device))
    t3 = time.perf_counter()
    if record:
      self.times["recycle"].append(t1 - t0)
      self.times["append"].append(t2 - t1)
      self.times["upload"].append(t3 - t1)
    assert all(x == OK for x in status + grown), (t, status, grown)
    self.copies += sum(old >= 0 for old, _ in cow)


def _initial_state(cfg, init_lens):
  state = bm.init(cfg)
  state, status = jax.jit(bm.allocate)(state, jnp.arange(cfg.max_seqs, dtype=jnp.int32),
                                       jnp.asarray(init_lens))
  assert (np.asarray(status) == OK).all()
  return state


def _pin_cores(n):
  """Restricts this process to its first `n` allowed cores; returns the core list."""
  cores = sorted(os.sched_getaffinity(0))
  if n > 0:
    cores = cores[:n]
    os.sched_setaffinity(0, cores)
  return cores


def _thread_split_ops(cfg):
  """Ops XLA:CPU splits across threads in the compiled donated append (0 = none)."""
  state = bm.init(cfg)
  lowered = jax.jit(lambda st, m: bm.append(st, m, 1), donate_argnums=0).lower(
      state, jnp.ones((cfg.max_seqs,), bool))
  return lowered.compile().as_text().count("outer_dimension_partitions")


def main(f, out):
  """Runs with the parsed flags (absl's global FLAGS, read below) into `out`."""
  del f
  cores = _pin_cores(FLAGS.cpu_cores)
  batch, bs = FLAGS.batch, FLAGS.block_size
  steps = FLAGS.warmup + FLAGS.iters
  with_fork = FLAGS.fork_prob > 0
  init_lens, sched = make_schedule(batch, steps, FLAGS.max_len, FLAGS.recycle_width,
                                   FLAGS.seed, FLAGS.fork_prob)
  # Two blocks of slack: a recycle deferred by a full --recycle_width overshoots max_len.
  max_blocks = cdiv(FLAGS.max_len, bs) + 2
  sizes = [int(x) for x in FLAGS.num_blocks_list]
  runners, split_ops = {}, {}
  rows = jax.block_until_ready(_steps(sched))
  for nb in sizes:
    if nb < batch * cdiv(FLAGS.max_len, bs):
      raise ValueError(f"num_blocks={nb} is too small for batch={batch} at max_len={FLAGS.max_len}")
    cfg = CacheConfig(block_size=bs, num_blocks=nb, max_seqs=batch, max_blocks_per_seq=max_blocks)
    runners[nb] = {"jit": JitRunner(cfg, init_lens, rows, with_fork, donate=True),
                   "no_donate": JitRunner(cfg, init_lens, rows, with_fork, donate=False),
                   "fused": FusedRunner(cfg, init_lens, rows, with_fork),
                   "host": HostRunner(cfg, init_lens, sched)}
    split_ops[nb] = _thread_split_ops(cfg)
  # Interleaved in chunks of --chunk steps: each pool size and variant runs a chunk
  # in turn (rotating order), so load from other processes hits all of them alike,
  # while caches stay warm within a chunk (per-step interleaving measured cold
  # caches: the 1M-block non-donated copies alone flush them).
  order = [(nb, name) for nb in sizes for name in runners[nb]]
  chunk = max(1, FLAGS.chunk)
  for c, start in enumerate(common.progress(range(0, steps, chunk), desc="chunks")):
    k = c % len(order)
    for nb, name in order[k:] + order[:k]:
      for t in range(start, min(start + chunk, steps)):
        runners[nb][name].step(t, record=t >= FLAGS.warmup)
  table_rows, results = [], []
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
    j_app = _median_us(jit.times["append"], spread, "jit_append")
    j_rec = _median_us(jit.times["recycle"], spread, "jit_recycle")
    n_app = _median_us(nod.times["append"], spread, "jit_append_no_donate")
    n_rec = _median_us(nod.times["recycle"], spread, "jit_recycle_no_donate")
    f_step = _median_us(fused.times["step"], spread, "jit_fused_step")
    h_app = _median_us(host.times["append"], spread, "host_append")
    h_rec = _median_us(host.times["recycle"], spread, "host_recycle")
    h_upload = _median_us(host.times["upload"], spread, "host_append_plus_upload")
    results.append({
        "num_blocks": nb, "jit_append_us": j_app, "jit_append_no_donate_us": n_app,
        "jit_recycle_us": j_rec, "jit_recycle_no_donate_us": n_rec, "jit_fused_step_us": f_step,
        "host_append_us": h_app, "host_recycle_us": h_rec,
        "host_append_plus_upload_us": h_upload, "jit_over_host_append": j_app / h_app,
        "host_step_us": h_app + h_rec, "jit_fused_over_host_step": f_step / (h_app + h_rec),
        "copy_on_write_copies": j_copies, "xla_thread_split_ops_in_append": split_ops[nb],
        "spread_us": spread})
    table_rows.append([nb, j_app, n_app, f_step, h_app, h_upload, j_app / h_app])
  first, last = results[0], results[-1]
  summary = {
      "scaling_jit_append": last["jit_append_us"] / first["jit_append_us"],
      "scaling_jit_fused_step": last["jit_fused_step_us"] / first["jit_fused_step_us"],
      "scaling_jit_append_no_donate": last["jit_append_no_donate_us"] / first["jit_append_no_donate_us"],
      "scaling_host_append": last["host_append_us"] / first["host_append_us"],
      "scaling_from_to_blocks": [first["num_blocks"], last["num_blocks"]],
  }
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
      "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
      "jax": jax.__version__, "python": platform.python_version(), "cpu_cores_used": cores,
      "command": " ".join(sys.argv), "versions": common.versions(),
      "flags": {"batch": batch, "block_size": bs, "iters": FLAGS.iters, "warmup": FLAGS.warmup,
                "max_len": FLAGS.max_len, "recycle_width": FLAGS.recycle_width,
                "fork_prob": FLAGS.fork_prob, "chunk": FLAGS.chunk,
                "max_blocks_per_seq": max_blocks, "seed": FLAGS.seed},
  }
  common.write_json(out / "block_manager_bench.json",
                    {"meta": meta, "results": results, "summary": summary})
  _plot(results, out / "block_manager_bench.png", batch)
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
  common.run_app(main, _define_flags)
