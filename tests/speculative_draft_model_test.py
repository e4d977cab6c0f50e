"""Speculative decoding with a draft model (`engine/draft_model.py`): greedy outputs equal
the dense oracle's and speculation off's; with the target itself as its draft every draft
is accepted (the draft's K/V on group 0's block tables, its catch-up, chunking and reset
after preemption must all be right for that), under prefix caching and preemption by
recompute; a truncated-layer copy drafts and some drafts fail; refused combinations are
one-line errors."""

import dataclasses

import jax
import pytest

from paged_jax.engine import SamplingParams
from tests.engine_oracle import (MC, PARAMS, VOCAB, dense_greedy, greedy, oracle_engine,
                                 random_prompts)

REPETITIVE = [[1, 2, 3, 4, 5] * 3, [7, 8, 9] * 3, [5] * 6, [10, 11, 12, 13] * 2]
LONG = [[int(t) % VOCAB for t in range(3, 3 + 7 * 30, 7)]]   # 30 tokens > the budget of 16
SELF = {"method": "draft_model", "model": (MC, PARAMS), "num_speculative_tokens": 3}


def _truncated():
  """A one-layer copy of the target (its first layer, embeddings, norm and head)."""
  p = PARAMS["params"]
  model = {k: v for k, v in p["model"].items() if k != "layers_1"}
  return dataclasses.replace(MC, num_layers=1), {"params": {**p, "model": model}}


def _run(prompts, spec=None, max_tokens=16, **kw):
  engine = oracle_engine(**{**dict(block_size=4, num_blocks=64, max_seqs=4, budget=32), **kw},
                         speculative_config=spec)
  outs = engine.generate(prompts, greedy(max_tokens))
  return [o.outputs[0] for o in outs], engine.metrics(), engine


@pytest.mark.parametrize("kw", [
    dict(),
    dict(budget=16),
    dict(caching=True),
    dict(num_blocks=14, preemption_mode="recompute"),
], ids=["plain", "chunked_catchup", "caching", "recompute"])
def test_self_draft_accepts_every_draft_and_outputs_equal_the_oracle(kw):
  prompts = REPETITIVE + random_prompts(4, 2) + (LONG if kw.get("budget") == 16 else [])
  off, m_off, _ = _run(prompts, **kw)
  on, m, engine = _run(prompts, SELF, **kw)
  assert on == off
  for p, out in zip(prompts, on):
    assert out == dense_greedy(PARAMS, p, 16)
  assert m["spec_draft_tokens"] > 0
  assert m["spec_accepted_tokens"] == m["spec_draft_tokens"]   # acceptance 1.0
  assert m["generated_tokens"] == m_off["generated_tokens"]
  stats = engine._drafter.stats   # pylint: disable=protected-access
  assert stats["dispatches"] == m["spec_steps"] or stats["dispatches"] >= m["spec_steps"]
  if "num_blocks" in kw:
    assert m["num_preemptions"] > 0
  else:
    assert m["steps"] < m_off["steps"]
  if kw.get("budget") == 16:   # the long prompt caught up over more than one dispatch
    assert stats["catchup_tokens"] > 0


def test_prefix_hits_keep_every_draft_accepted():
  """A second round of continuations hits the blocks the first registered; the draft
  catches up over the hit tokens and still agrees with the target everywhere."""
  engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=32, caching=True,
                         speculative_config=SELF)
  first = engine.generate(REPETITIVE, greedy(12))
  conts = [p + o.outputs[0] for p, o in zip(REPETITIVE, first)]
  second = engine.generate(conts, greedy(8))
  m = engine.metrics()
  assert m["prefix_hit_tokens"] > 0
  for c, o in zip(conts, second):
    assert o.outputs[0] == dense_greedy(PARAMS, c, 8)
  assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0


def test_truncated_draft_outputs_equal_the_oracle():
  prompts = REPETITIVE + random_prompts(5, 2)
  spec = {"method": "draft_model", "model": _truncated(), "num_speculative_tokens": 2}
  on, m, _ = _run(prompts, spec)
  for p, out in zip(prompts, on):
    assert out == dense_greedy(PARAMS, p, 16)
  assert m["spec_draft_tokens"] > 0
  assert m["spec_accepted_tokens"] < m["spec_draft_tokens"]   # a different model


def test_sampled_requests_are_reproducible_and_cut_exactly():
  def run():
    engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=32,
                           speculative_config=SELF)
    sp = SamplingParams(max_tokens=15, temperature=0.8, seed=5, stop_token_ids=[3])
    outs = engine.generate(REPETITIVE, sp)
    return [o.outputs[0] for o in outs], [o.finish_reasons[0] for o in outs], engine.metrics()
  a, reasons, m = run()
  b, _, _ = run()
  assert a == b and m["spec_draft_tokens"] > 0
  for o, r in zip(a, reasons):
    assert 3 not in o[:-1] and (r == "stop") == (o[-1] == 3) and len(o) <= 15


def _other_vocab():
  c = dataclasses.replace(MC, vocab_size=VOCAB + 1)
  from paged_jax.models import llama  # pylint: disable=g-import-not-at-top
  return c, llama.init_params(c, jax.random.key(1))


@pytest.mark.parametrize("spec, kw, name", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, {}, "model"),
    ({**SELF, "prompt_lookup_max": 3}, {}, "prompt_lookup_max"),
    ({**SELF, "num_speculative_tokens": 0}, {}, "num_speculative_tokens"),
    ({**SELF, "model": "/no/such/dir"}, {}, "model"),
    ({**SELF, "model": 3}, {}, "model"),
    ("vocab", {}, "vocab_size"),
    (SELF, dict(preemption_mode="swap"), "swap"),
    (SELF, dict(decode_steps_per_sync=2), "decode_steps_per_sync"),
])
def test_refused_configs_are_one_line_errors(spec, kw, name):
  if spec == "vocab":
    spec = {**SELF, "model": _other_vocab()}
  with pytest.raises(ValueError) as e:
    oracle_engine(block_size=4, num_blocks=16, max_seqs=2, budget=16, speculative_config=spec,
                  **kw)
  assert name in str(e.value) and "\n" not in str(e.value)


def test_parallel_samples_and_hybrid_models_are_refused():
  engine = oracle_engine(block_size=4, num_blocks=16, max_seqs=2, budget=16,
                         speculative_config=SELF)
  with pytest.raises(ValueError) as e:
    engine.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=4))
  assert "n must be" in str(e.value) and "\n" not in str(e.value)
  import hybrid_support as hs  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  cc = hs.GEMMA.cache_config(hybrid_kv=True, max_num_batched_tokens=32, block_size=4,
                             num_blocks=96, max_seqs=4, max_blocks_per_seq=16)
  with pytest.raises(ValueError) as e:
    Engine(hs.GEMMA, hs.PARAMS, cc, max_num_batched_tokens=32, attention_backend="cpu",
           speculative_config={**SELF, "model": (hs.GEMMA, hs.PARAMS)})
  assert "sliding" in str(e.value) and "\n" not in str(e.value)
