"""What the notebook tests share: a notebook's cells, a run of its jupytext page with
papermill-style parameters injected, and its outputs."""

import pathlib

import jupytext
import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "experiments" / "notebooks"


def sources(nb) -> list:
  """(cell type, stripped source) of every cell: what the .ipynb and its .md must share."""
  return [(c.cell_type, c.source.strip()) for c in nb.cells]


def code_outputs(nb) -> list:
  """Every output of every code cell, in order."""
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def stream_text(nb) -> str:
  """The code cells' printed text (stdout and stderr), joined."""
  return "".join(o.get("text", "") for o in code_outputs(nb) if o.output_type == "stream")


def png_outputs(nb) -> list:
  """The code cells' outputs that display a PNG."""
  return [o for o in code_outputs(nb) if "image/png" in o.get("data", {})]


def run_with_parameters(md: pathlib.Path, parameters: str, *, timeout_s: int):
  """Executes the jupytext page `md` in a fresh python3 kernel in the repository root, with
  `parameters` (code) as a cell right after the cell tagged "parameters"; returns the
  executed notebook."""
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top
  nb = jupytext.read(md)
  index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(index + 1, nbformat.v4.new_code_cell(parameters))
  NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                 resources={"metadata": {"path": str(ROOT)}}).execute()
  return nb
