"""paged_jax.bench.prefix_blocks against a plain-Python prefix cache (whole blocks, the
prompt's last token never reused), and its lookup-cost run at a tiny pool."""

import numpy as np
import pytest

from paged_jax.bench import prefix_blocks
from paged_jax.bench import workloads


def _python_prefix_hits(prompts, block_size):
  """Plain-Python prefix cache: hit tokens per prompt, run in order, nothing evicted."""
  registered, hits = set(), []
  for p in prompts:
    p = tuple(int(t) for t in p)
    k = 0
    while k < (len(p) - 1) // block_size and p[:(k + 1) * block_size] in registered:
      k += 1
    hits.append(k * block_size)
    registered.update(p[:m * block_size] for m in range(1, len(p) // block_size + 1))
  return hits


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_prefix_hit_rate_matches_a_python_prefix_model(block_size):
  seed = int(np.random.default_rng(104).integers(1000))
  reqs = workloads.alpaca(10, seed=seed, max_len=128, vocab_size=3)   # tiny vocab: deep matches
  rate = prefix_blocks.prefix_hit_rate(reqs, block_size, prefix_len=40, max_len=128, seed=seed)
  prefix = np.random.default_rng([seed, 11]).integers(0, 1 << 15, 40, dtype=np.int32)
  prompts = [np.concatenate([prefix, r.prompt_token_ids]) for r in reqs]
  expected = sum(_python_prefix_hits(prompts, block_size)) / sum(len(p) for p in prompts)
  assert rate == pytest.approx(expected)
  assert rate > 0


def test_hit_rate_by_block_size_matches_whole_block_reuse():
  # Each pair shares a random-length prefix: the second prompt reuses the whole blocks of
  # the shared part, never the prompt's last token (a plain count of the same rule).
  seed = int(np.random.default_rng(108).integers(1000))
  prompt_len, pairs = 64, 4
  rows = prefix_blocks.hit_rate_by_block_size((16,), num_pairs=pairs,
                                              prompt_len=prompt_len, seed=seed)
  cuts = np.random.default_rng(seed)
  cuts.integers(0, 256, (pairs, prompt_len))
  cuts = cuts.integers(1, prompt_len, pairs)                 # the generator's draws, in order
  shared = np.minimum(cuts, prompt_len - 1)
  for row in rows:
    bs = row["block_size"]
    hits = np.minimum(shared // bs, (prompt_len - 1) // bs) * bs
    assert row["hit_rate"] == pytest.approx(hits.sum() / shared.sum())
    assert row["lost_tokens"] == pytest.approx((shared - hits).mean())
  assert [r["block_size"] for r in rows] == [16] and 0 < rows[0]["hit_rate"] < 1


@pytest.mark.slow
def test_lookup_cost_at_a_small_pool():
  # The run asserts itself that the lookup finds every cached block and that each
  # eviction batch frees 16; here: one finite row per pool size.
  rows = prefix_blocks.lookup_cost([256], cached_blocks=64, reps=3)
  assert [r["num_blocks"] for r in rows] == [256]
  for key in ("lookup_s", "lookup_s_per_block", "evict16_s", "topk16_s", "count_evictable_s"):
    assert np.isfinite(rows[0][key]) and rows[0][key] > 0
