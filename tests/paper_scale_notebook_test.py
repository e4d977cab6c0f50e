"""The paper-scale notebook: paired with its jupytext .md, no logic in its cells, and it runs
(small sizes, the real engine on the model clock) via nbclient (slow: ~50 s on 2 cores).
The committed .ipynb is written by `python tools/execute_notebook.py NOTEBOOK.md`."""

import jupytext
import nbformat
import pytest

from notebook_support import NB_DIR, code_outputs, png_outputs, run_with_parameters
from notebook_support import sources, stream_text

IPYNB = NB_DIR / "paper_scale.ipynb"
MD = NB_DIR / "paper_scale.md"

# Injected after the "parameters" cell: two points per sweep, short streams.
SMALL = """WORKLOAD = "alpaca"
RATE = 20.0
BLOCK_SIZES = (16, 128)
KV_FRACTIONS = (0.5, 1.0)
NUM_REQUESTS = 40
"""


def test_ipynb_and_md_are_the_same_notebook_and_only_the_ipynb_has_outputs():
  ipynb = nbformat.read(IPYNB, as_version=4)
  assert sources(ipynb) == sources(jupytext.read(MD))
  code = [c for c in ipynb.cells if c.cell_type == "code"]
  assert all(c.outputs for c in code[2:]), "every code cell after the imports has output"
  assert "execution_count" not in MD.read_text() and "image/png" not in MD.read_text()
  for cell in code:
    assert "def " not in cell.source and "class " not in cell.source, cell.source
  for out in code_outputs(ipynb):
    assert out.output_type != "error" and "Traceback" not in out.get("text", ""), out


@pytest.mark.slow
def test_notebook_executes_at_small_sizes():
  nb = run_with_parameters(MD, SMALL, timeout_s=900)
  text = stream_text(nb)
  assert "opt-13b on 1 x a100-40gb" in text and "KV slots" in text
  assert len(png_outputs(nb)) == 2
