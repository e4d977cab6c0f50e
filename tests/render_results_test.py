"""tools/render_results.py (+ tools/render_*.py): docs tables from the committed results,
markers, errors."""

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import render_engine  # pylint: disable=g-import-not-at-top,wrong-import-position
import render_gpu  # pylint: disable=g-import-not-at-top,wrong-import-position
import render_index  # pylint: disable=g-import-not-at-top,wrong-import-position
import render_results  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_rendering_the_committed_results_changes_no_doc():
  docs = render_results.doc_paths()
  assert {os.path.join(ROOT, "README.md"), os.path.join(ROOT, "BENCHMARKS.md")} <= set(docs)
  assert render_results.render_files(docs, check=True) == []


def test_docs_under_docs_are_rendered_too(tmp_path):
  (tmp_path / "docs" / "notes").mkdir(parents=True)
  for name in ("README.md", "BENCHMARKS.md", "docs/a.md", "docs/notes/b.md", "docs/notes/c.txt"):
    (tmp_path / name).write_text("text\n")
  found = [os.path.relpath(p, tmp_path) for p in render_results.doc_paths(str(tmp_path))]
  assert found == ["README.md", "BENCHMARKS.md", "docs/a.md", "docs/notes/b.md"]


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
  rows = render_index.index_rows(render_results.RESULTS)
  mw = json.load(open(os.path.join(render_results.RESULTS, "memory_waste", "memory_waste.json")))
  assert rows[0][1].startswith(f"{100 * mw['paged']['token_utilization']:.1f}%")
  assert all(len(r) == 5 and r[1] for r in rows)


@pytest.mark.parametrize("doc,max_bytes", [("README.md", 10_000), ("BENCHMARKS.md", 20_000)])
def test_front_docs_stay_small_and_free_of_issue_numbers(doc, max_bytes):
  # A newcomer reads these first: what does not fit goes to docs/ (architecture.md, notes/).
  text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
  assert len(text.encode()) < max_bytes, f"{doc}: {len(text.encode())} bytes"
  assert not re.search(r"\bissue\b|#\d", text, re.I)


def test_compact_keeps_cells_and_drops_padding():
  assert render_results._compact("| a   | bb |\n| --- | -- |\n| 1   |    |") == (
      "| a | bb |\n| --- | --- |\n| 1 |  |")


def test_mosaic_table_has_every_committed_config_once():
  doc = json.load(open(os.path.join(render_results.RESULTS, "gpu_compile_report",
                                    "mosaic_gpu_compile_report.json")))
  lines = render_results.render_section("mosaic_gpu_compile_report").splitlines()[2:]
  cases = [l.split(" | ")[0][2:] for l in lines]
  expanded = []   # "decode:m:bf16:bs16/32:W" -> the committed names it stands for
  for case in cases:
    head, sizes, tail = re.match(r"(.*:bs)([\d/]+)(:.*)", case).groups()
    expanded += [f"{head}{bs}{tail}" for bs in sizes.split("/")]
  assert sorted(expanded) == sorted(r["case"] for r in doc["rows"])
  regs = {r["case"]: r["registers"] for r in doc["rows"]}
  first = lines[0].split(" | ")
  assert first[1] == "/".join(str(regs[c]) for c in expanded[:len(first[1].split("/"))])


def test_block_size_rows_merge_only_when_the_rest_is_equal():
  rows = [["decode:m:bf16:bs16:W", 187, 0, "123", 1, "9.0"],
          ["decode:m:bf16:bs32:W", 182, 0, "123", 1, "9.0"],
          ["decode:m:bf16:bs64:W", 168, 0, "99", 1, "9.0"],     # smem differs: own row
          ["decode:m:f16:bs128:W", 168, 0, "123", 1, "9.0"]]    # dtype differs: own row
  assert render_gpu._group_block_sizes(rows) == [
      ["decode:m:bf16:bs16/32:W", "187/182", 0, "123", 1, "9.0"],
      ["decode:m:bf16:bs64:W", "168", 0, "99", 1, "9.0"],
      ["decode:m:f16:bs128:W", "168", 0, "123", 1, "9.0"]]


def test_render_modules_stay_small():
  tools = os.path.join(ROOT, "tools")
  for name in os.listdir(tools):
    if name.startswith("render") and name.endswith(".py"):
      assert sum(1 for _ in open(os.path.join(tools, name))) <= 400, name


def test_rate_ratio_is_a_bound_where_a_system_never_missed_the_slo():
  sec = lambda paged, other: {"paged_rate_ratio": {"paged_over_orca_max": 0.75},
                              "max_rate_at_slo_interpolated": {"paged": paged, "orca_max": other}}
  assert render_engine.rate_ratio(sec(12.2, 17.0), "orca_max") == "0.75x"
  assert render_engine.rate_ratio(sec(12.2, None), "orca_max") == "<=0.75x"   # Max went higher
  assert render_engine.rate_ratio(sec(None, 17.0), "orca_max") == ">=0.75x"   # paged did
  assert render_engine.rate_ratio(sec(None, None), "orca_max") == "0.75x"
  assert render_engine.rate_ratio(sec(1.0, 1.0), "orca_oracle") == ""
