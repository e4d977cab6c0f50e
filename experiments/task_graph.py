"""A small task graph run in worker processes: independent parts of a long experiment side
by side, a part that needs another's result after it.

    tasks = [Task("a", fn_a, args=(cfg,), cost=200.0),
             Task("b", fn_b, args=(cfg,), inputs={"panel": "a"}, cost=60.0)]
    results = run(tasks, jobs=2, init=setup, init_args=(...,), on_event=print)
    # results["b"] is fn_b(cfg, panel=results["a"])
    simulate(tasks, jobs=2)        # {"makespan": s, "order": [...]}: the same schedule on `cost`

Scheduling: whenever a worker is free, the ready part (every input finished) with the
longest path to the end of the graph in `cost` seconds (its own cost plus its longest
chain of dependants) runs next; among independent parts that is longest-first. Ties go
to the earlier part in `tasks`.

Workers: `multiprocessing` processes of the 'spawn' context (JAX must not fork), each
running one part at a time; `init(*init_args)` runs once in each at start. A worker
ignores SIGINT: Ctrl-C reaches the parent, which terminates the workers and raises
KeyboardInterrupt. A part that raises (or a worker that dies) ends the run:
`TaskFailed` names the part and its error on one line (the worker prints the traceback
first); the workers still running are terminated, the results of finished parts were
already handed to `on_done`. After a part, `after_part()` (if given) runs in the worker
(e.g. dropping compiled executables); a worker whose memory maps then exceed
`retire_maps` exits and a fresh one takes its place.

With jobs=1 (or a single part) every part runs in this process, in the same order.
Functions and arguments must be picklable (module-level functions) for jobs > 1.
The scheduler of experiments/paper_scale.py (no command line of its own).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Task:
  """One part: `fn(*args, **kwargs, **{k: results[dep] for k, dep in inputs.items()})`;
  `cost` is its expected seconds (the scheduling priority)."""
  name: str
  fn: Callable[..., Any]
  args: Tuple = ()
  kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
  inputs: Dict[str, str] = dataclasses.field(default_factory=dict)
  cost: float = 1.0


class TaskFailed(RuntimeError):
  """A part raised or its worker died; `.task` is its name."""

  def __init__(self, task: str, message: str):
    super().__init__(f"part {task} failed: {message}")
    self.task = task


def default_jobs(cap: int = 8) -> int:
  """This machine's usable cores, at most `cap`."""
  try:
    n = len(os.sched_getaffinity(0))
  except AttributeError:
    n = os.cpu_count() or 1
  return max(1, min(n, cap))


def _check(tasks: Sequence[Task]) -> Dict[str, Task]:
  by = {}
  for t in tasks:
    if t.name in by:
      raise ValueError(f"task names must be unique, got {t.name!r} twice")
    by[t.name] = t
  for t in tasks:
    for dep in t.inputs.values():
      if dep not in by:
        raise ValueError(f"task {t.name!r} needs {dep!r}, which is not a task")
  return by


def priorities(tasks: Sequence[Task]) -> Dict[str, float]:
  """Each part's longest path to the end of the graph in `cost` (itself included)."""
  by = _check(tasks)
  users: Dict[str, List[str]] = {t.name: [] for t in tasks}
  for t in tasks:
    for dep in set(t.inputs.values()):
      users[dep].append(t.name)
  memo: Dict[str, float] = {}

  def level(name, stack=()):
    if name in stack:
      raise ValueError(f"task graph has a cycle through {name!r}")
    if name not in memo:
      memo[name] = by[name].cost + max((level(u, stack + (name,)) for u in users[name]),
                                       default=0.0)
    return memo[name]

  return {t.name: level(t.name) for t in tasks}


class _Ready:
  """The parts not yet started, handing out the ready one of highest priority."""

  def __init__(self, tasks: Sequence[Task]):
    self.prio = priorities(tasks)
    self.index = {t.name: i for i, t in enumerate(tasks)}
    self.waiting = list(tasks)
    self.done: set = set()

  def pop(self) -> Optional[Task]:
    ready = [t for t in self.waiting if set(t.inputs.values()) <= self.done]
    if not ready:
      return None
    best = min(ready, key=lambda t: (-self.prio[t.name], self.index[t.name]))
    self.waiting.remove(best)
    return best

  def __bool__(self):
    return bool(self.waiting)


def simulate(tasks: Sequence[Task], jobs: int) -> Dict[str, Any]:
  """The schedule `run` makes if every part takes exactly its `cost` seconds:
  {"makespan": s, "order": [(name, worker, start_s, end_s)], "total": sum of costs}."""
  if jobs < 1:
    raise ValueError(f"jobs must be >= 1, got {jobs}")
  ready, free = _Ready(tasks), [0.0] * jobs
  running: List[Tuple[float, str, int]] = []
  order, now = [], 0.0
  while ready or running:
    idle = [w for w in range(jobs) if free[w] <= now]
    started = False
    for w in idle:
      t = ready.pop()
      if t is None:
        break
      free[w] = now + t.cost
      running.append((free[w], t.name, w))
      order.append((t.name, w, now, free[w]))
      started = True
    if not running:
      if ready and not started:
        raise ValueError("task graph has parts that can never be ready")
      continue
    running.sort()
    end, name, _ = running.pop(0)
    now = end
    ready.done.add(name)
  return {"makespan": max((o[3] for o in order), default=0.0), "order": order,
          "total": sum(t.cost for t in tasks)}


def _call(task: Task, done: Dict[str, Any]) -> Any:
  kw = dict(task.kwargs, **{k: done[dep] for k, dep in task.inputs.items()})
  return task.fn(*task.args, **kw)


def _worker(conn, init, init_args, after_part, retire_maps):
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if init is not None:
    init(*init_args)
  while True:
    msg = conn.recv()
    if msg is None:
      return
    name, fn, args, kwargs = msg
    t0, c0 = time.time(), time.process_time()
    try:
      result = fn(*args, **kwargs)
    except BaseException as e:  # pylint: disable=broad-except
      traceback.print_exc()
      conn.send(("failed", name, f"{type(e).__name__}: {' '.join(str(e).split())}", None))
      return
    cost = {"seconds": time.time() - t0, "cpu_s": time.process_time() - c0,
            "load_avg_end": os.getloadavg()[0], "pid": os.getpid()}
    if after_part is not None:
      after_part()
    maps = _maps()
    cost["maps_after"] = maps
    cost["retired"] = retire_maps is not None and maps is not None and maps > retire_maps
    conn.send(("done", name, result, cost))
    if cost["retired"]:
      return


def _maps() -> Optional[int]:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
  except OSError:
    return None


def run(tasks: Sequence[Task], jobs: int, *, init: Optional[Callable] = None,
        init_args: Tuple = (), after_part: Optional[Callable] = None,
        on_event: Optional[Callable[[str, str, Dict], None]] = None,
        retire_maps: Optional[int] = None) -> Dict[str, Any]:
  """Runs every task; returns {name: result}. `on_event(kind, name, info)` is called in
  this process at "start" (info: {"worker"}) and "done" (info: {"result", "seconds",
  "cpu_s", "load_avg_end", "worker", ...}) of each part, in the order they happen.
  Raises TaskFailed (a part failed) or KeyboardInterrupt (workers terminated)."""
  if jobs < 1:
    raise ValueError(f"jobs must be >= 1, got {jobs}")
  _check(tasks)
  emit = on_event or (lambda kind, name, info: None)
  if jobs == 1 or len(tasks) <= 1:
    return _run_here(tasks, init, init_args, after_part, emit)
  return _Pool(min(jobs, len(tasks)), init, init_args, after_part, retire_maps,
               emit).run(tasks)


def _run_here(tasks, init, init_args, after_part, emit) -> Dict[str, Any]:
  del init, init_args     # this process is already set up
  ready, done = _Ready(tasks), {}
  while ready:
    t = ready.pop()
    emit("start", t.name, {"worker": 0})
    t0, c0 = time.time(), time.process_time()
    try:
      done[t.name] = _call(t, done)
    except Exception as e:  # pylint: disable=broad-except
      raise TaskFailed(t.name, f"{type(e).__name__}: {' '.join(str(e).split())}") from e
    info = {"seconds": time.time() - t0, "cpu_s": time.process_time() - c0,
            "load_avg_end": os.getloadavg()[0], "pid": os.getpid(), "worker": 0}
    if after_part is not None:
      after_part()
    ready.done.add(t.name)
    emit("done", t.name, dict(info, result=done[t.name]))
  return done


class _Pool:
  """Spawned workers, each fed one part at a time over its own pipe."""

  def __init__(self, jobs, init, init_args, after_part, retire_maps, emit):
    self.ctx = multiprocessing.get_context("spawn")
    self.jobs, self.emit = jobs, emit
    self.spec = (init, init_args, after_part, retire_maps)
    self.workers: List[Optional[Tuple[Any, Any]]] = [None] * jobs   # (process, conn)
    self.busy: Dict[int, str] = {}

  def _start(self, w: int):
    here, there = self.ctx.Pipe()
    p = self.ctx.Process(target=_worker, args=(there,) + self.spec, daemon=True,
                         name=f"task_graph-worker-{w}")
    # Started with SIGINT ignored (kept across exec): Ctrl-C during its start-up, too,
    # reaches only this process.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
      p.start()
    finally:
      signal.signal(signal.SIGINT, old)
    there.close()
    self.workers[w] = (p, here)

  def _stop(self, w: int, terminate: bool):
    if self.workers[w] is None:
      return
    p, conn = self.workers[w]
    if terminate and p.is_alive():
      p.terminate()
    else:
      try:
        conn.send(None)
      except (BrokenPipeError, OSError):
        pass
    p.join(timeout=30)
    if p.is_alive():
      p.kill()
      p.join()
    conn.close()
    self.workers[w] = None

  def run(self, tasks: Sequence[Task]) -> Dict[str, Any]:
    ready, done = _Ready(tasks), {}
    ok = False
    try:
      while ready or self.busy:
        for w in range(self.jobs):
          if w in self.busy:
            continue
          t = ready.pop()
          if t is None:
            break
          if self.workers[w] is None:
            self._start(w)
          kw = dict(t.kwargs, **{k: done[dep] for k, dep in t.inputs.items()})
          self.workers[w][1].send((t.name, t.fn, t.args, kw))
          self.busy[w] = t.name
          self.emit("start", t.name, {"worker": w})
        if not self.busy:
          raise ValueError("task graph has parts that can never be ready")
        self._wait(ready, done)
      ok = True
      return done
    finally:
      for w in range(self.jobs):
        self._stop(w, terminate=not ok)

  def _wait(self, ready: _Ready, done: Dict[str, Any]):
    by_conn = {self.workers[w][1]: w for w in self.busy}
    by_sentinel = {self.workers[w][0].sentinel: w for w in self.busy}
    for obj in connection.wait(list(by_conn) + list(by_sentinel)):
      w = by_conn.get(obj, by_sentinel.get(obj))
      if w not in self.busy:
        continue
      p, conn = self.workers[w]
      try:
        kind, name, payload, cost = conn.recv() if conn.poll() else (None,) * 4
      except (EOFError, OSError):
        kind = None
      if kind is None:
        if p.is_alive():
          continue      # its sentinel has not fired: nothing to read yet
        raise TaskFailed(self.busy[w], f"its worker process exited with code {p.exitcode}")
      if kind == "failed":
        raise TaskFailed(name, payload)
      del self.busy[w]
      done[name] = payload
      ready.done.add(name)
      if cost["retired"]:      # it exits: the next part here starts a fresh one
        p.join(timeout=60)
        conn.close()
        self.workers[w] = None
      self.emit("done", name, dict(cost, result=payload, worker=w))
