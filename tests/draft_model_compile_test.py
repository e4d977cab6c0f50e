"""The draft model's proposal dispatch (`engine/draft_model.py`: catch-up over the step's
tokens, then k - 1 single-token iterations on a local copy of group 0's allocator),
compiled by XLA for a compile-only H200, as gpu_compile_model_test.py does for the engine
step: no pool-sized buffer or copy, the donated draft pages updated in place, no spill,
no host readback; with prefix caching too (the draft_reuse marks)."""

import dataclasses

import pytest

import jax

from pallas_kernels.deviceless import target as ct
from tests.gpu_compile_support import (CACHE_4G, LLAMA8B_2L, host_readbacks,
                                       layer_pool_bytes, pool_copy_findings)

pytestmark = pytest.mark.skipif(ct.unavailable_reason() is not None,
                                reason=str(ct.unavailable_reason()))


@pytest.mark.slow   # one compile of a 2-layer Llama-8B-shaped draft: ~20 s of CPU or more
@pytest.mark.parametrize("caching", [False, True])   # True: it marks whole blocks too
def test_draft_proposal_compiles_for_h200_without_pool_copies_or_spills(caching):
  from paged_jax.engine import draft_model  # pylint: disable=g-import-not-at-top
  sharding = jax.sharding.SingleDeviceSharding(ct.sm90_device())
  cache = dataclasses.replace(CACHE_4G, enable_prefix_caching=caching)
  fn, args = draft_model.propose_for_compile(LLAMA8B_2L, cache, k=3, num_tokens=64,
                                             sharding=sharding)
  pool = 2 * LLAMA8B_2L.num_layers * layer_pool_bytes(CACHE_4G)
  assert pool >= 4 * 2**30
  report, findings, hlo = pool_copy_findings(fn, args, CACHE_4G, pool_bytes_donated=pool,
                                             keep_hlo=True)
  assert not findings, findings
  assert not report.spilled_kernels
  assert report.max_shared_memory <= ct.SM90_SHARED_MEMORY_BYTES
  readbacks = host_readbacks(hlo)
  assert not readbacks["while"] and not readbacks["conditional"], readbacks
