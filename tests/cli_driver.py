"""Runs experiment CLIs on many argument lists in one process, as `python -m` would.

    python tests/cli_driver.py '[["experiments.generate", ["--max_tokens=-1"]], ...]'

prints a JSON list of {"rc", "stdout", "stderr"}, one per case. The heavy imports (jax,
the engine, the experiments) happen once here; each case then runs in a forked child
(`runpy` with run_name="__main__", so absl's app.run and the flag definitions are fresh),
which makes a dozen CLI error cases cost one interpreter start instead of twelve.
"""

import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings


def run_case(module: str, args) -> dict:
  """Exit status, stdout and stderr of `python -m module *args` in a forked child."""
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    pid = os.fork()
    if pid == 0:   # child: never returns
      os.dup2(out.fileno(), 1)
      os.dup2(err.fileno(), 2)
      sys.argv = [module, *args]
      code = 0
      try:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
        runpy.run_module(module, run_name="__main__", alter_sys=True)
      except SystemExit as e:
        if isinstance(e.code, str):      # what the interpreter does with sys.exit("msg")
          print(e.code, file=sys.stderr)
          code = 1
        else:
          code = e.code or 0
      except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        code = 2
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    return {"rc": os.waitstatus_to_exitcode(status), "stdout": out.read().decode(),
            "stderr": err.read().decode()}


def main():
  cases = json.loads(sys.argv[1])
  sys.path.insert(0, os.getcwd())
  import jax  # pylint: disable=g-import-not-at-top,unused-import
  for module, _ in cases:
    __import__(module)
  import paged_jax.engine  # pylint: disable=g-import-not-at-top,unused-import
  results = [run_case(module, args) for module, args in cases]
  sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
  main()
