"""tools/render_results.py: docs tables from the committed results, markers, errors."""

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import render_results  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_rendering_the_committed_results_changes_no_doc():
  docs = [os.path.join(ROOT, d) for d in render_results.DOCS]
  assert render_results.render_files(docs, check=True) == []


@pytest.mark.parametrize("name", sorted(render_results.SECTIONS))
def test_every_section_renders_from_its_committed_json(name):
  lines = render_results.render_section(name).splitlines()
  assert len(lines) >= 3 and all(l.startswith("| ") and l.endswith(" |") for l in lines)


def test_markers_are_filled_and_rerendering_is_a_fixed_point(tmp_path):
  doc = tmp_path / "doc.md"
  doc.write_text("# Title\n<!-- results:memory_waste -->\nstale\n<!-- /results:memory_waste -->"
                 "\ntext between\n<!-- results:memory_waste -->\n<!-- /results:memory_waste -->\n")
  assert render_results.render_files([str(doc)]) == [str(doc)]
  text = doc.read_text()
  assert "stale" not in text and text.startswith("# Title\n") and "\ntext between\n" in text
  committed = json.loads(open(os.path.join(render_results.RESULTS, "memory_waste",
                                            "memory_waste.json")).read())
  paged = [l for l in text.splitlines() if l.startswith("| vLLM (paged)")]
  assert len(paged) == 2   # both markers
  assert f"| {100 * committed['paged']['token_utilization']:.1f}%" in paged[0]
  assert render_results.render_files([str(doc)], check=True) == []


def test_errors_name_the_file_and_the_problem(tmp_path):
  doc = tmp_path / "doc.md"
  doc.write_text("<!-- results:nope -->\n<!-- /results:nope -->\n")
  with pytest.raises(ValueError, match=r"doc.md: unknown results section 'nope'"):
    render_results.render_files([str(doc)])
  doc.write_text("<!-- results:sharing -->\nno end\n")
  with pytest.raises(ValueError, match=r"doc.md: <!-- results:sharing --> has no matching"):
    render_results.render_files([str(doc)])
  doc.write_text("<!-- results:sharing -->\n<!-- /results:sharing -->\n")
  with pytest.raises(ValueError, match=r"doc.md: .*sharing.json: no committed result"):
    render_results.render_files([str(doc)], results_dir=str(tmp_path))
  assert render_results.main(["--check", str(doc), f"--results={tmp_path}"]) == 1


def test_index_reads_its_figures_from_the_committed_json():
  rows = render_results._index_rows(render_results.RESULTS)
  mw = json.load(open(os.path.join(render_results.RESULTS, "memory_waste", "memory_waste.json")))
  assert rows[0][1].startswith(f"{100 * mw['paged']['token_utilization']:.1f}%")
  assert all(len(r) == 5 and r[1] for r in rows)


def test_benchmarks_stays_small_and_free_of_issue_numbers():
  text = open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8").read()
  assert len(text.encode()) < 20_000
  assert not re.search(r"\bissue\b|#\d", text, re.I)


def test_compact_keeps_cells_and_drops_padding():
  assert render_results._compact("| a   | bb |\n| --- | -- |\n| 1   |    |") == (
      "| a | bb |\n| --- | --- |\n| 1 |  |")
