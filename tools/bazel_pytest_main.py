"""Entry point of every `py_test` in tests/BUILD: runs one test file under pytest.

Bazel's native py_test executes its `main` file as a script. The test files here are written
for pytest (plain `test_*` functions, fixtures, `@pytest.mark.slow`) and/or absltest classes;
running them directly would skip pytest-style tests, and a file without an
`if __name__ == "__main__":` runner would "pass" having run nothing. Running them through
pytest gives the same semantics as `make test` (tests/conftest.py and pytest.ini apply) and a
target can only pass if at least one test ran.

Usage (Bazel passes the file as an argument; cwd is the runfiles copy of the workspace):
  bazel_pytest_main.py tests/foo_test.py

Environment:
  PAGED_JAX_RUN_SLOW=1  also run tests marked @pytest.mark.slow (`bazel test --config=slow`)
  TESTBRIDGE_TEST_ONLY  set by `bazel test --test_filter=EXPR`; passed to pytest as `-k EXPR`
  XML_OUTPUT_FILE, TEST_TMPDIR  set by Bazel: per-test JUnit XML and a private temp directory
"""

import os
import sys

# pytest's exit code when nothing ran (no tests collected, or all of them deselected).
_NO_TESTS_RAN = 5


class _DeselectionCounter:
  """pytest plugin: counts tests deselected by `-m "not slow"` / `-k`, and whole modules
  skipped at collection (`pytest.importorskip` of an optional benchmark-only package)."""

  def __init__(self):
    self.num_deselected = 0
    self.num_module_skips = 0

  def pytest_deselected(self, items):
    self.num_deselected += len(items)

  def pytest_collectreport(self, report):
    if report.skipped:
      self.num_module_skips += 1


def _pytest_args(test_files):
  """Command-line arguments for pytest.main, derived from Bazel's test environment."""
  args = list(test_files)
  args += ["-p", "no:cacheprovider", "-q", "-rfEs"]
  if os.environ.get("PAGED_JAX_RUN_SLOW", "") not in ("1", "true", "True"):
    args += ["-m", "not slow"]
  test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
  if test_filter:
    args += ["-k", test_filter]
  xml_output = os.environ.get("XML_OUTPUT_FILE")
  if xml_output:
    args.append(f"--junitxml={xml_output}")
  tmp_dir = os.environ.get("TEST_TMPDIR")
  if tmp_dir:
    args.append(f"--basetemp={os.path.join(tmp_dir, 'pytest')}")
  return args


def main(argv):
  test_files = argv[1:]
  if not test_files:
    sys.exit("bazel_pytest_main.py: expected test file paths as arguments (see tests/BUILD)")
  missing = [path for path in test_files if not os.path.exists(path)]
  if missing:
    sys.exit(f"bazel_pytest_main.py: test files not in runfiles: {missing}")
  tmp_dir = os.environ.get("TEST_TMPDIR")
  if tmp_dir:
    # Hypothesis writes its example database next to the cwd, which is runfiles here.
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tmp_dir, "hypothesis"))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import pytest  # pylint: disable=g-import-not-at-top  (after the environment is set)

  counter = _DeselectionCounter()
  exit_code = int(pytest.main(_pytest_args(test_files), plugins=[counter]))
  if exit_code == _NO_TESTS_RAN and counter.num_deselected and not os.environ.get(
      "TESTBRIDGE_TEST_ONLY"):
    print(f"bazel_pytest_main.py: all {counter.num_deselected} selected tests were deselected "
          "(marked slow or filtered); `bazel test --config=slow` runs the slow ones.")
    exit_code = 0
  elif exit_code == _NO_TESTS_RAN and counter.num_module_skips:
    print("bazel_pytest_main.py: the test module skipped itself (an optional dependency is "
          "missing; see the skip reason above).")
    exit_code = 0
  elif exit_code == _NO_TESTS_RAN:
    print(f"bazel_pytest_main.py: no tests found in {test_files}", file=sys.stderr)
  return exit_code


if __name__ == "__main__":
  sys.exit(main(sys.argv))
