r"""Block-manager scaling: jitted functional append vs a host-side Python allocator.

    python -m experiments.block_manager_bench --batch=256 \
        --num_blocks_list=1024,16384,262144,1048576 --iters=1000 --out=results/block_manager

A decode-like workload: `batch` sequence slots, each grows by one token per step
(block_size 16, so about batch/16 slots cross a block boundary every step); a
sequence that reaches its target length (at most 64 tokens, so even the 1K pool
never runs dry) is freed and its slot re-allocated with a new prompt. The same
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

Each call is timed alone with `block_until_ready`; medians over `--iters` steps
after `--warmup` steps. Writes DIR/block_manager_bench.json and
DIR/block_manager_bench.png and prints a table.
"""

from __future__ import annotations

import collections
import datetime
import os
import platform
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, OK

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 256, "Sequence slots, all decoding every step.")
flags.DEFINE_list("num_blocks_list", ["1024", "16384", "262144", "1048576"],
                  "Pool sizes (blocks) to time.")
flags.DEFINE_integer("iters", 1000, "Timed steps per variant.")
flags.DEFINE_integer("warmup", 100, "Untimed steps before timing (compile + caches).")
flags.DEFINE_integer("block_size", 16, "Tokens per block.")
flags.DEFINE_integer("max_len", 64, "Longest sequence (tokens) before it is recycled.")
flags.DEFINE_integer("recycle_width", 64, "Static width of the free/allocate slot vector.")
flags.DEFINE_integer("seed", 0, "Schedule seed.")
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


class HostAllocator:
  """The host-side way: deque free list, ref-count list, block list per sequence."""

  def __init__(self, num_blocks, max_seqs, block_size):
    self.block_size = block_size
    self.free_ids = collections.deque(range(num_blocks))
    self.ref = [0] * num_blocks
    self.tables = [[] for _ in range(max_seqs)]
    self.lens = [0] * max_seqs

  def allocate(self, slot, num_tokens):
    need = -(-num_tokens // self.block_size)
    if need > len(self.free_ids):
      raise RuntimeError("out of blocks")
    table = self.tables[slot]
    for _ in range(need):
      b = self.free_ids.popleft()
      self.ref[b] = 1
      table.append(b)
    self.lens[slot] = num_tokens

  def free(self, slot):
    for b in reversed(self.tables[slot]):
      self.ref[b] -= 1
      if self.ref[b] == 0:
        self.free_ids.append(b)
    self.tables[slot] = []
    self.lens[slot] = 0

  def fork(self, src, dst):
    self.tables[dst] = list(self.tables[src])
    for b in self.tables[dst]:
      self.ref[b] += 1
    self.lens[dst] = self.lens[src]

  def append(self, slots):
    """One token per slot; new block at a boundary, copy-on-write if shared."""
    bs, ref, tables, lens, free_ids = self.block_size, self.ref, self.tables, self.lens, self.free_ids
    cow = []
    for s in slots:
      n = lens[s]
      table = tables[s]
      if n % bs == 0:
        if not free_ids:
          raise RuntimeError("out of blocks")
        b = free_ids.popleft()
        ref[b] = 1
        table.append(b)
      elif ref[table[-1]] > 1:
        b = free_ids.popleft()
        ref[b] = 1
        ref[table[-1]] -= 1
        cow.append((table[-1], b))
        table[-1] = b
      lens[s] = n + 1
    return cow

  def table_array(self, max_blocks):
    out = np.full((len(self.tables), max_blocks), -1, np.int32)
    for s, t in enumerate(self.tables):
      out[s, :len(t)] = t
    return out


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


def bench_jit(cfg, init_lens, sched, warmup, donate, with_fork):
  """Separate recycle and append calls. Returns (append s, recycle s per step, copies, state)."""
  kw = {"donate_argnums": 0} if donate else {}

  def append(st, mask):
    st, status, cow = bm.append(st, mask, 1)
    return st, jnp.max(status), jnp.sum(cow[:, 0] >= 0)

  append = jax.jit(append, **kw)
  recycle = jax.jit(_recycle_fn(with_fork), **kw)
  state = _initial_state(cfg, init_lens)
  mask = jnp.ones((cfg.max_seqs,), bool)
  rows = jax.block_until_ready(_steps(sched))
  t_append, t_recycle, statuses, copies = [], [], [], []
  for t in common.progress(range(len(rows)), desc=f"jit donate={donate}"):
    t0 = time.perf_counter()
    state, st_r = jax.block_until_ready(recycle(state, rows[t]))
    t1 = time.perf_counter()
    state, st_a, n_cow = jax.block_until_ready(append(state, mask))
    t2 = time.perf_counter()
    statuses += [st_r, st_a]
    copies.append(n_cow)
    if t >= warmup:
      t_recycle.append(t1 - t0)
      t_append.append(t2 - t1)
  worst = int(np.max(np.asarray(statuses)))
  assert worst == OK, f"a jitted op failed with status {worst}"
  return t_append, t_recycle, int(np.sum(np.asarray(copies))), state


def bench_fused(cfg, init_lens, sched, warmup, with_fork):
  """Recycle + append in one donated jit (the engine's shape of the work)."""
  recycle = _recycle_fn(with_fork)

  def step(st, row, mask):
    st, _ = recycle(st, row)
    st, status, cow = bm.append(st, mask, 1)
    return st, status, cow

  step = jax.jit(step, donate_argnums=0)
  state = _initial_state(cfg, init_lens)
  mask = jnp.ones((cfg.max_seqs,), bool)
  rows = jax.block_until_ready(_steps(sched))
  times = []
  for t in common.progress(range(len(rows)), desc="jit fused"):
    t0 = time.perf_counter()
    state, _, _ = jax.block_until_ready(step(state, rows[t], mask))
    if t >= warmup:
      times.append(time.perf_counter() - t0)
  return times


def bench_host(cfg, init_lens, sched, warmup):
  """Returns per-step seconds (append, recycle, append + table upload), copies, allocator."""
  host = HostAllocator(cfg.num_blocks, cfg.max_seqs, cfg.block_size)
  for s, n in enumerate(init_lens.tolist()):
    host.allocate(s, n)
  slots = list(range(cfg.max_seqs))
  t_append, t_recycle, t_upload, copies = [], [], [], 0
  device = jax.devices()[0]
  plain = {k: v.tolist() for k, v in sched.items()}
  for t in common.progress(range(len(plain["free"])), desc="host"):
    free = [s for s in plain["free"][t] if s >= 0]
    alloc = [(s, n) for s, n in zip(plain["alloc"][t], plain["prompt"][t]) if s >= 0]
    forks = [(s, d) for s, d in zip(plain["fork_src"][t], plain["fork_dst"][t]) if d >= 0]
    t0 = time.perf_counter()
    for s in free:
      host.free(s)
    for s, n in alloc:
      host.allocate(s, n)
    for s, d in forks:
      host.fork(s, d)
    t1 = time.perf_counter()
    copies += len(host.append(slots))
    t2 = time.perf_counter()
    jax.block_until_ready(jax.device_put(host.table_array(cfg.max_blocks_per_seq), device))
    t3 = time.perf_counter()
    if t >= warmup:
      t_recycle.append(t1 - t0)
      t_append.append(t2 - t1)
      t_upload.append(t3 - t1)
  return t_append, t_recycle, t_upload, copies, host


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


def main(argv):
  del argv
  cores = _pin_cores(FLAGS.cpu_cores)
  out = common.out_dir(FLAGS.out)
  batch, bs = FLAGS.batch, FLAGS.block_size
  steps = FLAGS.warmup + FLAGS.iters
  with_fork = FLAGS.fork_prob > 0
  init_lens, sched = make_schedule(batch, steps, FLAGS.max_len, FLAGS.recycle_width,
                                   FLAGS.seed, FLAGS.fork_prob)
  # Two blocks of slack: a recycle deferred by a full --recycle_width overshoots max_len.
  max_blocks = -(-FLAGS.max_len // bs) + 2
  rows, results = [], []
  for nb in [int(x) for x in FLAGS.num_blocks_list]:
    if nb < batch * (-(-FLAGS.max_len // bs)):
      raise ValueError(f"num_blocks={nb} is too small for batch={batch} at max_len={FLAGS.max_len}")
    cfg = CacheConfig(block_size=bs, num_blocks=nb, max_seqs=batch, max_blocks_per_seq=max_blocks)
    spread = {}
    j_app, j_rec, j_copies, state = bench_jit(cfg, init_lens, sched, FLAGS.warmup, True,
                                              with_fork)
    n_app, n_rec, _, _ = bench_jit(cfg, init_lens, sched, FLAGS.warmup, False, with_fork)
    fused = bench_fused(cfg, init_lens, sched, FLAGS.warmup, with_fork)
    h_app, h_rec, h_upload, h_copies, host = bench_host(cfg, init_lens, sched, FLAGS.warmup)
    assert j_copies == h_copies, (j_copies, h_copies)  # same copy-on-write work
    j_app, j_rec = _median_us(j_app, spread, "jit_append"), _median_us(j_rec, spread, "jit_recycle")
    n_app, n_rec = (_median_us(n_app, spread, "jit_append_no_donate"),
                    _median_us(n_rec, spread, "jit_recycle_no_donate"))
    fused = _median_us(fused, spread, "jit_fused_step")
    h_app, h_rec = _median_us(h_app, spread, "host_append"), _median_us(h_rec, spread, "host_recycle")
    h_upload = _median_us(h_upload, spread, "host_append_plus_upload")
    # Both did the same bookkeeping: same lengths, same number of free blocks.
    np.testing.assert_array_equal(np.asarray(state.seq_lens), host.lens)
    assert int(state.num_free) == len(host.free_ids), (int(state.num_free), len(host.free_ids))
    r = {"num_blocks": nb, "jit_append_us": j_app, "jit_append_no_donate_us": n_app,
         "jit_recycle_us": j_rec, "jit_recycle_no_donate_us": n_rec, "jit_fused_step_us": fused,
         "host_append_us": h_app, "host_recycle_us": h_rec,
         "host_append_plus_upload_us": h_upload, "jit_over_host_append": j_app / h_app,
         "host_step_us": h_app + h_rec, "jit_fused_over_host_step": fused / (h_app + h_rec),
         "copy_on_write_copies": j_copies,
         "xla_thread_split_ops_in_append": _thread_split_ops(cfg), "spread_us": spread}
    results.append(r)
    rows.append([nb, j_app, n_app, fused, h_app, h_upload, j_app / h_app])
    print(common.table(rows[-1:], ["num_blocks", "jit append us", "no-donate us", "fused us",
                                   "host append us", "host+upload us", "jit/host"], digits=1))
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
      "command": " ".join(sys.argv),
      "flags": {"batch": batch, "block_size": bs, "iters": FLAGS.iters, "warmup": FLAGS.warmup,
                "max_len": FLAGS.max_len, "recycle_width": FLAGS.recycle_width,
                "fork_prob": FLAGS.fork_prob,
                "max_blocks_per_seq": max_blocks, "seed": FLAGS.seed},
  }
  common.write_json(out / "block_manager_bench.json",
                    {"meta": meta, "results": results, "summary": summary})
  _plot(results, out / "block_manager_bench.png", batch)
  print()
  print(common.table(rows, ["num_blocks", "jit append us", "no-donate us", "fused us",
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
  app.run(main)
