"""Speculative decoding's engine-wide back-off (`speculative.back_off`, written by
engine/update.py): a running average of the gain per drafting row per drafting step,
checked against a plain-Python model of the rule on a scripted stream of acceptances."""

import numpy as np
import pytest

from paged_jax.engine import speculative
from tests.engine_oracle import PARAMS, VOCAB, dense_greedy, greedy, oracle_engine

K = 2


def model_drafting_points(script, max_tokens, decay, threshold, new_rule=True):
  """The generated-token counts at which a lone request drafts, under the per-sequence
  rule (a draft with nothing accepted waits 2**misses tokens, misses capped at 6) and the
  engine-wide rule: new_rule, an average of step gains (first gain, then decay * avg +
  (1 - decay) * gain) doubling the wait (2**misses steps, capped at 2**10) while it is
  under `threshold`; else the old rule (misses in a row, reset by any step gaining >=
  threshold). script[i]: drafts the i-th drafting step gets accepted (cut to the draft)."""
  steps, gen, i = 1, 1, 0           # after the prefill step, which samples token 1
  avg, e_miss, retry_step, s_miss, retry_at, points = None, 0, 0, 0, 0, []
  while gen < max_tokens:
    k = min(K, max_tokens - gen - 1)
    if k > 0 and gen >= retry_at and steps >= retry_step:
      a = min(script[i], k)
      i += 1
      points.append(gen)
      gen, steps = gen + a + 1, steps + 1
      s_miss = 0 if a else s_miss + 1
      retry_at = gen + 2 ** min(s_miss, 6) if s_miss else 0
      if new_rule:
        avg = a if avg is None else decay * avg + (1 - decay) * a
        low = avg < threshold
      else:
        low = a < threshold
      e_miss = e_miss + 1 if low else 0
      retry_step = steps + 2 ** min(e_miss, 10) if low else 0
    else:
      gen, steps = gen + 1, steps + 1
  return points


def test_back_off_formula():
  ema, misses, retry = speculative.back_off(None, 0, 0.25, 10)
  assert (ema, misses) == (0.25, 1) and retry == 12
  d = speculative.GAIN_DECAY
  ema2, misses2, retry2 = speculative.back_off(ema, misses, 2.0, 13)
  assert ema2 == pytest.approx(d * 0.25 + (1 - d) * 2.0)
  assert (misses2, retry2) == ((0, 0) if ema2 >= speculative.STEP_MIN_GAIN else (2, 17))


@pytest.mark.parametrize("head", [(0, 1, 0, 0, 2, 0), (0, 0, 1, 0, 1)],
                         ids=["recovers", "stays_low"])
def test_engine_drafts_exactly_where_the_plain_model_says(head):
  """One request; its proposer drafts the oracle's continuation with the first `script[i]`
  drafts right and the next wrong, so each drafting step's gain is scripted: low gains
  (0 or 1 of 2: the old rule reset on each 1) then full ones. The steps that draft must
  be the model's, and the old rule must give other steps (else the test could not fail)."""
  script = list(head) + [2] * 60
  prompt = [int(t) for t in np.random.default_rng(len(head)).integers(0, VOCAB, 8)]
  max_tokens = 54
  calls = []

  def scripted(tokens, k):
    right = dense_greedy(PARAMS, list(tokens), k)
    a = min(script[len(calls)], k)
    calls.append(len(tokens) - len(prompt))
    return right[:a] + [(right[a] + 1) % VOCAB] * (k - a) if a < k else right

  spec = speculative.SpeculativeConfig(num_speculative_tokens=K, proposer=scripted)
  engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=2, budget=32,
                         speculative_config=spec)
  out = engine.generate([prompt], greedy(max_tokens))[0].outputs[0]
  assert out == dense_greedy(PARAMS, prompt, max_tokens)
  expect = model_drafting_points(script, max_tokens, speculative.GAIN_DECAY,
                                 speculative.STEP_MIN_GAIN)
  assert calls == expect
  assert engine.metrics()["spec_steps"] == len(expect)
  old = model_drafting_points(script, max_tokens, speculative.GAIN_DECAY,
                              speculative.STEP_MIN_GAIN, new_rule=False)
  assert old != expect
