"""Engine-level prefix-caching helpers shared by prefix_cache_engine_test and
eviction_policy_test: one small cache shape, an engine factory, shared-prefix prompts."""

from paged_jax.engine import Engine, SamplingParams

from engine_oracle import MC, ORACLE_LEN, PARAMS, VOCAB
import engine_oracle

# One cache shape (24 blocks of 4 tokens: small enough that most tests also
# evict and preempt) and decode_steps_per_sync in {1, 2}, so steps compile twice.
BS, NUM_BLOCKS, MAX_SEQS, BUDGET = 4, 24, 6, 16


def dense_greedy(prompt, max_tokens):
  return engine_oracle.dense_greedy(PARAMS, prompt, max_tokens)


def make(caching, num_blocks=NUM_BLOCKS, **kw):
  cc = MC.cache_config(block_size=BS, num_blocks=num_blocks, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=ORACLE_LEN // BS, enable_prefix_caching=caching)
  return Engine(MC, PARAMS, cc, **{"max_num_batched_tokens": BUDGET,
                                   "attention_backend": "reference", **kw})


def shared_prefix_prompts(rng, count, prefix_len, max_suffix=12):
  prefix = [int(t) for t in rng.integers(0, VOCAB, prefix_len)]
  return [prefix + [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, max_suffix)))]
          for _ in range(count)]


def greedy(n=6, **kw):
  return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def outputs(results):
  return [r.outputs for r in results]
