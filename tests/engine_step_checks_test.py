"""The jitted step's boundary, with chex: it traces at most once per shape bucket
(`chex.assert_max_traces` around the step function), and a malformed StepInputs (wrong
dtype or shape) is refused at trace time, before anything runs."""

import functools

import chex
import jax
import numpy as np
import pytest

from paged_jax.engine import SamplingParams
from paged_jax.engine import step as step_lib
from paged_jax.models import llama

from engine_oracle import (MC, PARAMS, dense_greedy, greedy, oracle_engine, random_prompts,
                           record_buckets)

# The cache shape of engine_test.py (its compiled step is reused).
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET = 16, 12, 8, 8

make_engine = functools.partial(oracle_engine, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                max_seqs=MAX_SEQS, budget=BUDGET)


def test_the_step_traces_at_most_once_per_bucket(monkeypatch):
  # chex.assert_max_traces around the step function itself: a run that meets k shape
  # buckets may trace it k times, and a replay on a twin engine may not trace it more.
  prompts = random_prompts(71, 6, lo=1, hi=20)
  params = [greedy(6), SamplingParams(max_tokens=5, n=2, temperature=0.7, seed=1)] * 3
  used = record_buckets(monkeypatch)
  want = make_engine().generate(prompts, params)
  model = llama.LlamaForCausalLM(MC, attention_backend="reference")
  raw = step_lib.make_step(model.apply, num_decode_steps=1, num_candidates=8, jit=False)
  counted = jax.jit(chex.assert_max_traces(raw, n=len(set(used))), donate_argnums=(1,),
                    static_argnames=("width", "decode_only", "all_greedy"))
  twin = make_engine()
  twin._step = counted   # pylint: disable=protected-access
  got = twin.generate(prompts, params)
  assert [o.outputs for o in got] == [o.outputs for o in want]
  assert len(set(used)) >= 2


@pytest.mark.parametrize("field, value", [
    ("temperature", np.zeros((MAX_SEQS,), np.int32)),        # dtype
    ("stop_ids", np.full((MAX_SEQS, 3), -1, np.int32)),       # shape
    ("row_slot", np.full((MAX_SEQS + 1,), -1, np.int32)),     # more rows than slots
])
def test_step_inputs_are_checked_at_the_step_boundary(field, value):
  # chex shape / dtype assertions at trace time: a malformed StepInputs never runs
  # (and the donated state survives the refusal).
  from paged_jax.engine.inputs import empty_inputs
  engine = make_engine()
  a = empty_inputs(BUDGET, MAX_SEQS, 1)
  a[field] = value
  with pytest.raises((AssertionError, ValueError)):
    step = engine._step   # pylint: disable=protected-access
    step(engine.params, engine.state, step_lib.StepInputs(**a))
  assert engine.generate([[1, 2, 3]], greedy(2))[0].outputs[0] == dense_greedy(
      PARAMS, [1, 2, 3], 2)
