"""Ragged paged attention kernel vs the plain-jnp reference (the oracle).

Every case draws random inputs from a seed fixed by its test id (in the failure
message): mixed batches of decode rows and prefill chunks of assorted lengths (chunks starting mid-block,
zero-length sequences, dead sequences past num_seqs, padding rows), randomly permuted
block tables with -1 or out-of-range garbage past each length, and NaN-filled stale pages
and slots, so any read of an unowned key shows up as NaN.

Mode: the Pallas interpreter on CPU (CI). With PAGED_JAX_TEST_COMPILED=1, or when JAX's
default backend is a GPU and the variable is unset, the kernels are compiled with
Triton instead (experiments/gpu_check.sh). The default grid is small; the wide grid is
marked slow.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.triton.ragged_paged_attention import ragged_paged_attention
from ragged_batches import (_test_seed, assert_matches, make_batch, mixed_seqs, reference,
                            rel_err)

_MODE = os.environ.get("PAGED_JAX_TEST_COMPILED")
COMPILED = _MODE == "1" or (_MODE is None and jax.default_backend() == "gpu")
INTERPRET = not COMPILED


def check(seed, args, scales, row_valid, q_dtype, *, ref_kw=None, **kernel_kw):
  ref_kw = dict(ref_kw or {}, **scales)
  out = ragged_paged_attention(*args, interpret=INTERPRET, **ref_kw, **kernel_kw)
  return assert_matches(seed, out, reference(*args, **ref_kw), row_valid, q_dtype)


# ----------------------------------------------------------------------------- fast grid

FAST_CASES = [
    # (group, head_dim, block_size, q_dtype, page_dtype, extra kernel kwargs)
    (1, 64, 16, jnp.float32, None, {}),
    (4, 128, 8, jnp.bfloat16, None, {}),
    (8, 64, 256, jnp.float32, None, {"kv_per_tile": 32}),
    (2, 64, 32, jnp.float32, None, {"kv_splits": 3, "q_per_tile": 8}),
    (2, 64, 16, jnp.float32, jnp.int8, {}),
    (4, 64, 16, jnp.bfloat16, jnp.float8_e4m3fn, {}),
    (3, 64, 4, jnp.float32, None, {}),  # group 3 (padded to 4), block size 4
    (8, 64, 16, jnp.float32, None, {"short_q_per_tile": 4, "q_per_tile": 8}),
    # head_dim not a power of two: computed as 128, pages loaded with a feature mask.
    (4, 80, 16, jnp.float32, None, {"kv_splits": 2}),
    (2, 96, 8, jnp.bfloat16, None, {}),
]


@pytest.mark.parametrize("group,head_dim,block_size,q_dtype,page_dtype,kw", FAST_CASES)
def test_mixed_batch_matches_reference(group, head_dim, block_size, q_dtype, page_dtype, kw):
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = mixed_seqs(rng, block_size, num_decode=3, prefill_q_lens=[int(rng.integers(2, 40)),
                                                                    int(rng.integers(40, 70))])
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=group,
                                       head_dim=head_dim, block_size=block_size,
                                       q_dtype=q_dtype, page_dtype=page_dtype)
  check(seed, args, scales, row_valid, q_dtype, **kw)


def test_soft_cap_sliding_window_and_scale():
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = mixed_seqs(rng, 16, num_decode=2, prefill_q_lens=[33])
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=2, head_dim=64,
                                       block_size=16)
  check(seed, args, scales, row_valid, jnp.float32,
        ref_kw=dict(soft_cap=3.0, sliding_window=int(rng.integers(5, 40)), sm_scale=0.3),
        kv_per_tile=16)


def test_split_k_decode_long_context():
  """Few long sequences: the split-K path and its log-sum-exp combine."""
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = [(1, int(rng.integers(400, 520))), (5, int(rng.integers(200, 300))), (1, 3)]
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=1, group=4, head_dim=64,
                                       block_size=32)
  check(seed, args, scales, row_valid, jnp.float32, kv_splits=4)


def test_inside_jit_with_traced_num_seqs_and_no_live_rows():
  """The engine's usage: one jit, num_seqs traced; num_seqs = 0 gives all zeros."""
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = mixed_seqs(rng, 16, num_decode=2, prefill_q_lens=[20])
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=2, head_dim=64,
                                       block_size=16)
  step = jax.jit(lambda *a: ragged_paged_attention(*a, interpret=INTERPRET))
  out = np.asarray(step(*args))
  ref = np.asarray(reference(*args))
  assert rel_err(out[row_valid], ref[row_valid]) <= 1e-5, f"seed={seed}"
  assert (out[~row_valid] == 0).all()
  empty = np.asarray(step(*args[:-1], jnp.int32(0)))
  assert (empty == 0).all(), f"seed={seed}: num_seqs=0 must give zeros"


def test_split_partials_are_sized_by_tiles():
  """A 1 x 2048 prefill: split-K partials follow the split launch's tiles, not T rows."""
  args, _, _ = make_batch(np.random.default_rng(3), seqs=[(2048, 2048)], num_kv_heads=2,
                          group=2, head_dim=64, block_size=16, padding_rows=0, dead_seqs=0)
  jaxpr = str(jax.make_jaxpr(lambda *a: ragged_paged_attention(*a, kv_splits=8))(*args))
  # The largest f32 buffer is the output-sized one (T x Hq x D), never splits x T x ...
  sizes = [int(np.prod([int(d) for d in m.split(",") if d]))
           for m in __import__("re").findall(r"f32\[([\d,]+)\]", jaxpr)]
  assert max(sizes) <= 2048 * 4 * 64


# ------------------------------------------------------------------------------ validation

def _small_args(**over):
  a = dict(q=jnp.zeros((4, 4, 64)), k_pages=jnp.zeros((2, 8, 16, 64)),
           v_pages=jnp.zeros((2, 8, 16, 64)), block_tables=jnp.zeros((2, 3), jnp.int32),
           kv_lens=jnp.zeros((2,), jnp.int32), cu_q_lens=jnp.zeros((3,), jnp.int32),
           num_seqs=1)
  kw = {k: over.pop(k) for k in list(over) if k not in a}
  a.update(over)
  return a, kw


@pytest.mark.parametrize("over,needle", [
    (dict(q=jnp.zeros((4, 4))), "q has shape"),
    (dict(q=jnp.zeros((4, 4, 64), jnp.int32)), "q has dtype"),
    (dict(q=jnp.zeros((4, 3, 64))), "num_kv_heads"),
    (dict(v_pages=jnp.zeros((2, 8, 8, 64))), "v_pages has shape"),
    (dict(q=jnp.zeros((4, 4, 384)), k_pages=jnp.zeros((2, 8, 16, 384)),
          v_pages=jnp.zeros((2, 8, 16, 384))), "head_dim"),
    (dict(q=jnp.zeros((4, 4, 32))), r"k_pages has shape .*head_dim=32"),
    (dict(k_pages=jnp.zeros((2, 8, 2048, 64)), v_pages=jnp.zeros((2, 8, 2048, 64))),
     "block_size"),
    (dict(block_tables=jnp.zeros((2, 3), jnp.float32)), "block_tables"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), "kv_lens"),
    (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), "cu_q_lens"),
    (dict(num_seqs=3), "num_seqs"),
    (dict(sm_scale=-1.0), "sm_scale"),
    (dict(soft_cap=0.0), "soft_cap"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(k_scales=jnp.ones((2, 8, 8))), "k_scales"),
    (dict(q_per_tile=3), "q_per_tile"),
    (dict(q_per_tile=2), "q_per_tile"),  # 2 rows x group 2 < 16 rows for tl.dot
    (dict(short_q_per_tile=64), "short_q_per_tile"),  # > q_per_tile (16: f32, group 2)
    (dict(kv_per_tile=8), "kv_per_tile"),
    (dict(kv_splits=0), "kv_splits"),
    (dict(num_warps=3), "num_warps"),
    (dict(num_stages=8), "num_stages"),
    # Over the sm_90 shared-memory budget: refused before tracing, naming the budget.
    (dict(q_per_tile=1024), "q_per_tile.*232,448"),
    (dict(kv_per_tile=1024), "kv_per_tile.*232,448"),
])
def test_bad_arguments_raise_naming_the_argument(over, needle):
  args, kw = _small_args(**over)
  with pytest.raises(ValueError, match=needle):
    ragged_paged_attention(**args, interpret=True, **kw)


# ------------------------------------------------------------------------------ wide grid

def _slow_cases():
  cases = []
  block_sizes = [8, 16, 32, 64, 128, 256]
  for i, (bs, group) in enumerate((b, g) for b in block_sizes for g in (1, 2, 4, 8)):
    head_dim = (64, 128)[i % 2]
    dtype = (jnp.float32, jnp.bfloat16, jnp.float16)[(i // 2) % 3]
    splits = (1, 2, 1, 4)[(i // 3) % 4]
    cases.append((group, head_dim, bs, dtype, splits))
  return cases


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("group,head_dim,block_size,q_dtype,kv_splits", _slow_cases())
def test_wide_grid(group, head_dim, block_size, q_dtype, kv_splits):
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = mixed_seqs(rng, block_size, num_decode=4,
                    prefill_q_lens=[int(rng.integers(2, 20)), int(rng.integers(20, 90))],
                    max_ctx=600)
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=group,
                                       head_dim=head_dim, block_size=block_size,
                                       q_dtype=q_dtype)
  check(seed, args, scales, row_valid, q_dtype, kv_splits=kv_splits)


@pytest.mark.slow
@pytest.mark.parametrize("ctx", [513, 1023, 2048])
@pytest.mark.parametrize("page_dtype", [None, jnp.int8, jnp.float8_e4m3fn])
def test_long_contexts_and_quantized_pages(ctx, page_dtype):
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = [(1, ctx), (int(rng.integers(30, 70)), ctx), (1, ctx - 1), (0, 7)]
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=4, head_dim=128,
                                       block_size=16, q_dtype=jnp.bfloat16,
                                       page_dtype=page_dtype)
  check(seed, args, scales, row_valid, jnp.bfloat16)
