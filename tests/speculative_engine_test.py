"""Speculative decoding in the engine: greedy outputs with speculation equal the dense
oracle's and speculation off's, under prefix caching, preemption (recompute, swap) and
multi-step decode; the prefix cache registers only verified tokens; one dispatch and one
sync per step; sampled requests and n = 2 reproducible and cut exactly; beams never
speculate. The parts' unit tests: speculative_test.py."""

import pytest

from paged_jax.engine import SamplingParams
from tests.engine_oracle import (PARAMS, VOCAB, dense_greedy, greedy, oracle_engine,
                                 random_prompts, run_counting_dispatches_and_syncs)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
REPETITIVE = [[1, 2, 3, 4, 5] * 3, [7, 8, 9] * 3, [5] * 6, [10, 11, 12, 13] * 2]


def _run(prompts, max_tokens=16, **kw):
  engine = oracle_engine(**{**dict(block_size=4, num_blocks=64, max_seqs=4, budget=32), **kw})
  ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
  outs = {}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o.outputs
  return [outs[i] for i in ids], engine.metrics(), engine


@pytest.mark.parametrize("kw", [
    dict(),
    dict(caching=True),
    dict(decode_steps_per_sync=3),
    dict(num_blocks=14, preemption_mode="recompute"),
    dict(num_blocks=14, preemption_mode="swap"),
], ids=["plain", "caching", "multistep", "recompute", "swap"])
def test_greedy_outputs_equal_the_oracle_and_speculation_off(kw):
  prompts = REPETITIVE + random_prompts(4, 2)
  off, m_off, _ = _run(prompts, **kw)
  on, m_on, _ = _run(prompts, speculative_config=NGRAM, **kw)
  assert on == off
  for p, out in zip(prompts, on):
    assert out[0] == dense_greedy(PARAMS, p, 16)
  assert m_on["spec_draft_tokens"] == sum(m_on["spec_drafted_by_position"]) > 0
  assert m_on["spec_accepted_tokens"] == sum(m_on["spec_accepted_by_position"]) > 0
  assert m_on["generated_tokens"] == m_off["generated_tokens"]
  if "num_blocks" in kw:
    assert m_on["num_preemptions"] > 0
  else:
    assert m_on["steps"] < m_off["steps"]


def test_prefix_cache_registers_only_verified_tokens():
  """A second round of the same prompts hits blocks the first round registered; if a
  rejected draft had been registered, its block would serve the wrong K/V and the second
  round's outputs would differ from the oracle's."""
  engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=32, caching=True,
                         speculative_config=NGRAM)
  first = engine.generate(REPETITIVE, greedy(16))
  conts = [p + o.outputs[0] for p, o in zip(REPETITIVE, first)]
  second = engine.generate(conts, greedy(8))
  assert engine.metrics()["prefix_hit_tokens"] > 0
  for c, o in zip(conts, second):
    assert o.outputs[0] == dense_greedy(PARAMS, c, 8)


def test_one_dispatch_and_one_sync_per_step(monkeypatch):
  engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=32,
                         speculative_config=NGRAM, decode_steps_per_sync=2)
  for p in REPETITIVE:
    engine.add_request(p, greedy(12))
  run_counting_dispatches_and_syncs(engine, monkeypatch)
  assert engine.metrics()["spec_accepted_tokens"] > 0


def test_sampled_requests_and_parallel_samples_are_reproducible():
  """Sampled rows speculate too (rejection sampling): per-request seeds give the same
  tokens run to run; stop ids and max_tokens cut the emission exactly; n = 2 works."""
  def run():
    engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=6, budget=32,
                           speculative_config=NGRAM)
    sp = SamplingParams(max_tokens=15, temperature=0.8, seed=5, n=2, stop_token_ids=[3])
    outs = engine.generate(REPETITIVE, sp)
    return [o.outputs for o in outs], [o.finish_reasons for o in outs], engine.metrics()
  a, reasons, m = run()
  b, _, _ = run()
  assert a == b
  for outs, rs in zip(a, reasons):
    assert len(outs) == 2
    for o, r in zip(outs, rs):
      assert (3 not in o[:-1]) and (r == "stop") == (o[-1] == 3)
      assert len(o) <= 15 and (r == "length") == (len(o) == 15 and o[-1] != 3)
  assert m["spec_draft_tokens"] > 0


def test_beams_do_not_speculate():
  engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=32,
                         speculative_config=NGRAM)
  plain = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=32)
  sp = SamplingParams(max_tokens=8, beam_width=2, temperature=0.0)
  assert ([o.outputs for o in engine.generate(REPETITIVE[:2], sp)]
          == [o.outputs for o in plain.generate(REPETITIVE[:2], sp)])
  assert engine.metrics()["spec_draft_tokens"] == 0


def test_drafts_that_always_miss_back_off_exponentially():
  """A proposer whose first draft is always wrong (the oracle's next token + 1): every
  draft is rejected, outputs still equal the oracle's, and each sequence drafts at
  generated-token counts 1, 4 and 9 only (after a miss it waits 2, then 4, then 8 tokens
  past the token it emitted: the third wait runs past 12 tokens)."""
  from paged_jax.engine import speculative  # pylint: disable=g-import-not-at-top

  def wrong(tokens, k):
    return [(dense_greedy(PARAMS, list(tokens), 1)[0] + 1) % VOCAB] * k

  spec = speculative.SpeculativeConfig(num_speculative_tokens=2, proposer=wrong)
  prompts = REPETITIVE[:3]
  outs, m, _ = _run(prompts, max_tokens=12, speculative_config=spec)
  for p, out in zip(prompts, outs):
    assert out[0] == dense_greedy(PARAMS, p, 12)
  assert m["spec_accepted_tokens"] == 0
  assert m["spec_draft_tokens"] == 3 * 2 * len(prompts)


@pytest.mark.parametrize("steps", [1, 2])
def test_hybrid_kv_with_prefix_caching_speculates_and_matches_its_oracle(steps):
  """Gemma-like sliding + full layers (two KV groups, prefix caching on): drafts reserve,
  roll back and release out-of-window blocks in both groups; greedy outputs equal the
  hybrid model's dense oracle, a second round hits the cache."""
  import hybrid_support as hs  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  cc = hs.GEMMA.cache_config(hybrid_kv=True, max_num_batched_tokens=32,
                             decode_steps_per_sync=steps, block_size=4, num_blocks=96,
                             max_seqs=4, max_blocks_per_seq=16, enable_prefix_caching=True)
  engine = Engine(hs.GEMMA, hs.PARAMS, cc, max_num_batched_tokens=32, attention_backend="cpu",
                  decode_steps_per_sync=steps, speculative_config=NGRAM)
  prompts = [[3, 4, 5, 6] * 4, [9, 8, 7] * 4, [11, 12] * 5]
  for _ in range(2):
    outs = engine.generate(prompts, greedy(12))
    for p, o in zip(prompts, outs):
      assert o.outputs[0] == hs.dense_greedy(p, 12)
  m = engine.metrics()
  assert m["spec_draft_tokens"] > 0 and m["prefix_hit_tokens"] > 0
