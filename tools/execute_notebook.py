r"""Executes a jupytext notebook page and writes its .ipynb (outputs included) beside it.

    python tools/execute_notebook.py experiments/notebooks/paper_scale.md

The kernel runs in the repository root, so the cells import this checkout's `paged_jax` and
`experiments`. The .md stays the source (no outputs); tests check the two hold the same
cells (tests/notebook_test.py, tests/paper_scale_notebook_test.py).
"""

from __future__ import annotations

import os
import pathlib
import sys

import jupytext
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
# XLA's C++ start-up lines on a machine without CUDA (written before absl's logging starts,
# so TF_CPP_MIN_LOG_LEVEL does not hold them back): not results, dropped from the outputs.
NOISE = ("WARNING: All log messages before absl::InitializeLog()", "cudart_stub.cc")


def drop_startup_noise(nb) -> None:
  """Removes NOISE lines from the stderr outputs of `nb` (and outputs left empty)."""
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    kept = []
    for out in cell.outputs:
      if out.output_type == "stream" and out.name == "stderr":
        out.text = "".join(line for line in out.text.splitlines(keepends=True)
                           if not line.startswith(NOISE) and NOISE[1] not in line)
        if not out.text.strip():
          continue
      kept.append(out)
    cell.outputs = kept


def execute(md: pathlib.Path, timeout_s: int = 3600) -> pathlib.Path:
  """Runs every cell of `md` in a fresh python3 kernel; returns the written .ipynb path."""
  # The kernel inherits this environment: CPU JAX unless told otherwise (as `make demo`), and
  # no CUDA-plugin probing noise in the saved outputs.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  nb = jupytext.read(md)
  NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                 resources={"metadata": {"path": str(ROOT)}}).execute()
  drop_startup_noise(nb)
  out = md.with_suffix(".ipynb")
  jupytext.write(nb, out)
  return out


def main(argv) -> int:
  if len(argv) != 2 or not argv[1].endswith(".md"):
    print("usage: python tools/execute_notebook.py NOTEBOOK.md", file=sys.stderr)
    return 2
  print(f"wrote {execute(pathlib.Path(argv[1]).resolve())}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
