"""experiments/step_host_cost with this tree as its own base, at a tiny paper-scale point
(8 requests): both sides serve the point to the same summary under the virtual model
clock, and the readings are the ones the renderer reads."""

import json
import math
import pathlib

import pytest

from experiments import step_host_cost

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow   # ~60 s on 2 cores (load 8): two fresh processes each serve the point twice
def test_this_tree_against_itself_gives_the_same_summary(tmp_path):
  f = step_host_cost.Config(base_tree=str(ROOT), rounds=1, num_requests=8, rate=4.0)
  step_host_cost.main(f, tmp_path)
  res = json.loads((tmp_path / "step_host_cost.json").read_text())
  assert res["same_summary"] and res["steps"] > 0
  assert [len(res["runs"][n]) for n in ("base", "this")] == [1, 1]
  for name in ("base", "this"):
    assert res["median"][name]["cpu_s"] > 0 and res["steps_per_cpu_s"][name] > 0
  assert all(math.isfinite(res[k]) for k in ("cpu_ratio_base_over_this",
                                             "wall_ratio_base_over_this"))


def test_a_base_tree_without_paged_jax_is_refused(tmp_path):
  with pytest.raises(ValueError, match="--base_tree must be a directory holding paged_jax"):
    step_host_cost.run(step_host_cost.Config(base_tree=str(tmp_path)))
