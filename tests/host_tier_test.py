"""The prefix cache's host tier (`CacheConfig.num_host_blocks`, `engine/tier.py`) and KV
cache events (`Engine.kv_events`): greedy outputs with the tier equal outputs without
caching on multi-turn conversations whose earlier turns the small device pool evicts
(so later hits come from host memory); metrics exact at every step; the events, replayed
into a plain-Python model of both tiers, equal what the engine holds after every step
(an overflowing event log included); salts never share a host block; a bad size is a
one-line ValueError; an interrupt during either transfer leaves both tiers consistent
and every request finishing with the same outputs."""

import collections

import pytest

from paged_jax.engine import tier as tier_lib
from paged_jax.engine.step import init_state

from engine_oracle import MC, PARAMS, dense_greedy

from host_tier_support import (BS, HOST, NUM_BLOCKS, Replay, assert_counts_exact,
                               conversations, greedy, make, reference, run, truth)


# ---- tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 2.0, "8", True, None, 2**31])
def test_a_bad_num_host_blocks_is_a_one_line_value_error(bad):
  with pytest.raises(ValueError, match=r"num_host_blocks must be an int in \[0, ") as e:
    MC.cache_config(block_size=BS, num_blocks=NUM_BLOCKS, num_host_blocks=bad)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="num_host_blocks > 0 needs enable_prefix_caching"):
    MC.cache_config(block_size=BS, num_blocks=NUM_BLOCKS, num_host_blocks=4,
                    enable_prefix_caching=False)


@pytest.mark.long   # 270 s at load 10 (three engines, a check of both tiers after every step)
def test_host_hits_keep_greedy_outputs_and_every_count_and_event_is_exact():
  prompts = conversations(0)
  eng, replay = make(), Replay()
  got = run(eng, prompts, replay)
  assert got == reference(prompts)
  assert got[0][0] == dense_greedy(PARAMS, prompts[0], 3)
  m = eng.metrics()
  # Later turns find their history on the host: every admitted prompt of turns 2 and 3
  # brings back blocks the device had evicted.
  assert m["prefix_host_hit_tokens"] >= BS * 10 and eng.host_stats["calls"] > 0
  assert m["prefix_hit_tokens"] >= m["prefix_host_hit_tokens"]
  # Device-only caching hits less: the host hits are the difference.
  dev_only = make(host=0)
  assert run(dev_only, prompts) == got
  assert dev_only.metrics()["prefix_hit_tokens"] < m["prefix_hit_tokens"]
  assert dev_only.metrics()["num_host_blocks"] == dev_only.metrics()["prefix_host_hit_tokens"] == 0
  # A reset empties both tiers: one "cleared" event each.
  eng.reset_prefix_cache()
  ev = eng.kv_events()
  assert sorted((e.kind, e.medium) for e in ev) == [("cleared", "device"), ("cleared", "host")]
  replay.apply(ev)
  assert replay.tiers == truth(eng) == {"device": collections.Counter(),
                                        "host": collections.Counter()}
  assert eng.metrics()["num_free_host_blocks"] == HOST


def test_an_overflowing_event_log_still_gives_exact_events():
  # Two rows of log: nearly every step overflows it and the engine reads the cache instead.
  prompts = conversations(1, num=4, turns=2)
  eng = make(init_state=lambda cc: init_state(cc, event_capacity=2))
  replay = Replay()
  assert run(eng, prompts, replay) == reference(prompts)


def test_salted_requests_never_hit_another_salts_host_blocks():
  prompts = conversations(2, num=4, turns=2)
  eng = make()
  a, b = greedy(cache_salt="a"), greedy(cache_salt="b")
  run(eng, prompts[:4], params=a)             # turn 1 under salt "a", then evicted
  hits = eng.metrics()["prefix_host_hit_tokens"]
  run(eng, prompts[4:], params=b)             # turn 2 under salt "b": no hit anywhere
  assert eng.metrics()["prefix_host_hit_tokens"] == hits
  assert eng.metrics()["prefix_hit_tokens"] == 0
  run(eng, prompts[4:], params=a)             # under "a" again: the host has turn 1
  assert eng.metrics()["prefix_host_hit_tokens"] > hits


@pytest.mark.long
@pytest.mark.parametrize("where", ["upload", "download"])
def test_an_interrupt_during_a_transfer_leaves_both_tiers_consistent(monkeypatch, where):
  prompts = conversations(3, num=4, turns=3)
  ref = reference(prompts)
  for k in (1, 3):
    eng, replay = make(), Replay()
    name = {"upload": "_upload", "download": "_download"}[where]
    real, count = getattr(tier_lib, name), {"n": 0}

    def faulty(*a, real=real, count=count, k=k):
      count["n"] += 1
      if count["n"] == k:
        raise KeyboardInterrupt
      return real(*a)

    ids = [eng.add_request(p, greedy()) for p in prompts]
    outs = {}
    with monkeypatch.context() as m:
      m.setattr(tier_lib, name, faulty)
      with pytest.raises(KeyboardInterrupt):
        while eng.has_unfinished():
          outs.update({o.request_id: o.outputs for o in eng.step()})
    # Right after the interrupt: the host tier, the device and the events agree.
    replay.apply(eng.kv_events())
    assert replay.tiers == truth(eng)
    while eng.has_unfinished():
      outs.update({o.request_id: o.outputs for o in eng.step()})
      replay.apply(eng.kv_events())
      assert replay.tiers == truth(eng)
      assert_counts_exact(eng)
    assert [outs[i] for i in ids] == ref
    assert count["n"] == k and eng.host_stats["calls"] > 0   # the tier kept serving
