"""experiments.common: timing helpers against a fake clock (no wall-clock assertions)."""
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common


class FakeClock:
  """Stands in for time.perf_counter: time moves only when a timed function says so."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now

  def taking(self, seconds):
    def f(x):
      self.now += seconds
      return x
    return f


@pytest.fixture
def clock():
  return FakeClock()


def test_time_interleaved_medians_are_per_call_durations(clock):
  x = jnp.asarray(np.random.default_rng(0).normal(size=4), jnp.float32)
  res = common.time_interleaved({"short": (clock.taking(0.004), (x,)),
                                 "long": (clock.taking(0.012), (x,))}, repeats=5, calls=2,
                                clock=clock)
  for name, seconds in (("short", 0.004), ("long", 0.012)):
    assert res[name]["samples"] == 5
    assert res[name]["min_s"] == pytest.approx(seconds)
    assert res[name]["median_s"] == pytest.approx(seconds)


def test_time_interleaved_reports_a_failing_method_and_times_the_rest(clock):
  calls = []

  def broken(x):
    calls.append(1)
    raise ValueError("bad shape")

  x = jnp.ones(3)
  res = common.time_interleaved({"broken": (broken, (x,)), "ok": (clock.taking(0.001), (x,))},
                                repeats=3, calls=1, clock=clock)
  assert res["broken"] == {"error": "ValueError: bad shape"}
  assert len(calls) == 1   # dropped after its failed warm-up, never timed
  assert res["ok"]["samples"] == 3 and res["ok"]["median_s"] == pytest.approx(0.001)


def test_time_interleaved_calls_per_sample_and_results():
  # Each sample runs `calls` back-to-back calls: warm-up 2 + repeats * calls in total.
  count = []
  f = jax.jit(lambda x: x * 2)

  def counted(x):
    count.append(1)
    return f(x)

  common.time_interleaved({"f": (counted, (jnp.ones(8),))}, repeats=4, calls=3)
  assert len(count) == 2 + 4 * 3
  t = common.time_call(f, (jnp.ones(8),), repeats=3, calls=1)
  assert set(t) == {"median_s", "min_s", "samples"} and t["samples"] == 3


def test_copy_bandwidth_is_bytes_over_time():
  ticks = iter(np.arange(0.0, 100.0, 0.25))   # every clock read is 0.25 s after the last
  nbytes = 1 << 22
  # One call per sample: 0.25 s for 2 * nbytes moved (read + write).
  assert common.copy_bandwidth(repeats=3, calls=1, nbytes=nbytes,
                               clock=lambda: float(next(ticks))) == 2 * nbytes / 0.25


if __name__ == "__main__":
  pytest.main([__file__, "-q"])


def test_run_metadata_names_the_code_it_ran():
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  flags.DEFINE_integer("seed", 3, "a seed", flag_values=fv)
  fv(["prog"])
  meta = common.run_metadata(fv)
  assert meta["flags"] == {"seed": 3}
  code = meta["code"]
  assert set(code) == {"git_commit", "dirty"}
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(__file__),
                        capture_output=True, text=True, check=False)
  if head.returncode == 0:      # a checkout (CI's clean clone is one)
    assert code["git_commit"] == head.stdout.strip()
    assert isinstance(code["dirty"], bool)


def test_code_version_dirty_counts_code_not_results_or_docs(tmp_path):
  def git(*args):
    return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
  try:
    if git("init", "-q").returncode != 0:
      pytest.skip("git cannot make a repository here")
  except OSError:
    pytest.skip("git is not installed")
  (tmp_path / "experiments" / "results").mkdir(parents=True)
  files = {"lib.py": "x = 1\n", "README.md": "doc\n", "experiments/results/r.json": "{}\n"}
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  git("add", ".")
  if git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init").returncode:
    pytest.skip("git cannot commit here")
  assert common.code_version(str(tmp_path))["dirty"] is False
  (tmp_path / "README.md").write_text("edited\n")
  (tmp_path / "experiments" / "results" / "r.json").write_text('{"new": 1}\n')
  (tmp_path / "scratch.py").write_text("untracked\n")
  assert common.code_version(str(tmp_path))["dirty"] is False
  (tmp_path / "lib.py").write_text("x = 2\n")
  assert common.code_version(str(tmp_path)) == {
      "git_commit": git("rev-parse", "HEAD").stdout.strip(), "dirty": True}


def test_run_app_records_the_code_read_when_the_run_started(monkeypatch):
  # Inside run_app, code_version() is the reading taken at start: a run that outlives a
  # commit (or git itself) still names the code it ran.
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  seen = {}

  def main(f, out):
    del f, out
    def no_git(*a, **k):
      raise OSError("git vanished")
    monkeypatch.setattr(subprocess, "run", no_git)
    seen["code"] = common.code_version()

  at_start = common.code_version()
  with pytest.raises(SystemExit) as done:     # absl's app.run exits when main returns
    common.run_app(main, lambda: flags.DEFINE_integer("seed", 0, "", flag_values=fv),
                   flag_values=fv, argv=["prog", "--compilation_cache=none"])
  assert not done.value.code
  assert seen["code"] == at_start
