"""Tests of tools/bazel_pytest_main.py, the pytest runner behind every Bazel py_test.

Each case writes a small test file, runs the runner on it in a fresh interpreter (as Bazel
does) and checks the exit status: a runner that reports success when a test failed, or when
nothing ran, would make every Bazel target meaningless.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

RUNNER = pathlib.Path(__file__).with_name("bazel_pytest_main.py")

PASSING = """
def test_sum():
  assert sum(range(5)) == 10
"""
FAILING = """
def test_sum():
  assert sum(range(5)) == 11
"""
ONLY_SLOW = """
import pytest

@pytest.mark.slow
def test_wide_grid():
  assert False, "slow test ran without PAGED_JAX_RUN_SLOW"
"""
NO_TESTS = """
def helper():
  return 1
"""
ABSLTEST_CLASS = """
from absl.testing import absltest

class SumTest(absltest.TestCase):
  def test_sum(self):
    self.assertEqual(sum(range(5)), 11)
"""


def _run(tmp_path, source, **env_overrides):
  """Runs the runner on a test file holding `source`; returns (exit code, output)."""
  test_file = tmp_path / "sample_test.py"
  test_file.write_text(textwrap.dedent(source))
  (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
  env = {k: v for k, v in os.environ.items()
         if k not in ("PAGED_JAX_RUN_SLOW", "TESTBRIDGE_TEST_ONLY", "XML_OUTPUT_FILE")}
  env["TEST_TMPDIR"] = str(tmp_path / "tmp")
  env.update(env_overrides)
  result = subprocess.run([sys.executable, str(RUNNER), "sample_test.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
  return result.returncode, result.stdout + result.stderr


def test_passing_file_exits_zero(tmp_path):
  code, output = _run(tmp_path, PASSING)
  assert code == 0, output
  assert "1 passed" in output


def test_failing_file_exits_nonzero(tmp_path):
  code, output = _run(tmp_path, FAILING)
  assert code == 1, output


def test_absltest_class_failure_is_reported(tmp_path):
  code, output = _run(tmp_path, ABSLTEST_CLASS)
  assert code == 1, output


def test_file_without_tests_fails(tmp_path):
  code, output = _run(tmp_path, NO_TESTS)
  assert code == 5, output
  assert "no tests found" in output


def test_slow_tests_skipped_by_default(tmp_path):
  code, output = _run(tmp_path, ONLY_SLOW)
  assert code == 0, output
  assert "deselected" in output


def test_slow_tests_run_with_config_slow(tmp_path):
  code, output = _run(tmp_path, ONLY_SLOW, PAGED_JAX_RUN_SLOW="1")
  assert code == 1, output
  assert "slow test ran" in output


def test_filter_that_matches_nothing_fails(tmp_path):
  code, output = _run(tmp_path, PASSING, TESTBRIDGE_TEST_ONLY="no_such_test")
  assert code == 5, output


def test_junit_xml_written_for_bazel(tmp_path):
  xml_path = tmp_path / "result.xml"
  code, output = _run(tmp_path, FAILING, XML_OUTPUT_FILE=str(xml_path))
  assert code == 1, output
  assert 'failures="1"' in xml_path.read_text()


def test_missing_file_is_named(tmp_path):
  result = subprocess.run([sys.executable, str(RUNNER), "no_such_test.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode != 0
  assert "no_such_test.py" in result.stderr


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))


MODULE_SKIP = """
import pytest
pytest.importorskip("a_module_that_is_not_installed_here")

def test_needs_it():
  assert False, "ran without its optional dependency"
"""


def test_module_skipped_for_missing_optional_dependency_passes(tmp_path):
  code, out = _run(tmp_path, MODULE_SKIP)
  assert code == 0, out
  assert "skipped itself" in out and "ran without" not in out


def test_no_test_file_imports_another():
  # Bazel gives each tests/<name>_test.py a target of its own whose deps are the helper
  # modules only (tests/BUILD), so `import other_test` passes under `make test` and fails
  # to collect under Bazel. Shared helpers belong in a non-test module of tests/.
  import ast
  tests_dir = pathlib.Path(__file__).resolve().parent.parent / "tests"
  offenders = []
  for path in sorted(tests_dir.glob("*_test.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0].endswith("_test")]
  assert not offenders, offenders
