"""experiments/speculative and experiments/speculative_scale: the workloads and the stand-in
proposer they rest on, and their flags' one-line errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import speculative as spec_cpu
from experiments import speculative_scale
from paged_jax import kv_cache
from paged_jax.models import standin


def _standin_greedy(params, config, tokens, positions):
  """The stand-in forward's argmax at each (token, position): what the engine decodes."""
  cache = config.cache_config(block_size=4, num_blocks=4, max_seqs=1, max_blocks_per_seq=4)

  class Meta:   # the fields `standin.apply` reads
    slot_mapping = jnp.full((len(tokens),), -1, jnp.int32)
    logits_indices = jnp.arange(len(tokens), dtype=jnp.int32)
  logits, _ = standin.apply(params, jnp.asarray(tokens, jnp.int32),
                            jnp.asarray(positions, jnp.int32), kv_cache.init(cache), Meta)
  return np.argmax(np.asarray(logits), axis=-1)


def test_standin_proposer_follows_the_standin_model_at_alpha_one_and_misses_at_zero():
  config, params = standin.model(64, max_position_embeddings=64)
  rng = np.random.default_rng(0)
  for _ in range(5):
    tokens = [int(t) for t in rng.integers(0, 64, int(rng.integers(1, 20)))]
    draft = speculative_scale.standin_proposer(64, 1.0, 0)(tokens, 4)
    assert len(draft) == 4
    # Each draft token is the model's greedy token after the one before it.
    prev = [tokens[-1]] + list(draft[:-1])
    pos = np.arange(len(tokens) - 1, len(tokens) + 3)
    np.testing.assert_array_equal(_standin_greedy(params, config, prev, pos), draft)
    wrong = speculative_scale.standin_proposer(64, 0.0, 0)(tokens, 4)
    assert len(wrong) == 1 and wrong[0] != draft[0]


def test_cpu_workloads_are_seeded_and_shaped():
  f = spec_cpu.Config(requests=3, echo=20, plain_len=30)
  rep = spec_cpu.workload(f, "repetitive")
  assert rep == spec_cpu.workload(f, "repetitive")
  for p in rep:   # the story's first `echo` bytes come again after a blank line
    text = bytes(p[1:]).decode()
    story, again = text.split("\n\n")
    assert story.startswith(again) and len(again) == 20
  assert all(len(p) == 31 for p in spec_cpu.workload(f, "plain"))
  assert all(len(p) == 31 for p in spec_cpu.workload(f, "no_match"))


@pytest.mark.parametrize("cls, kw, name", [
    (spec_cpu.Config, dict(lookup_min=5, lookup_max=3), "lookup_min"),
    (spec_cpu.Config, dict(ks=(0,)), "ks"),
    (speculative_scale.Config, dict(alphas=(1.5,)), "alphas"),
])
def test_bad_flags_are_one_line_errors(cls, kw, name):
  with pytest.raises(ValueError) as e:
    cls(**kw)
  assert name in str(e.value) and "\n" not in str(e.value)
