"""experiments/step_cost: decode seconds per step by difference of two runs; flags checked
before any engine is built. (Times are not asserted: only that the readings exist.)"""

import pytest

from experiments import step_cost


def test_readings_for_each_configuration():
  res = step_cost.run(max_seqs=(2, 8), live=(1, 3), short=2, long=5, repeats=1)
  got = [(r["reading"], r["max_seqs"], r["live"]) for r in res["rows"]]
  assert got == [("padding", 2, 1), ("padding", 8, 1), ("per_row", 8, 3)]
  assert all(r["step_ms"] > 0 and r["device_ms"] > 0 for r in res["rows"])
  assert res["padding_ratio"] == pytest.approx(res["rows"][1]["step_ms"] / res["rows"][0]["step_ms"])
  assert "ms_per_extra_row" in res


@pytest.mark.parametrize("kw,match", [({"max_seqs": ()}, "max_seqs"),
                                      ({"live": (0,)}, "live"),
                                      ({"live": (9,), "max_seqs": (4, 8)}, "live must be"),
                                      ({"short": 8, "long": 8}, "long")])
def test_bad_arguments_are_named(kw, match):
  with pytest.raises(ValueError, match=match):
    step_cost.run(**kw)
