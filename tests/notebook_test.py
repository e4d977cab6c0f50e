"""The block-size notebook: paired with its jupytext .md, and it runs (tiny sizes) via nbclient."""

import pathlib

import jupytext
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "experiments" / "notebooks"
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


def _sources(nb):
  return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_ipynb_and_md_are_the_same_notebook():
  ipynb = nbformat.read(IPYNB, as_version=4)
  md = jupytext.read(MD)
  assert _sources(ipynb) == _sources(md)


def test_ipynb_keeps_outputs_md_has_none():
  ipynb = nbformat.read(IPYNB, as_version=4)
  code = [c for c in ipynb.cells if c.cell_type == "code"]
  # Cells 0-1 set parameters and import; every later cell shows a result.
  assert all(c.outputs for c in code[2:]), "every code cell after the imports has output"
  assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs)
  assert "identical: True" in "".join(
      o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
  assert "execution_count" not in MD.read_text() and "image/png" not in MD.read_text()


def test_cells_define_no_functions_or_classes():
  for cell in nbformat.read(IPYNB, as_version=4).cells:
    if cell.cell_type == "code":
      assert "def " not in cell.source and "class " not in cell.source, cell.source


@pytest.mark.slow
def test_notebook_executes_at_tiny_sizes():
  from nbclient import NotebookClient
  nb = jupytext.read(MD)
  index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(index + 1, nbformat.v4.new_code_cell(TINY))
  client = NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(ROOT)}})
  client.execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs if o.output_type == "stream")
  assert "identical: True" in text
  for bs in (4, 16, 64):
    assert f"| alpaca   | {bs} " in text.replace(f"| {bs}  ", f"| {bs} ")
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images, "the figure cell displays a PNG"
