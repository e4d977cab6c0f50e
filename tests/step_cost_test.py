"""experiments/step_cost: decode seconds per step by difference of two runs; flags checked
before any engine is built. (Times are not asserted, not even their sign: a difference of
two short wall-clock runs on a loaded machine can come out negative. What is asserted is
that each reading exists and spans exactly the decode steps the two runs differ by.)"""

import math

import pytest

from experiments import step_cost


@pytest.mark.slow
def test_readings_for_each_configuration():
  res = step_cost.run(step_cost.Config(max_seqs=(2, 8), live=(1, 3), short=2, long=5,
                                       repeats=1))
  got = [(r["reading"], r["max_seqs"], r["live"]) for r in res["rows"]]
  assert got == [("padding", 2, 1), ("padding", 8, 1), ("per_row", 8, 3), ("width", 8, 3)]
  # One engine step per generated token: the long run (5 tokens) takes 3 steps more.
  assert [r["decode_steps"] for r in res["rows"]] == [3, 3, 3, 3]
  assert all(math.isfinite(r["step_ms"]) and math.isfinite(r["device_ms"]) for r in res["rows"])
  assert res["padding_ratio"] == pytest.approx(res["rows"][1]["step_ms"] / res["rows"][0]["step_ms"])
  assert "ms_per_extra_row" in res
  assert res["width_ratio"] == pytest.approx(res["rows"][3]["step_ms"] / res["rows"][2]["step_ms"])


@pytest.mark.parametrize("kw,match", [({"max_seqs": ()}, "--max_seqs must list"),
                                      ({"live": (0,)}, "--live must be an int >= 1"),
                                      ({"live": (9,), "max_seqs": (4, 8)}, "--live must be <="),
                                      ({"short": 8, "long": 8}, "--long must be >")])
def test_bad_arguments_are_named(kw, match):
  with pytest.raises(ValueError, match=match):   # before any engine is built
    step_cost.Config(**kw)
