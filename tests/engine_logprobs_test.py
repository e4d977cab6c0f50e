"""Per-token logprobs from the engine equal the dense oracle's log-softmax.

`RequestOutput.logprobs[j][i]` must be log p(outputs[j][i] | prompt, outputs[j][:i]) under
the model's raw distribution, whatever the step did: the first forward or the multi-step
decode loop, greedy or sampled, n > 1, a preemption by recompute on a tight pool. The
reference recomputes every position from scratch (`models.dense.forward`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import tokenizer
from paged_jax.engine import Engine, SamplingParams
from paged_jax.models import DEFAULT_CHECKPOINT, dense, load_hf_checkpoint

PROMPTS = ["Once upon a time", "The dog", "In the"]


@pytest.fixture(scope="module")
def model():
  return load_hf_checkpoint(DEFAULT_CHECKPOINT)


def _dense_logprobs(model, prompt, generated):
  config, params = model
  ids = jnp.asarray(prompt + generated, jnp.int32)[None]
  logp = jax.nn.log_softmax(dense.forward(params, config, ids)[0].astype(jnp.float32), -1)
  at = np.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
  return np.asarray(logp[at, np.asarray(generated)])


@pytest.mark.parametrize("steps,num_blocks,temperature,n", [
    (1, 64, 0.0, 1), (4, 64, 0.8, 2), (1, 5, 0.8, 1)])
def test_logprobs_equal_the_dense_oracle(model, steps, num_blocks, temperature, n):
  config, params = model
  cache = config.cache_config(block_size=8, max_seqs=6, max_blocks_per_seq=8,
                              num_blocks=num_blocks)
  engine = Engine(config, params, cache, max_num_batched_tokens=64,
                  decode_steps_per_sync=steps)
  prompts = [tokenizer.encode(p) for p in PROMPTS]
  outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=temperature,
                                                 seed=7, n=n))
  if num_blocks == 5:   # the pool holds one sequence at a time: someone was preempted
    assert engine.num_preemptions > 0
  for p, o in zip(prompts, outs):
    assert len(o.logprobs) == n
    for ids, lps in zip(o.outputs, o.logprobs):
      assert len(lps) == len(ids) > 0
      np.testing.assert_allclose(lps, _dense_logprobs(model, p, ids), atol=2e-4, rtol=1e-4)
      assert all(lp <= 0 for lp in lps)
