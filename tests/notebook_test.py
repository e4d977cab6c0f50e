"""The block-size notebook: paired with its jupytext .md, and it runs (tiny sizes) via nbclient."""

import jupytext
import nbformat
import pytest

from notebook_support import NB_DIR, png_outputs, run_with_parameters, sources, stream_text

IPYNB = NB_DIR / "block_size_sweep.ipynb"
MD = NB_DIR / "block_size_sweep.md"

# Injected after the "parameters" cell (papermill style): small enough for `make test`.
TINY = """WORKLOADS = ("alpaca",)
BLOCK_SIZES = (4, 16, 64)
NUM_REQUESTS = {"alpaca": 150}
KV_BUDGET_TOKENS = 1024
MAX_LEN = 256
ATTN_CONTEXT = 64
GEN_BLOCK_SIZES = (8, 32)
MAX_TOKENS = 12
"""


def test_ipynb_and_md_are_the_same_notebook():
  assert sources(nbformat.read(IPYNB, as_version=4)) == sources(jupytext.read(MD))


def test_ipynb_keeps_outputs_md_has_none():
  ipynb = nbformat.read(IPYNB, as_version=4)
  code = [c for c in ipynb.cells if c.cell_type == "code"]
  # Cells 0-1 set parameters and import; every later cell shows a result.
  assert all(c.outputs for c in code[2:]), "every code cell after the imports has output"
  assert png_outputs(ipynb)
  assert "identical: True" in stream_text(ipynb)
  assert "execution_count" not in MD.read_text() and "image/png" not in MD.read_text()


def test_cells_define_no_functions_or_classes():
  for cell in nbformat.read(IPYNB, as_version=4).cells:
    if cell.cell_type == "code":
      assert "def " not in cell.source and "class " not in cell.source, cell.source


@pytest.mark.slow
def test_notebook_executes_at_tiny_sizes():
  nb = run_with_parameters(MD, TINY, timeout_s=600)
  text = stream_text(nb)
  assert "identical: True" in text
  for bs in (4, 16, 64):
    assert f"| alpaca   | {bs} " in text.replace(f"| {bs}  ", f"| {bs} ")
  assert png_outputs(nb), "the figure cell displays a PNG"
