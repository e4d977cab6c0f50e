"""Block bookkeeping per decode step, timed: the jitted pure block manager (donated or
not, separate ops or fused) against a host-side Python allocator, on one schedule.

    init_lens, sched = block_manager_timing.make_schedule(256, 1100, 64, 64, seed=0)
    rows = block_manager_timing.device_rows(sched)          # staged before timing
    runner = block_manager_timing.JitRunner(cfg, init_lens, rows, with_fork=False, donate=True)
    for t in range(steps): runner.step(t, record=t >= warmup)
    runner.times["append"], runner.finish()                 # seconds per call; CoW copies

Runners: `JitRunner` (recycle and append as two jitted calls), `FusedRunner` (one donated
call: the engine's shape of the work), `HostRunner` (`testing.BlockModel`, the tests'
plain-Python allocator, plus the block-table upload a host allocator needs each step).
The helper of experiments/block_manager_bench.py (no command line of its own).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax.config import OK
from paged_jax.testing import BlockModel


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


def median_us(times, spread=None, key=None):
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


def device_rows(sched):
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
    self.state = initial_state(cfg, init_lens)
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
    self.state = initial_state(cfg, init_lens)
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


def initial_state(cfg, init_lens):
  state = bm.init(cfg)
  state, status = jax.jit(bm.allocate)(state, jnp.arange(cfg.max_seqs, dtype=jnp.int32),
                                       jnp.asarray(init_lens))
  assert (np.asarray(status) == OK).all()
  return state


def thread_split_ops(cfg) -> int:
  """Ops XLA:CPU splits across threads in the compiled donated append (0 = none)."""
  state = bm.init(cfg)
  lowered = jax.jit(lambda st, m: bm.append(st, m, 1), donate_argnums=0).lower(
      state, jnp.ones((cfg.max_seqs,), bool))
  return lowered.compile().as_text().count("outer_dimension_partitions")
