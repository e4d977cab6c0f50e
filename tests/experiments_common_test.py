"""experiments.common / configs / provenance: a Config's flags, one-line errors, run metadata."""
import json
import os
import subprocess

import dataclasses
import types
from typing import Dict, Optional, Tuple

import pytest

from experiments import common
from experiments import configs
from experiments import provenance


def test_run_metadata_names_the_code_it_ran():
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  flags.DEFINE_integer("seed", 3, "a seed", flag_values=fv)
  fv(["prog"])
  meta = provenance.run_metadata(fv)
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
  assert provenance.code_version(str(tmp_path))["dirty"] is False
  (tmp_path / "README.md").write_text("edited\n")
  (tmp_path / "experiments" / "results" / "r.json").write_text('{"new": 1}\n')
  (tmp_path / "scratch.py").write_text("untracked\n")
  assert provenance.code_version(str(tmp_path))["dirty"] is False
  (tmp_path / "lib.py").write_text("x = 2\n")
  assert provenance.code_version(str(tmp_path)) == {
      "git_commit": git("rev-parse", "HEAD").stdout.strip(), "dirty": True}


def test_run_app_records_the_code_read_when_the_run_started(monkeypatch):
  # Inside run_app, code_version() is the reading taken at start: a run that outlives a
  # commit (or git itself) still names the code it ran.
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  seen = {}

  def main(config, out):
    del config, out
    def no_git(*a, **k):
      raise OSError("git vanished")
    monkeypatch.setattr(subprocess, "run", no_git)
    seen["code"] = provenance.code_version()

  at_start = provenance.code_version()
  with pytest.raises(SystemExit) as done:     # absl's app.run exits when main returns
    common.run_app(main, Settings, flag_values=fv, argv=["prog", "--compilation_cache=none"])
  assert not done.value.code
  assert seen["code"] == at_start


@dataclasses.dataclass(frozen=True)
class Settings(configs.ExperimentConfig):
  """A Config with one field of every kind run_app turns into a flag."""
  seed: int = configs.flag(0, "a seed")
  count: int = configs.flag(3, "a count", lower=1, upper=8)
  rate: float = configs.flag(0.5, "a fraction", lower=0.0, upper=1.0, upper_open=True)
  mode: str = configs.flag("a", "a mode", choices=("a", "b"))
  fast: bool = configs.flag(False, "a switch")
  sizes: Tuple[int, ...] = configs.flag((4, 16), "sizes", lower=1)
  names: Optional[Tuple[str, ...]] = configs.flag(None, "names", choices=("x", "y"))
  budget: Dict[str, int] = configs.flag({"x": 2}, "per-name counts", lower=0)
  label: Optional[str] = configs.flag(None, "a label")

  def check(self):
    if self.fast and self.count > 4:
      raise ValueError(f"--fast needs --count <= 4, got {self.count}")


def _parsed(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  configs.define_flags(Settings, fv)
  fv(["prog", *argv])
  return configs.from_flags(Settings, fv)


def test_flags_round_trip_to_a_config():
  assert _parsed([]) == Settings()
  got = _parsed(["--count=8", "--rate=0", "--mode=b", "--fast", "--count=4", "--sizes=1,2",
                 "--names=y,x", "--budget=x:0,y:5", "--label=hi"])
  assert got == Settings(count=4, rate=0.0, mode="b", fast=True, sizes=(1, 2),
                         names=("y", "x"), budget={"x": 0, "y": 5}, label="hi")
  assert _parsed(["--sizes="]).sizes == ()
  # Code gets the same normalization as the command line: lists become tuples.
  assert Settings(sizes=[2, 3]).sizes == (2, 3) and Settings(rate=0).rate == 0.0


@pytest.mark.parametrize("kw,message", [
    ({"count": 0}, "--count must be an int in [1, 8], got 0"),
    ({"count": 2.0}, "--count must be an int in [1, 8], got 2.0"),
    ({"rate": 1.0}, "--rate must be a finite number in [0, 1), got 1.0"),
    ({"rate": float("nan")}, "--rate must be a finite number in [0, 1), got nan"),
    ({"mode": "c"}, "--mode must be one of a, b, got 'c'"),
    ({"sizes": (4, 0)}, "--sizes must be an int >= 1, got 0"),
    ({"sizes": "4"}, "--sizes must be a list of an int >= 1"),
    ({"names": ("z",)}, "--names must be one of x, y, got 'z'"),
    ({"budget": {"x": -1}}, "--budget[x] must be an int >= 0, got -1"),
    ({"fast": True, "count": 5}, "--fast needs --count <= 4, got 5"),
])
def test_bad_values_name_the_flag_and_the_allowed_range(kw, message):
  with pytest.raises(ValueError) as e:
    Settings(**kw)
  assert str(e.value).startswith(message)


def test_bad_list_elements_from_the_command_line():
  with pytest.raises(ValueError, match="--sizes: 'x' is not an int"):
    _parsed(["--sizes=4,x"])
  with pytest.raises(ValueError, match="--budget must be comma-separated key:value pairs"):
    _parsed(["--budget=x"])


def test_help_shows_each_flag_with_its_allowed_values():
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  configs.define_flags(Settings, fv)
  text = common.short_help("Does a thing.\n\nMore.", fv)
  assert text.splitlines()[0] == "Does a thing."
  assert "  --count=3  a count [an int in [1, 8]]" in text
  assert "  --mode=a  a mode [one of a, b]" in text


def test_run_metadata_records_the_config():
  meta = provenance.run_metadata(Settings(count=5), packages=("numpy",))
  assert meta["flags"]["count"] == 5 and list(meta["flags"]) == sorted(meta["flags"])
  assert "numpy" in meta["versions"] and {"machine", "code"} <= set(meta)



def test_timed_result_and_report_close_a_run(tmp_path, capsys):
  result = common.timed_result(lambda: {"rows": [1, 2]}, Settings(count=5))
  assert result["rows"] == [1, 2] and result["seconds"] >= 0
  assert result["flags"]["count"] == 5 and {"versions", "machine", "code"} <= set(result)
  assert common.report(result, None, "r.json", [["a", 1]], ["name", "n"], ["closing"]) is None
  printed = capsys.readouterr().out.splitlines()
  assert printed[-1] == "closing" and "| a" in printed[-2]
  path = common.report(result, tmp_path, "r.json", [], ["name"], wrote_suffix=" (plot)")
  assert capsys.readouterr().out.splitlines()[-1] == f"wrote {path} (plot)"
  assert json.loads(path.read_text())["rows"] == [1, 2]

@dataclasses.dataclass(frozen=True)
class WordSettings(configs.ExperimentConfig):
  rates: Tuple[float, ...] = configs.flag((1.0,), "rates", lower=0.0, lower_open=True,
                                          words=("auto",))
  limit: float = configs.flag(2.0, "a number or off", lower=0.0, words=("off",))


def test_numeric_flags_may_take_their_words():
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FlagValues()
  configs.define_flags(WordSettings, fv)
  fv(["prog", "--rates=auto", "--limit=off"])
  assert configs.from_flags(WordSettings, fv) == WordSettings(rates=("auto",), limit="off")
  fv = flags.FlagValues()
  configs.define_flags(WordSettings, fv)
  fv(["prog", "--rates=2,3.5", "--limit=0.5"])
  assert configs.from_flags(WordSettings, fv) == WordSettings(rates=(2.0, 3.5), limit=0.5)
  with pytest.raises(ValueError, match=r"--rates must be a finite number > 0 or auto, got 'x'"):
    WordSettings(rates=("x",))
  fv = flags.FlagValues()
  configs.define_flags(WordSettings, fv)
  fv(["prog", "--rates=fast"])
  with pytest.raises(ValueError, match="--rates: 'fast' is not a number"):
    configs.from_flags(WordSettings, fv)


def test_compile_each_records_a_failure_and_runs_the_rest(capsys):
  cases = [types.SimpleNamespace(name=n) for n in ("a", "bad", "c")]

  def measure(case):
    if case.name == "bad":
      raise ValueError("no\nspace")
    return {"case": case.name, **({"compile_s": 9.0} if case.name == "c" else {})}

  rows, failures = common.compile_each(cases, measure)
  assert [r["case"] for r in rows] == ["a", "c"]
  assert rows[0]["compile_s"] >= 0 and rows[1]["compile_s"] == 9.0   # measure's own kept
  assert failures == [{"case": "bad", "error": "no space"}]
  assert "FAILED bad: no space" in capsys.readouterr().out
  assert common.mib(3 * 2**20) == 3.0 and common.mib(None) is None
