"""`sweep.system_sizes` against plain-Python counts of the KV memory each system holds."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.bench import sweep
from paged_jax.bench import workloads


def _stream(prefix_len: int, seed: int):
  """A few-shot-like stream: one shared prefix, then 5-60 tokens of each request's own."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(0, 1000, prefix_len, dtype=np.int32)
  reqs = []
  for i in range(40):
    tail = rng.integers(0, 1000, int(rng.integers(5, 60)), dtype=np.int32)
    reqs.append(workloads.Request(i, np.concatenate([prefix, tail]), int(rng.integers(1, 80))))
  return reqs


@pytest.mark.parametrize("prefix_len,block_size", [(80, 16), (341, 16), (341, 32), (7, 16)])
def test_paged_holds_a_shared_prefix_once(prefix_len, block_size):
  reqs = _stream(prefix_len, seed=prefix_len + block_size)
  budget = 16_384
  sizes = sweep.system_sizes("paged", reqs, kv_budget_tokens=budget, block_size=block_size,
                             max_len=2048, max_seqs_cap=4096, shared_prefix_tokens=prefix_len)
  # Reference: the prefix's whole blocks sit in memory once; each request holds the rest of
  # its prompt, half its output on average and half a block of rounding.
  shared = block_size * (prefix_len // block_size)
  own = [r.prompt_len - shared + r.output_len / 2 + block_size / 2 for r in reqs]
  want = (budget - shared) / (sum(own) / len(own))
  assert sizes["memory_concurrency"] == pytest.approx(want, rel=1e-12)
  plain = sweep.system_sizes("paged", reqs, kv_budget_tokens=budget, block_size=block_size,
                             max_len=2048, max_seqs_cap=4096)
  if shared:
    assert sizes["memory_concurrency"] > plain["memory_concurrency"]
    assert sizes["max_seqs"] > plain["max_seqs"]
  else:   # a prefix shorter than a block shares nothing
    assert sizes == plain


def test_orca_never_shares_a_prefix():
  reqs = _stream(341, seed=1)
  for system in ("orca_oracle", "orca_pow2", "orca_max"):
    kw = dict(kv_budget_tokens=16_384, block_size=16, max_len=2048, max_seqs_cap=4096)
    assert (sweep.system_sizes(system, reqs, shared_prefix_tokens=341, **kw)
            == sweep.system_sizes(system, reqs, **kw))


def test_few_shot_streams_name_their_shared_prefix():
  assert sweep.shared_prefix_tokens("fewshot-1") == workloads.FEW_SHOT_PREFIX_LEN[1]
  assert sweep.shared_prefix_tokens("fewshot-5") == workloads.FEW_SHOT_PREFIX_LEN[5]
  assert sweep.shared_prefix_tokens("sharegpt") == 0
  prefix, reqs = workloads.shared_prefix(8, num_shots=5, seed=0)
  assert all((r.prompt_token_ids[:prefix.size] == prefix).all() for r in reqs)
  assert prefix.size == sweep.shared_prefix_tokens("fewshot-5")
