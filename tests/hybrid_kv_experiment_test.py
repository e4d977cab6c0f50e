"""experiments/hybrid_kv at a toy scale: blocks held per sequence equal the analytic count
at the measured lengths, hybrid KV batches more sequences in the same KV bytes, and bad
flags are named before any engine is built."""

import pytest

from experiments import hybrid_kv


def test_toy_run_matches_the_analytic_counts():
  f = hybrid_kv.Config(contexts=(128,), window=16, block_size=4, max_num_batched_tokens=16,
                       base_requests=2)
  (row,) = hybrid_kv.run(f)["rows"]
  assert row["kv_bytes_on"] <= row["kv_bytes_off"]
  assert row["off"]["batched"] == f.base_requests            # the pool's capacity, reached
  assert row["on"]["batched"] > 2 * row["off"]["batched"]
  # A sliding layer keeps cdiv(W - 1, bs) + 1 = 5 blocks, or 4 when the window starts on a
  # block boundary; a full layer every block.
  assert 4 <= row["on"]["sliding_blocks"] <= 5
  assert row["off"]["sliding_blocks"] == row["off"]["full_blocks"]
  assert row["saving"] == pytest.approx(row["analytic_saving_at_measured_len"], abs=0.02)
  assert row["saving"] < row["analytic_saving"] + 1e-9    # measured before the full context


@pytest.mark.parametrize("kw,match", [({"contexts": (4,)}, "--contexts must all be >= 8"),
                                      ({"window": 0}, "--window must be"),
                                      ({"block_size": 0}, "--block_size must be")])
def test_bad_flags_are_named(kw, match):
  with pytest.raises(ValueError, match=match):
    hybrid_kv.Config(**kw)
