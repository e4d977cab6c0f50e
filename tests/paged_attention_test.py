"""Pallas paged decode kernel (interpret mode on CPU) vs the float64 NumPy oracle.

Every case uses fresh random inputs, randomly permuted block tables whose entries past a
sequence's length are -1 or random (sometimes far out of range), and caches whose unused
blocks and stale page tails are NaN, so a single read of a page the kernel must not touch
shows up as NaN. The Pallas interpreter fills every kernel output with NaN before the run
(jax/_src/pallas/hlo_interpreter.py), so an output element the kernel forgets to write is
poisoned too: all outputs must be finite, and length-0 rows exactly zero.

Error is ||out - oracle|| / ||oracle||: fp32 <= 1e-5, bf16 / fp16 / int8 / fp8 <= 1e-2.
The default grid is small (CI); the wide grid is marked slow.
"""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attention_oracle import (check_decode_output, decode_case, decode_oracle, make_cache,
                              rel_err)
from paged_jax import attention
from pallas_kernels import paged_attention, paged_attention_reference
from pallas_kernels.triton import paged_attention as kernel_module   # the Triton kernel
from pallas_kernels.triton import tuning

TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


def boundary_lengths(bs, extra=()):
  return [0, 1, bs - 1, bs, bs + 1, 3 * bs + 2] + list(extra)


ON_GPU = jax.default_backend() == "gpu"


def run_case(seed, *, block_size, group, head_dim, dtype="float32", lengths=None,
             num_kv_heads=2, quant=None, check_reference=False, interpret=True, **kw):
  """Runs the kernel (interpret mode unless told) on a random poisoned cache; returns the
  relative error against the float64 oracle."""
  rng = np.random.default_rng(seed)
  lengths = lengths if lengths is not None else boundary_lengths(block_size)
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
              "float16": np.float16}[dtype]
  q, k, v, ks, vs, tables = decode_case(
      rng, block_size=block_size, group=group, head_dim=head_dim, lengths=lengths,
      num_kv_heads=num_kv_heads, dtype=np_dtype, quant=quant, spare_blocks=5)
  args = [jnp.asarray(x) for x in (q, k, v, tables, np.asarray(lengths, np.int32))]
  scales = {} if ks is None else dict(k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs))
  # The Triton kernel itself (the package's paged_attention dispatches by backend).
  out = kernel_module.paged_attention(*args, interpret=interpret, **scales, **kw)
  out, want = check_decode_output(
      out, q, k, v, ks, vs, tables, lengths, kw,
      finite_msg="NaN/inf: a stale page was read or an output left unwritten")
  kw_sem = {k_: v_ for k_, v_ in kw.items() if k_ in ("soft_cap", "sliding_window")}
  if check_reference:
    ref = paged_attention_reference(*args, **scales,
                                    **{k_: v_ for k_, v_ in kw.items() if k_ == "sm_scale"},
                                    **kw_sem)
    assert rel_err(ref.astype(jnp.float32), want) <= TOL[dtype]
  return rel_err(out, want)


# Default grid: every block size 8..256, every q-per-kv ratio, both head dims, three dtypes,
# with lengths at block boundaries and the long ones from the issue spread over the cases.
DEFAULT_CASES = [
    # block_size, group, head_dim, dtype, extra lengths
    (8, 1, 64, "float32", (513,)),
    (16, 2, 128, "bfloat16", (1023,)),
    (32, 4, 64, "float32", (2048,)),
    (64, 8, 128, "bfloat16", (513,)),
    (128, 1, 128, "float32", (1023,)),
    (256, 4, 64, "bfloat16", (2048,)),
    (16, 8, 64, "float16", ()),
]


@pytest.mark.parametrize("block_size,group,head_dim,dtype,extra", DEFAULT_CASES)
def test_kernel_matches_oracle(block_size, group, head_dim, dtype, extra):
  err = run_case(block_size * 100 + group, block_size=block_size, group=group,
                 head_dim=head_dim, dtype=dtype,
                 lengths=boundary_lengths(block_size, extra))
  assert err <= TOL[dtype]


@pytest.mark.parametrize("opts,num_splits", [
    (dict(sm_scale=0.37), 1),
    (dict(soft_cap=1.5, sm_scale=0.9), 3),
    (dict(sliding_window=1), 2),
    (dict(sliding_window=19), 1),   # window starts mid-page
    (dict(sliding_window=40, soft_cap=3.0), 5),
])
def test_features_and_splits(num_splits, opts):
  err = run_case(num_splits * 31 + len(str(opts)), block_size=16, group=4, head_dim=64,
                 lengths=[0, 1, 15, 16, 17, 70, 200], num_splits=num_splits,
                 check_reference=True, **opts)
  assert err <= 1e-5


@pytest.mark.parametrize("quant,dtype", [("int8", "float32"), ("fp8", "bfloat16"),
                                         ("int8", "bfloat16")])
def test_quantized_pages(quant, dtype):
  err = run_case(7 + len(quant) + len(dtype), block_size=16, group=2, head_dim=64,
                 dtype=dtype, quant=quant, lengths=[0, 5, 16, 33, 129])
  # int8/fp8 values are exact in fp32 and bf16; only the bf16 q / probability rounding
  # and the kernel's fp32 arithmetic remain.
  assert err <= (1e-5 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_small_block_sizes_use_several_pages_per_tile(block_size):
  # tile_tokens=16 -> 16 / block_size pages per loop step.
  err = run_case(block_size, block_size=block_size, group=2, head_dim=32,
                 lengths=[0, 1, 3, 4, 5, 37], num_splits=2, tile_tokens=16)
  assert err <= 1e-5


def test_split_count_does_not_change_result():
  rng = np.random.default_rng(0)
  lengths = [300, 1, 77]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=1, num_blocks=40, block_size=16,
                                  head_dim=64, lengths=lengths, pages_per_seq=20)
  q = jnp.asarray(rng.normal(size=(3, 8, 64)), jnp.float32)
  args = (q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(lengths))
  outs = [np.asarray(paged_attention(*args, interpret=True, num_splits=s, tile_tokens=t))
          for s, t in ((1, 16), (3, 32), (8, 16), (2, 128))]
  for o in outs[1:]:
    np.testing.assert_allclose(o, outs[0], rtol=2e-6, atol=2e-6)


def test_under_jit_traces_once_for_new_lengths_and_tables():
  rng = np.random.default_rng(4)
  traces = []

  @jax.jit
  def step(q, k, v, tables, lengths):
    traces.append(1)
    return paged_attention(q, k, v, tables, lengths, interpret=True)

  for seed in range(2):
    lengths = rng.integers(0, 60, size=3).tolist()
    k, v, _, _, tables = make_cache(rng, num_kv_heads=2, num_blocks=20, block_size=8,
                                    head_dim=32, lengths=lengths, pages_per_seq=8)
    q = rng.normal(size=(3, 4, 32)).astype(np.float32)
    out = step(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables),
               jnp.asarray(lengths, jnp.int32))
    want = decode_oracle(q, k, v, None, None, tables, lengths, sm_scale=1 / math.sqrt(32),
                         soft_cap=None, window=None)
    assert rel_err(out, want) <= 1e-5
  assert len(traces) == 1


def test_dispatch_backends_agree():
  rng = np.random.default_rng(8)
  lengths = [9, 0, 40]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=2, num_blocks=16, block_size=8,
                                  head_dim=32, lengths=lengths, pages_per_seq=6)
  q = jnp.asarray(rng.normal(size=(3, 4, 32)), jnp.float32)
  args = (q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(lengths))
  ref = attention.paged_attention(*args, backend="reference", soft_cap=2.0)
  interp = attention.paged_attention(*args, backend="pallas_interpret", soft_cap=2.0,
                                     num_splits=2)
  auto = attention.paged_attention(*args, soft_cap=2.0)  # CPU: reference; GPU: pallas
  np.testing.assert_allclose(np.asarray(interp), np.asarray(ref), rtol=1e-5, atol=1e-6)
  # Whatever "auto" resolves to, it is the reference up to f32 rounding (the GPU kernel's
  # f32 dots are 3-pass TF32): a tolerance, not bitwise equality.
  np.testing.assert_allclose(np.asarray(auto), np.asarray(ref), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="tpu_please"):
    attention.paged_attention(*args, backend="tpu_please")
  # Tuning knobs are ignored by the reference; a misspelled argument is not.
  tuned = attention.paged_attention(*args, backend="reference", soft_cap=2.0, num_splits=3)
  np.testing.assert_array_equal(np.asarray(tuned), np.asarray(ref))
  with pytest.raises(TypeError, match="softcap"):
    attention.paged_attention(*args, backend="reference", softcap=2.0)


def _shapes(b=2, hq=4, hkv=2, d=32, nb=8, bs=8, p=4, dtype=jnp.float32, pdtype=None):
  pdtype = pdtype or dtype
  return (jnp.zeros((b, hq, d), dtype), jnp.zeros((hkv, nb, bs, d), pdtype),
          jnp.zeros((hkv, nb, bs, d), pdtype), jnp.zeros((b, p), jnp.int32),
          jnp.zeros((b,), jnp.int32))


@pytest.mark.parametrize("args,kw,match", [
    (_shapes(bs=3), {}, "block_size"),
    (_shapes(bs=512), {}, "block_size"),
    (_shapes(d=384), {}, "head_dim"),
    (_shapes(d=8), {}, "head_dim"),
    (_shapes(hq=3), {}, "num_kv_heads"),
    (_shapes(pdtype=jnp.bfloat16), {}, "dtype"),
    (_shapes(pdtype=jnp.int8), {}, "k_scales"),
    (_shapes(dtype=jnp.int32), {}, "q has dtype int32"),
    (_shapes(), dict(num_splits=0), "num_splits"),
    (_shapes(bs=4), dict(tile_tokens=8), "tile_tokens"),
    (_shapes(), dict(tile_tokens=48), "tile_tokens"),
    (_shapes(), dict(sliding_window=0), "sliding_window"),
    (_shapes(), dict(soft_cap=-1.0), "soft_cap"),
    (_shapes(), dict(sm_scale=float("nan")), "sm_scale"),
    (_shapes(), dict(num_warps=3), "num_warps"),
    (_shapes(), dict(num_stages=8), "num_stages"),
    # Over the sm_90 shared-memory budget: refused before tracing, naming the budget.
    (_shapes(d=256), dict(tile_tokens=1024), "tile_tokens.*232,448"),
    (_shapes(d=256, dtype=jnp.bfloat16), dict(tile_tokens=256, num_stages=4), "232,448"),
])
def test_bad_arguments_raise_before_tracing(args, kw, match):
  with pytest.raises(ValueError, match=match):
    paged_attention(*args, interpret=True, **kw)


def test_lengths_shape_checked():
  q, k, v, tables, _ = _shapes()
  with pytest.raises(ValueError, match="lengths"):
    paged_attention(q, k, v, tables, jnp.zeros((3,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="block_tables"):
    paged_attention(q, k, v, jnp.zeros((3, 4), jnp.int32), jnp.zeros((2,), jnp.int32))


def test_split_heuristic():
  # Small batch, long context: many splits; big batch: one split.
  assert tuning.default_num_splits(1, 8, 2048, 16, 128) >= 16
  assert tuning.default_num_splits(256, 8, 256, 16, 128) == 1
  assert tuning.default_num_splits(1, 1, 1, 256, 128) == 1
  assert tuning.decode_defaults(jnp.bfloat16, 128).tile_tokens == 128
  assert tuning.decode_defaults(jnp.bfloat16, 256).tile_tokens == 64
  # float32 (TF32 x3 on the GPU) halves the tile to stay in shared memory / registers.
  assert tuning.decode_defaults(jnp.float32, 128).tile_tokens == 64
  # B=64 x 8 KV heads: two waves of resident blocks need 2 splits.
  assert tuning.default_num_splits(64, 8, 256, 16, 128) == 2
  # What the wrapper resolves: the frozen config of one call.
  shapes = kernel_module.checks.check_decode(*_shapes(b=64, hq=64, hkv=8, d=128, p=256,
                                                      dtype=jnp.bfloat16))
  cfg = kernel_module.TuningConfig.resolve(shapes)
  assert (cfg.tile_tokens, cfg.num_splits, cfg.num_stages) == (128, 2, 3)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.num_splits = 4


@pytest.mark.parametrize("head_dim,group,dtype", [(80, 4, "float32"), (96, 2, "bfloat16"),
                                                  (48, 1, "float32")])
def test_head_dim_not_a_power_of_two(head_dim, group, dtype):
  """80 / 96: computed as 128 (q padded, pages loaded with a feature mask, not copied)."""
  err = run_case(head_dim, block_size=16, group=group, head_dim=head_dim, dtype=dtype,
                 lengths=[1, 17, 100], num_splits=2)
  assert err <= TOL[dtype]


@pytest.mark.parametrize("block_size,tile_tokens", [(64, 16), (256, 64), (32, 32)])
def test_pages_bigger_than_the_tile_are_sliced(block_size, tile_tokens):
  err = run_case(block_size + tile_tokens, block_size=block_size, group=2, head_dim=32,
                 lengths=[0, 1, block_size - 1, block_size + 1, 2 * block_size + 7],
                 tile_tokens=tile_tokens, num_splits=2)
  assert err <= 1e-5
  err = run_case(3, block_size=block_size, group=2, head_dim=32, tile_tokens=tile_tokens,
                 lengths=[5, 3 * block_size], sliding_window=block_size // 2 + 3)
  assert err <= 1e-5


SLOW_GRID = list(itertools.product([8, 16, 32, 64, 128, 256], [1, 2, 4, 8], [64, 128],
                                   ["float32", "bfloat16"]))


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("block_size,group,head_dim,dtype", SLOW_GRID)
def test_wide_grid(block_size, group, head_dim, dtype):
  err = run_case(hash((block_size, group, head_dim, dtype)) % 2**32, block_size=block_size,
                 group=group, head_dim=head_dim, dtype=dtype,
                 lengths=boundary_lengths(block_size, (513, 1023, 2048)))
  assert err <= TOL[dtype]


# Compiled Triton kernel on a real GPU (experiments/gpu_check.sh runs these with
# JAX_PLATFORMS=cuda). fp32 dots run as 3-pass TF32 on the GPU (pallas_kernels/triton/tuning.py:
# ~1e-6 relative error), so the fp32 tolerance holds there too.
GPU_GRID = [(bs,) + cfg for bs in (8, 16, 32, 64, 128, 256)
            for cfg in ((1, 64, "float32"), (4, 128, "bfloat16"), (8, 64, "bfloat16"))]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("block_size,group,head_dim,dtype", GPU_GRID)
def test_compiled_kernel_on_gpu(block_size, group, head_dim, dtype):
  err = run_case(block_size * 7 + group * 3 + head_dim, block_size=block_size, group=group,
                 head_dim=head_dim, dtype=dtype, interpret=False,
                 lengths=boundary_lengths(block_size, (513, 1023, 2048)))
  assert err <= TOL[dtype]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("opts", [
    dict(quant="int8", dtype="bfloat16"), dict(quant="fp8", dtype="bfloat16"),
    dict(dtype="float16"), dict(block_size=1), dict(block_size=4),
    dict(soft_cap=2.0, sliding_window=100, num_splits=4),
])
def test_compiled_kernel_features_on_gpu(opts):
  opts = dict(opts)
  block_size = opts.pop("block_size", 16)
  dtype = opts.pop("dtype", "float32")
  err = run_case(11, block_size=block_size, group=4, head_dim=128, dtype=dtype,
                 interpret=False, lengths=boundary_lengths(block_size, (700,)), **opts)
  assert err <= TOL[dtype]


def test_ragged_dispatch_from_metadata():
  """attention.attention_from_metadata: reference and the Pallas ragged kernel agree."""
  rng = np.random.default_rng(12)
  kv_lens = [5, 1, 20]
  q_lens = [5, 1, 3]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=2, num_blocks=12, block_size=8,
                                  head_dim=32, lengths=kv_lens, pages_per_seq=4)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = jnp.asarray(rng.normal(size=(11, 4, 32)), jnp.float32)  # 2 padding rows
  meta = attention.AttentionMetadata(
      slot_mapping=jnp.full((11,), -1, jnp.int32), block_tables=jnp.asarray(tables),
      kv_lens=jnp.asarray(kv_lens, jnp.int32), cu_q_lens=jnp.asarray(cu),
      num_seqs=jnp.int32(3), logits_indices=jnp.asarray(cu[1:] - 1))
  ref = attention.attention_from_metadata(q, jnp.asarray(k), jnp.asarray(v), meta,
                                          backend="reference")
  interp = attention.attention_from_metadata(q, jnp.asarray(k), jnp.asarray(v), meta,
                                             backend="pallas_interpret")
  ref = np.asarray(ref)
  assert np.isfinite(ref).all() and np.all(ref[9:] == 0)
  np.testing.assert_allclose(np.asarray(interp), ref, rtol=1e-5, atol=1e-5)
  # Decode rows equal the decode kernel's answer for the same sequences.
  dec = paged_attention(q[cu[1:] - 1], jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables),
                        jnp.asarray(kv_lens, jnp.int32), interpret=True)
  np.testing.assert_allclose(np.asarray(dec), ref[cu[1:] - 1], rtol=1e-5, atol=1e-5)
  # The metadata is a pytree: it goes through jit as an argument.
  leaves = jax.tree_util.tree_leaves(meta)
  assert len(leaves) == 6
