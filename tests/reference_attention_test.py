"""Reference paged attention vs an independent float64 NumPy oracle on the contiguous cache.

The oracle walks each sequence's block table in plain Python, builds its contiguous K/V,
and runs per-head softmax attention in float64. `dense_attention` (the contiguous jnp
baseline) is checked against the same oracle, so the two jnp paths are never only
compared with each other.
"""

import math
import zlib

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attention_oracle import (contiguous, decode_oracle, make_cache, oracle_one,
                              ragged_oracle, rel_err)
from pallas_kernels import reference as ref


def test_make_cache_gives_disjoint_live_blocks():
  # The test helper itself: live blocks of different sequences never overlap.
  rng = np.random.default_rng(1)
  _, _, _, _, tables = make_cache(rng, num_kv_heads=1, num_blocks=32, block_size=4,
                                  head_dim=2, lengths=[5, 8, 0, 13], pages_per_seq=5)
  live = [tables[s, :-(-n // 4)] for s, n in enumerate([5, 8, 0, 13])]
  flat = np.concatenate(live)
  assert len(set(flat.tolist())) == flat.size


def _seed(*case) -> int:
  """A stable seed per case (hash() of a str changes with every Python process)."""
  return zlib.crc32(repr(case).encode())


BS = 8
LENGTHS = [0, 1, BS - 1, BS, BS + 1, 5 * BS + 3]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,opts", [
    (4, 4, dict()),
    (8, 2, dict()),
    (4, 1, dict()),
    (8, 2, dict(sm_scale=0.3)),
    (4, 1, dict(soft_cap=2.5, sm_scale=1.7)),
    (4, 4, dict(sliding_window=5)),
    (8, 2, dict(sliding_window=1)),
    (4, 1, dict(sliding_window=12, soft_cap=4.0)),
])
def test_decode_reference_matches_oracle(num_q_heads, num_kv_heads, opts):
  rng = np.random.default_rng(_seed(num_q_heads, num_kv_heads, opts))
  head_dim = 16
  k, v, _, _, tables = make_cache(rng, num_kv_heads=num_kv_heads, num_blocks=48,
                                  block_size=BS, head_dim=head_dim, lengths=LENGTHS,
                                  pages_per_seq=7)
  q = rng.normal(size=(len(LENGTHS), num_q_heads, head_dim)).astype(np.float32)
  out = ref.paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(tables), jnp.asarray(LENGTHS, jnp.int32),
                                      **opts)
  want = decode_oracle(q, k, v, None, None, tables, LENGTHS,
                       sm_scale=opts.get("sm_scale", 1 / math.sqrt(head_dim)),
                       soft_cap=opts.get("soft_cap"), window=opts.get("sliding_window"))
  chex.assert_shape(out, q.shape)
  chex.assert_tree_all_finite(out)
  out = np.asarray(out)
  assert np.all(out[0] == 0)  # length 0 -> zeros
  assert rel_err(out, want) <= 1e-5


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_decode_reference_quantized_pages(quant):
  rng = np.random.default_rng(7)
  lengths = [3, BS, 2 * BS + 5]
  k, v, ks, vs, tables = make_cache(rng, num_kv_heads=2, num_blocks=16, block_size=BS,
                                    head_dim=16, lengths=lengths, pages_per_seq=4,
                                    quant=quant)
  q = rng.normal(size=(3, 4, 16)).astype(np.float32)
  out = ref.paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(tables), jnp.asarray(lengths, jnp.int32),
                                      k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs))
  want = decode_oracle(q, k, v, ks, vs, tables, lengths, sm_scale=0.25, soft_cap=None,
                       window=None)
  assert rel_err(out, want) <= 1e-5
  # Dropping the scales must change the answer (the scales are really applied).
  unscaled = ref.paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                           jnp.asarray(tables),
                                           jnp.asarray(lengths, jnp.int32))
  assert rel_err(unscaled, want) > 1e-2


def test_decode_reference_bf16_returns_bf16():
  rng = np.random.default_rng(3)
  lengths = [BS + 1, 3 * BS]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=2, num_blocks=12, block_size=BS,
                                  head_dim=32, lengths=lengths, pages_per_seq=4,
                                  dtype=ml_dtypes.bfloat16)
  q = rng.normal(size=(2, 4, 32)).astype(ml_dtypes.bfloat16)
  out = ref.paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))
  chex.assert_type(out, jnp.bfloat16)
  chex.assert_shape(out, q.shape)
  want = decode_oracle(q, k, v, None, None, tables, lengths, sm_scale=1 / math.sqrt(32),
                       soft_cap=None, window=None)
  assert rel_err(out, want) <= 1e-2


def ragged_case(rng, q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, pad_rows,
                pad_seqs):
  """Ragged batch; pad_seqs extra table rows beyond num_seqs hold garbage lengths."""
  all_kv = list(kv_lens) + [int(rng.integers(1, 20)) for _ in range(pad_seqs)]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=num_kv_heads, num_blocks=64,
                                  block_size=BS, head_dim=head_dim, lengths=all_kv,
                                  pages_per_seq=8)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  cu = np.concatenate([cu, np.full(pad_seqs, cu[-1], np.int32)])
  t = int(cu[-1]) + pad_rows
  q = rng.normal(size=(t, num_q_heads, head_dim)).astype(np.float32)
  return q, k, v, tables, np.asarray(all_kv, np.int32), cu


@pytest.mark.parametrize("num_q_heads,num_kv_heads,opts", [
    (4, 2, dict()),
    (2, 2, dict(soft_cap=3.0)),
    (4, 1, dict(sliding_window=6)),
    (4, 2, dict(sliding_window=1, soft_cap=2.0)),
])
def test_ragged_reference_matches_oracle(num_q_heads, num_kv_heads, opts):
  rng = np.random.default_rng(_seed(num_q_heads, num_kv_heads, opts))
  # decode rows, a full prefill, a chunk on top of a cached prefix, an empty sequence.
  q_lens = [1, 9, 5, 1, 0, 3]
  kv_lens = [1, 9, 5 + 2 * BS + 3, BS + 1, 4, 3]
  q, k, v, tables, all_kv, cu = ragged_case(rng, q_lens, kv_lens, num_q_heads,
                                            num_kv_heads, 16, pad_rows=3, pad_seqs=2)
  out = ref.ragged_paged_attention_reference(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables),
      jnp.asarray(all_kv), jnp.asarray(cu), jnp.int32(len(q_lens)), rows_per_step=4, **opts)
  want = ragged_oracle(q, k, v, tables, all_kv, cu, len(q_lens), sm_scale=0.25,
                       soft_cap=opts.get("soft_cap"), window=opts.get("sliding_window"))
  chex.assert_shape(out, q.shape)
  chex.assert_tree_all_finite(out)
  out = np.asarray(out)
  assert np.all(out[int(cu[len(q_lens)]):] == 0)  # padding rows
  assert rel_err(out, want) <= 1e-5


def test_ragged_equals_decode_for_one_query_per_sequence():
  rng = np.random.default_rng(11)
  lengths = [1, BS, 3 * BS + 2]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=2, num_blocks=16, block_size=BS,
                                  head_dim=16, lengths=lengths, pages_per_seq=4)
  q = jnp.asarray(rng.normal(size=(3, 4, 16)), jnp.float32)
  args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(lengths))
  dec = ref.paged_attention_reference(q, *args)
  rag = ref.ragged_paged_attention_reference(q, *args, jnp.arange(4, dtype=jnp.int32),
                                             jnp.int32(3))
  chex.assert_trees_all_close(rag, dec, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("opts", [dict(), dict(soft_cap=2.0, sliding_window=7)])
def test_dense_attention_matches_oracle(opts):
  rng = np.random.default_rng(5)
  b, tq, hq, hkv, d, l = 3, 4, 6, 2, 8, 20
  q = rng.normal(size=(b, tq, hq, d)).astype(np.float32)
  k = rng.normal(size=(b, l, hkv, d)).astype(np.float32)
  v = rng.normal(size=(b, l, hkv, d)).astype(np.float32)
  kv_lens = np.array([0, 7, 20], np.int32)
  pos = np.stack([np.arange(tq) + max(n - tq, 0) for n in kv_lens]).astype(np.int32)
  pos[0] = -1
  out = ref.dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
                            jnp.asarray(kv_lens), sm_scale=0.4, **opts)
  want = np.stack([
      oracle_one(q[i].astype(np.float64), pos[i], k[i, :kv_lens[i]].astype(np.float64),
                 v[i, :kv_lens[i]].astype(np.float64), kv_lens[i], 0.4,
                 opts.get("soft_cap"), opts.get("sliding_window")) for i in range(b)])
  assert rel_err(out, want) <= 1e-5


def test_reference_under_jit_with_traced_lengths():
  rng = np.random.default_rng(9)
  lengths = [2 * BS, 3]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=1, num_blocks=8, block_size=BS,
                                  head_dim=8, lengths=lengths, pages_per_seq=3)
  q = jnp.asarray(rng.normal(size=(2, 2, 8)), jnp.float32)
  f = jax.jit(ref.paged_attention_reference)
  out = f(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(lengths))
  want = decode_oracle(np.asarray(q), k, v, None, None, tables, lengths,
                       sm_scale=1 / math.sqrt(8), soft_cap=None, window=None)
  assert rel_err(out, want) <= 1e-5


def test_mismatched_heads_rejected():
  q = jnp.ones((1, 3, 8))
  pages = jnp.ones((2, 4, 8, 8))
  with pytest.raises(ValueError, match="num_kv_heads"):
    ref.paged_attention_reference(q, pages, pages, jnp.zeros((1, 1), jnp.int32),
                                  jnp.ones((1,), jnp.int32))
