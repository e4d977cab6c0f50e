"""experiments.task_graph: the schedule (longest path first, inputs before their
users), results handed between parts, and failures / Ctrl-C in spawned workers."""

import multiprocessing
import os

import pytest

from experiments import task_graph
from experiments.task_graph import Task


def _graph():
  # a (10) -> c (5); b (12) alone; d (1) -> e (20): priorities a 15, b 12, c 5, d 21, e 20.
  return [Task("a", dict, kwargs={"x": 1}, cost=10.0), Task("b", dict, cost=12.0),
          Task("c", dict, inputs={"up": "a"}, cost=5.0), Task("d", dict, cost=1.0),
          Task("e", dict, inputs={"up": "d"}, cost=20.0)]


def test_priorities_are_the_longest_path_to_the_end():
  assert task_graph.priorities(_graph()) == {"a": 15.0, "b": 12.0, "c": 5.0, "d": 21.0,
                                             "e": 20.0}


def test_simulate_runs_the_longest_path_first_and_respects_inputs():
  sim = task_graph.simulate(_graph(), jobs=2)
  starts = {name: (w, t0, t1) for name, w, t0, t1 in sim["order"]}
  assert [o[0] for o in sim["order"]] == ["d", "a", "e", "b", "c"]
  assert starts["e"][1] == starts["d"][2] and starts["c"][1] >= starts["a"][2]
  # d 0-1, e 1-21, c 21-26 on one worker; a 0-10, b 10-22 on the other.
  assert sim["makespan"] == 26.0 and sim["total"] == 48.0
  assert task_graph.simulate(_graph(), jobs=1)["makespan"] == 48.0


def test_bad_graphs_are_one_line_errors():
  with pytest.raises(ValueError, match="task 'c' needs 'zz', which is not a task"):
    task_graph.priorities([Task("c", dict, inputs={"u": "zz"})])
  with pytest.raises(ValueError, match="cycle through"):
    task_graph.priorities([Task("a", dict, inputs={"u": "b"}), Task("b", dict, inputs={"u": "a"})])
  with pytest.raises(ValueError, match="unique"):
    task_graph.priorities([Task("a", dict), Task("a", dict)])
  with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
    task_graph.run(_graph(), 0)


@pytest.mark.parametrize("jobs", [1, 2])
def test_run_hands_inputs_to_their_users_and_reports_each_part(jobs):
  events = []
  out = task_graph.run(_graph(), jobs, on_event=lambda k, n, i: events.append((k, n, i)))
  assert out["a"] == {"x": 1} and out["c"] == {"up": {"x": 1}} and out["e"] == {"up": {}}
  done = [n for k, n, _ in events if k == "done"]
  assert sorted(done) == ["a", "b", "c", "d", "e"]
  assert done.index("a") < done.index("c") and done.index("d") < done.index("e")
  for k, n, info in events:
    assert info["worker"] in range(jobs)
    if k == "done":
      assert info["result"] == out[n] and info["seconds"] >= 0 and info["cpu_s"] >= 0
  if jobs == 2:
    assert {i["pid"] for k, _, i in events if k == "done"} - {os.getpid()}
  assert not multiprocessing.active_children()


def test_a_failing_part_fails_the_run_naming_it():
  tasks = [Task("fine", dict), Task("bad", int, args=("x",), cost=5.0),
           Task("after", dict, inputs={"u": "bad"})]
  with pytest.raises(task_graph.TaskFailed,
                     match=r"part bad failed: ValueError: invalid literal for int\(\)"):
    task_graph.run(tasks, 2)
  assert not multiprocessing.active_children()
  with pytest.raises(task_graph.TaskFailed, match="part bad failed: ValueError"):
    task_graph.run(tasks, 1)


def test_a_worker_that_dies_fails_the_run_naming_its_part():
  tasks = [Task("dies", os._exit, args=(3,)), Task("fine", dict)]
  with pytest.raises(task_graph.TaskFailed, match="part dies failed: its worker process "
                     "exited with code 3"):
    task_graph.run(tasks, 2)
  assert not multiprocessing.active_children()


def test_an_interrupt_terminates_the_workers():
  import time   # pylint: disable=g-import-not-at-top
  tasks = [Task("slow1", time.sleep, args=(60,)), Task("slow2", time.sleep, args=(60,))]
  started = []

  def on_event(kind, name, info):
    started.append(name)
    if len(started) == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    task_graph.run(tasks, 2, on_event=on_event)
  assert not multiprocessing.active_children()


def test_a_worker_over_its_map_bound_is_replaced():
  tasks = [Task(f"p{i}", dict, cost=10.0 - i) for i in range(3)]
  events = []
  task_graph.run(tasks, 2, retire_maps=1, on_event=lambda k, n, i: events.append((k, n, i)))
  pids = [i["pid"] for k, _, i in events if k == "done"]
  assert len(set(pids)) == 3          # every part ran in a fresh process
  assert all(i["retired"] for k, _, i in events if k == "done")
