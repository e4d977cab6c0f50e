"""docs/extending.md's worked examples are real: each `python` block is extracted, is at
most 30 lines, and runs (its own asserts: a scheduling key reorders requests; an added
eviction policy evicts and keeps outputs equal to caching off)."""

import pathlib
import re

import pytest

from paged_jax import eviction_policy

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "extending.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_both_examples_each_at_most_30_lines():
  assert len(BLOCKS) == 2
  for code in BLOCKS:
    assert len(code.strip().splitlines()) <= 30


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["scheduling", "eviction"])
def test_each_example_runs(index):
  before = dict(eviction_policy.EVICTION_POLICIES)
  try:
    exec(compile(BLOCKS[index], f"{DOC}:block{index}", "exec"), {})  # pylint: disable=exec-used
  finally:
    eviction_policy.EVICTION_POLICIES.clear()
    eviction_policy.EVICTION_POLICIES.update(before)
