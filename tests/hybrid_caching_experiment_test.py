"""experiments/hybrid_caching at a toy scale, on the real tiny Gemma-like model: hybrid KV
with prefix caching holds fewer layer-blocks than one pool with caching, keeps its hits
(all of them on short shared prefixes, where the hit rule needs every block on both
groups), serves every request, and gives the same greedy tokens as the other two
configurations (`run` raises otherwise). Bad flags are named before any engine is built."""

import pytest

from experiments import hybrid_caching

TOY = hybrid_caching.Config(window=8, block_size=2, requests=12, num_prefixes=2, gen=3,
                            sliding_extra=(), seeds=(0,),
                            max_seqs=4, max_num_batched_tokens=16, sliding_per_full=2)


@pytest.fixture(scope="module")
def rows():
  result = hybrid_caching.run(TOY)
  assert [r["stream"] for r in result["rows"]] == ["long", "short"]
  # One seed: the pooled summary is that seed's figures.
  for row, pooled in zip(result["rows"], result["summary"]):
    for name, r in pooled["configs"].items():
      for k in ("hit_rate", "held_mean", "held_peak", "served", "memory_saved"):
        assert r.get(k) == row["configs"][name].get(k), (name, k)
  return {r["stream"]: r for r in result["rows"]}


def test_streams_share_prefixes_longer_and_shorter_than_the_window():
  long_prefixes, _ = hybrid_caching.stream(TOY, "long", 0)
  short_prefixes, prompts = hybrid_caching.stream(TOY, "short", 0)
  assert min(map(len, long_prefixes)) > TOY.window > max(map(len, short_prefixes))
  assert all(any(p[:len(s)] == s for s in short_prefixes) for p in prompts)
  assert hybrid_caching.stream(TOY, "short", 0) == (short_prefixes, prompts)    # seeded


def test_every_configuration_serves_every_request_with_the_same_tokens(rows):
  for row in rows.values():
    assert row["outputs_equal"]
    for r in row["configs"].values():
      assert r["served"] == TOY.requests and r["preemptions"] == 0


def test_hybrid_caching_holds_fewer_blocks_than_one_pool_caching(rows):
  for row in rows.values():
    hy, one = row["configs"]["hybrid_caching"], row["configs"]["one_pool_caching"]
    assert hy["allocated_layer_blocks"] < one["allocated_layer_blocks"]
    assert hy["held_peak"] <= one["held_peak"] and hy["live_mean"] <= one["live_mean"]
  # Past the window the sliding layers let blocks go (sequences' and companions').
  hy, one = rows["long"]["configs"]["hybrid_caching"], rows["long"]["configs"]["one_pool_caching"]
  assert hy["held_peak"] < one["held_peak"] and hy["live_mean"] < one["live_mean"]
  assert hy["memory_saved"] > 0


def test_hits_are_kept_and_short_prefixes_hit_on_every_group(rows):
  for row in rows.values():
    hy, one = row["configs"]["hybrid_caching"], row["configs"]["one_pool_caching"]
    assert hy["hit_rate"] > 0 and hy["hit_tokens"] <= one["hit_tokens"]
    assert row["configs"]["hybrid_no_caching"]["hit_tokens"] == 0
  # A prefix shorter than the window: the sliding group needs every block, and has it.
  short = rows["short"]["configs"]
  assert short["hybrid_caching"]["hit_tokens"] == short["one_pool_caching"]["hit_tokens"]
  assert short["hybrid_caching"]["hit_rate_kept"] == 1.0


@pytest.mark.parametrize("kw,match", [({"window": 2, "block_size": 2}, "--window must be >"),
                                      ({"streams": ("medium",)}, "--streams"),
                                      ({"requests": 0}, "--requests must be")])
def test_bad_flags_are_named(kw, match):
  with pytest.raises(ValueError, match=match):
    hybrid_caching.Config(**kw)
