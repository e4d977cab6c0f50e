"""experiments/speculative_draft at tiny sizes: the self-draft accepts every draft (greedy)
and takes fewer steps than speculation off, the draft's dispatch is a share of the step
time in (0, 1), and the JSON (flags, versions, machine) and its table are written."""

import json

import pytest

from experiments import speculative_draft


def test_tiny_run_measures_the_draft_dispatch_and_writes_the_json(tmp_path):
  f = speculative_draft.Config(workloads=("repetitive",), methods=("draft_self",),
                               requests=2, gen=8, repeats=1, max_seqs=2)
  speculative_draft.main(f, tmp_path)
  doc = json.loads((tmp_path / "speculative_draft.json").read_text())
  assert {"flags", "versions", "machine", "load_avg_start_1_5_15"} <= set(doc)
  off, draft = doc["rows"]
  assert (off["method"], draft["method"]) == ("off", "draft_self")
  assert off["draft_share"] is None and off["ratio"] == 1.0
  assert draft["acceptance"] == 1.0 and draft["drafted"] > 0
  assert 0 < draft["steps"] < draft["steps_off"] == off["steps"]
  assert draft["draft_dispatches"] >= draft["drafting_steps"] > 0
  assert 0 < draft["dispatch_share"] <= draft["draft_share"] < 1
  rows = speculative_draft.summary_rows(doc)
  assert len(rows) == 2 and all(len(r) == len(speculative_draft.HEADERS) for r in rows)


def test_bad_flags_are_one_line_errors():
  for kw, name in ((dict(lookup_min=5, lookup_max=3), "lookup_min"), (dict(k=0), "k"),
                   (dict(methods=("eagle",)), "methods")):
    with pytest.raises(ValueError) as e:
      speculative_draft.Config(**kw)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_shared_prefix_workload_and_the_catchup_the_draft_skips_on_hits():
  f = speculative_draft.Config(workloads=("shared_prefix",), requests=3, prefix_len=40,
                               tail_len=6)
  prompts = speculative_draft.prompts_of(f, "shared_prefix")
  assert len(prompts) == 3 and all(len(p) == 1 + 40 + 6 for p in prompts)
  assert all(p[:41] == prompts[0][:41] for p in prompts) and prompts[0][41:] != prompts[1][41:]
  f = speculative_draft.Config(workloads=("shared_prefix",), requests=3, gen=6, repeats=1,
                               prefix_len=40, tail_len=6, max_seqs=3,
                               methods=("draft_self", "draft_self_noreuse"))
  rows = {r["method"]: r for r in speculative_draft.run(f)["rows"]}
  on, off = rows["draft_self"], rows["draft_self_noreuse"]
  assert on["prefix_hit_tokens"] > 0 and on["acceptance"] == off["acceptance"] == 1.0
  assert on["reused_tokens"] > 0 and off["reused_tokens"] == 0
  assert off["draft_catchup_tokens"] - on["draft_catchup_tokens"] == on["reused_tokens"]
