"""Prefix caching in the engine: greedy outputs with caching on equal caching off
and the dense oracle (random prompts with shared prefixes, every hash colliding,
preemption, parallel sampling, beam search, multi-step decoding); no cached or
shared block is ever written; prompts shorter than one block never hit; hits
actually skip prefill work."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from paged_jax import prefix_cache as pc
from paged_jax.engine import Engine, SamplingParams

from engine_oracle import MC, ORACLE_LEN, PARAMS, VOCAB
from prefix_engine_support import (BS, BUDGET, MAX_SEQS, NUM_BLOCKS, dense_greedy, greedy,
                                   make, outputs, shared_prefix_prompts)

@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), prefix_len=st.integers(0, 30),
       mode=st.sampled_from(pc.HASH_MODES))
def test_outputs_identical_with_caching_on_and_off(seed, prefix_len, mode):
  rng = np.random.default_rng(seed)
  prompts = shared_prefix_prompts(rng, 6, prefix_len)
  # Later rounds reuse earlier prompts verbatim and extended (multi-turn).
  prompts += [prompts[1], prompts[2] + [5, 6, 7, 8, 9]]
  off = outputs(make(False).generate(prompts, greedy()))
  eng = make(True, hash_mode=mode, max_probe=32)
  on = outputs(eng.generate(prompts, greedy()))
  assert on == off
  for p, o in zip(prompts[:3], off[:3]):
    assert o[0] == dense_greedy(p, 6)
  stats = eng.prefix_stats()
  if prefix_len >= 2 * BS:
    assert stats["hit_blocks"] > 0
  # Every prompt token is either hit or computed (recomputed again after a preemption).
  if eng.num_preemptions == 0:
    assert stats["hit_tokens"] + stats["prefill_tokens"] == sum(len(p) for p in prompts)
  else:
    assert stats["hit_tokens"] + stats["prefill_tokens"] >= sum(len(p) for p in prompts)


def test_hits_skip_prefill_and_the_shared_prefix_is_stored_once():
  rng = np.random.default_rng(1)
  prompts = shared_prefix_prompts(rng, 12, 40, max_suffix=6)
  off_eng, on_eng = make(False), make(True)
  # Batches of <= 4: 10 shared + 4 x 3 private blocks fit the 24 blocks (no preemption).
  batches = [prompts[:1], prompts[1:5], prompts[5:9], prompts[9:]]
  off = [o for b in batches for o in outputs(off_eng.generate(b, greedy()))]
  on = [o for b in batches for o in outputs(on_eng.generate(b, greedy()))]
  assert on == off and on_eng.num_preemptions == 0
  s = on_eng.prefix_stats()
  # After the first request every later one hits the 10 prefix blocks (40 // 4).
  assert s["hit_blocks"] >= 10 * 11 and s["hit_rate"] > 0.8
  assert s["prefill_tokens"] <= sum(len(p) for p in prompts) - 40 * 11
  # One physical copy of each prefix block: every prompt's first 10 table entries agree.
  c = jax.device_get(on_eng.state.prefix.cache)
  depth0 = np.nonzero(np.asarray(c.cached) & (np.asarray(c.block_depth) == 0))[0]
  prefix0 = [b for b in depth0 if list(np.asarray(c.block_tokens[b])) == prompts[0][:BS]]
  assert len(prefix0) == 1


def test_a_miss_costs_no_step_and_a_chunk_inside_the_hit_computes_nothing():
  # No shared prefix (distinct first tokens), prompts longer than the step's budget, so
  # admissions come with chunks cut short: caching on runs the same steps as off.
  rng = np.random.default_rng(4)
  prompts = [[i] + [int(t) for t in rng.integers(0, VOCAB, int(n))]
             for i, n in enumerate(rng.integers(9, 18, 4))]
  off_eng, on_eng = make(False), make(True)
  assert outputs(on_eng.generate(prompts, greedy(4))) == outputs(
      off_eng.generate(prompts, greedy(4)))
  assert on_eng.num_preemptions == off_eng.num_preemptions == 0
  assert on_eng.prefix_stats()["hit_tokens"] == 0
  assert on_eng.stats["steps"] == off_eng.stats["steps"]
  # A hit (20 tokens) longer than the budget (16): the first chunk lies inside the hit,
  # computes nothing, and the prompt resumes after the hit; outputs unchanged.
  shared = [int(t) for t in rng.integers(0, VOCAB, 20)]
  p2 = [shared + [1, 2, 3], shared + [4, 5, 6, 7, 8]]
  eng = make(True)
  assert outputs(eng.generate(p2[:1], greedy(3))) == outputs(make(False).generate(p2[:1],
                                                                                   greedy(3)))
  assert outputs(eng.generate(p2[1:], greedy(3)))[0][0] == dense_greedy(p2[1], 3)
  s = eng.prefix_stats()
  assert s["hit_tokens"] == 20 and s["prefill_tokens"] == len(p2[0]) + 5


def test_mostly_hitting_lookups_attach_ahead_and_size_the_step_by_what_it_computes():
  # A 20-token shared prefix (5 blocks) and 3-token suffixes, served one at a time, 64
  # tokens a step (token buckets 16 and 64). The first lookup misses (empty cache), the
  # others hit 20 of 23 tokens. Once the recent hit fraction (a plain-Python model of it
  # here) reaches ATTACH_AHEAD_HIT_FRACTION, a prompt is attached alone and the next step
  # prefills only its 3 missing tokens on the 16-token bucket; planned from 0, its 23
  # tokens take the 64-token one though 20 are skipped (the predicted skip, >= 8 tokens
  # at that fraction, always moves it to the smaller bucket here).
  from paged_jax.engine import planning  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(6)
  shared = [int(t) for t in rng.integers(0, VOCAB, 20)]
  prompts = [shared + [int(t) for t in rng.integers(0, VOCAB, 3)] for _ in range(5)]
  cc = MC.cache_config(block_size=BS, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=ORACLE_LEN // BS, enable_prefix_caching=True)
  eng = Engine(MC, PARAMS, cc, max_num_batched_tokens=64, attention_backend="reference")
  ema, ahead = 0.0, 0
  for i, p in enumerate(prompts):
    was_ahead = eng.scheduler.attach_ahead
    assert was_ahead == (ema >= planning.ATTACH_AHEAD_HIT_FRACTION)
    eng.add_request(p, greedy(3))
    outs = eng.step()
    hit = 20 if i else 0
    assert eng.last_step.prefix_hit_tokens == hit
    if was_ahead:
      ahead += 1
      # The attaching step computed nothing for it; the next one only its suffix.
      assert eng.last_step.prefill_chunks == () and not eng.last_step.first_token_ids
      outs += eng.step()
      assert eng.last_step.prefill_chunks == ((3, 23),)
      assert eng.last_step.bucket.tokens == 16
    else:
      assert eng.last_step.prefill_chunks == ((23 - hit, 23),)
      assert eng.last_step.bucket.tokens == 64   # planned from 0, hit tokens skipped
    while eng.has_unfinished():
      outs += eng.step()
    assert [o.outputs[0] for o in outs] == [dense_greedy(p, 3)]
    ema = 0.5 * (ema + hit / len(p))
    assert eng.scheduler.prefix_hit_ema == pytest.approx(ema)
  assert eng.stats["prefix_attached_ahead"] == ahead >= 2
  eng.reset_prefix_cache()
  assert not eng.scheduler.attach_ahead
  # Unbucketed, every mixed step runs the budget's 64 tokens: skipped tokens cost no
  # larger shape, so nothing is attached ahead though the lookups hit as much.
  flat = Engine(MC, PARAMS, cc, max_num_batched_tokens=64, attention_backend="reference",
                shape_buckets=False)
  for p in prompts:
    assert outputs(flat.generate([p], greedy(3))) == [[dense_greedy(p, 3)]]
  assert flat.scheduler.attach_ahead and flat.stats["prefix_attached_ahead"] == 0


def test_attaching_ahead_under_preemption_and_eviction_stays_exact():
  # 64 tokens a step (token buckets 16 and 64), so admissions attach ahead once lookups
  # hit; 12 prompts sharing a 20-token prefix on the 24-block pool, so groups are also
  # preempted (recomputed) and cached blocks evicted meanwhile. (Long tier: ~180 CPU-s.)
  rng = np.random.default_rng(7)
  prompts = shared_prefix_prompts(rng, 12, 20, max_suffix=16)
  engines = [make(c, num_blocks=NUM_BLOCKS, max_num_batched_tokens=64) for c in (False, True)]
  off, on = (outputs(e.generate(prompts, greedy(10))) for e in engines)
  assert on == off
  eng = engines[1]
  s = eng.prefix_stats()
  assert eng.stats["prefix_attached_ahead"] > 0 and s["hit_blocks"] > 0
  assert eng.num_preemptions > 0 and s["evictions"] > 0
  # Groups of several sequences attached ahead: samples fork from the leader's prompt
  # and beams select, a step after the attach.
  ahead = eng.stats["prefix_attached_ahead"]
  params = [SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=7),
            SamplingParams(max_tokens=5, temperature=0.0, beam_width=2, n=2), greedy(5)] * 2
  off, on = (e.generate(prompts[:6], params) for e in engines)
  assert outputs(on) == outputs(off)
  for a, b in zip(on[1::3], off[1::3]):
    np.testing.assert_allclose(a.cumulative_logprobs, b.cumulative_logprobs, rtol=1e-5)
  assert eng.stats["prefix_attached_ahead"] > ahead


def test_prompts_shorter_than_one_block_never_hit():
  eng = make(True)
  prompts = [[1, 2, 3], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]]
  assert outputs(eng.generate(prompts, greedy(3))) == outputs(make(False).generate(prompts,
                                                                                    greedy(3)))
  s = eng.prefix_stats()
  assert s["hit_blocks"] == 0 and s["hit_rate"] == 0.0


def test_tiny_cache_preempts_evicts_and_stays_exact():
  rng = np.random.default_rng(2)
  prompts = shared_prefix_prompts(rng, 10, 24, max_suffix=16)
  off = outputs(make(False).generate(prompts, greedy(10)))
  eng = make(True)
  on = outputs(eng.generate(prompts, greedy(10)))
  assert on == off
  s = eng.prefix_stats()
  assert s["evictions"] > 0 and eng.num_preemptions > 0 and s["hit_blocks"] > 0


@pytest.mark.slow
def test_parallel_sampling_beam_search_and_multi_step_with_caching():
  rng = np.random.default_rng(3)
  prompts = shared_prefix_prompts(rng, 4, 18)
  params = [SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=7),
            SamplingParams(max_tokens=5, temperature=0.0, beam_width=2, n=2),
            greedy(5), greedy(5)]
  for kw in ({}, {"decode_steps_per_sync": 2}):
    off = make(False, **kw).generate(prompts, params)
    on = make(True, **kw).generate(prompts, params)
    assert outputs(on) == outputs(off)
    np.testing.assert_allclose(on[1].cumulative_logprobs, off[1].cumulative_logprobs, rtol=1e-5)


@pytest.mark.slow
def test_swapped_sampling_groups_with_caching_stay_exact():
  # n = 3 groups outgrow the pool; "auto" swaps them (their shared prompt blocks once)
  # and restores the sharing over fresh blocks, evicting cached ones to make room.
  rng = np.random.default_rng(8)
  prompts = shared_prefix_prompts(rng, 4, 16, max_suffix=4)
  params = [SamplingParams(max_tokens=14, temperature=0.8, n=3, seed=20 + i) for i in range(4)]
  roomy = make(False, num_blocks=4 * NUM_BLOCKS).generate(prompts, params)
  eng = make(True, preemption_mode="auto")
  assert outputs(eng.generate(prompts, params)) == outputs(roomy)
  assert eng.num_swaps > 0 and eng.prefix_stats()["hit_blocks"] > 0
  assert eng.stats["swapped_blocks"] > 0


@pytest.mark.slow
def test_no_cached_or_shared_block_is_written_and_free_stack_holds_no_cached_block():
  rng = np.random.default_rng(4)
  prompts = shared_prefix_prompts(rng, 10, 21, max_suffix=10)
  eng = make(True, decode_steps_per_sync=2)
  inner = eng._step   # pylint: disable=protected-access
  checked = {"writes": 0}

  def checked_step(params, state, inputs, **bucket):
    b = jax.device_get(state.blocks)
    c = jax.device_get(state.prefix.cache)
    inp = jax.device_get(inputs)
    cached = np.asarray(c.cached)
    free = np.asarray(b.free_stack)[:int(b.num_free)]
    assert not cached[free].any(), "a cached block sits on the free stack"
    freed = set(int(s) for s in inp.free_slots if s >= 0)
    for t in np.nonzero(inp.token_row >= 0)[0]:
      slot = int(inp.row_slot[inp.token_row[t]])
      pos = int(inp.positions[t])
      if pos // BS < -(-int(b.seq_lens[slot]) // BS):     # an existing block is written
        blk = int(b.block_tables[slot, pos // BS])
        holders = sum(int(s) not in freed for s in np.nonzero(
            (np.asarray(b.block_tables) == blk).any(axis=1))[0])
        assert not cached[blk], f"token {pos} of slot {slot} writes cached block {blk}"
        # A block another live sequence reads is copied first (copy-on-write).
        assert holders == 1 or int(b.ref_count[blk]) > 1
        checked["writes"] += 1
    return inner(params, state, inputs, **bucket)

  eng._step = checked_step   # pylint: disable=protected-access
  on = outputs(eng.generate(prompts, greedy(8)))
  assert on == outputs(make(False, decode_steps_per_sync=2).generate(
      prompts, greedy(8)))
  assert checked["writes"] > 0 and eng.prefix_stats()["hit_blocks"] > 0


def test_reset_prefix_cache_drops_hits():
  rng = np.random.default_rng(5)
  prompts = shared_prefix_prompts(rng, 2, 20)
  eng = make(True)
  eng.generate(prompts[:1], greedy(2))
  eng.reset_prefix_cache()
  eng.generate(prompts[1:], greedy(2))
  s = eng.prefix_stats()
  assert s["hit_blocks"] == 0 and s["cached_blocks"] > 0
  assert eng.num_free == NUM_BLOCKS


def test_the_flag_turns_caching_on_in_the_same_engine_class():
  assert make(True).state.prefix is not None and make(False).state.prefix is None
  with pytest.raises(ValueError, match="enable_prefix_caching"):
    make(False).prefix_stats()


@pytest.mark.slow
def test_swap_preemption_with_caching_stays_exact():
  rng = np.random.default_rng(6)
  # Short suffixes, long outputs: admitted together, they outgrow the pool later.
  prompts = shared_prefix_prompts(rng, 8, 24, max_suffix=4)
  off = outputs(make(False, preemption_mode="swap").generate(prompts, greedy(20)))
  eng = make(True, preemption_mode="swap")
  assert outputs(eng.generate(prompts, greedy(20))) == off
  assert eng.num_swaps > 0 and eng.prefix_stats()["hit_blocks"] > 0


def test_cache_salt_isolates_tenants_and_hits_within_one():
  rng = np.random.default_rng(8)
  p0, p1 = shared_prefix_prompts(rng, 2, 20, max_suffix=4)       # 5 shared full blocks
  off = outputs(make(False).generate([p0, p1], greedy(3)))
  eng = make(True)

  def hit_tokens(prompt, salt, expected_output):
    before = eng.metrics()["prefix_hit_tokens"]
    assert outputs(eng.generate([prompt], greedy(3, cache_salt=salt))) == [expected_output]
    return eng.metrics()["prefix_hit_tokens"] - before

  assert hit_tokens(p0, "a", off[0]) == 0
  assert hit_tokens(p1, "b", off[1]) == 0       # another salt's prefix: no hit
  assert hit_tokens(p1, None, off[1]) == 0      # nor for unsalted requests
  assert hit_tokens(p1, "a", off[1]) == 20      # its own salt's: the unsalted hit (5 blocks)


@pytest.mark.parametrize("salt", [5, b"a", "", "x" * 1025, ["a"]])
def test_bad_cache_salt_is_a_one_line_error_naming_it(salt):
  with pytest.raises(ValueError, match="cache_salt must be None or a str") as e:
    SamplingParams(cache_salt=salt)
  assert "\n" not in str(e.value)
