"""Mosaic GPU paged decode kernel (Hopper: TMA page gather + wgmma).

Interpret mode (GPU interpret mode runs the Mosaic kernel on the CPU, jax >= 0.11.2) against
the float64 oracle on poisoned caches (unused blocks and stale page tails NaN, table
entries past a length -1, random or far out of range), with race detection on; the
package-level `reference.py` is checked against the same oracle. Error is
||out - oracle|| / ||oracle|| <= 1e-2 (bf16 / fp16). Deviceless sm_90a compiles at real
decode shapes: compiles, 0 spills, shared memory within the 227 KiB opt-in budget.

Default cases stay under ~60 s of interpret time; the wide grid is marked slow. On jax
0.10.2 everything here skips (its Mosaic interpreter is private and fails on wgmma).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attention_oracle import (check_decode_output, decode_case, decode_oracle, make_cache,
                              rel_err)
import pallas_kernels
from pallas_kernels.deviceless import target as compile_target
from pallas_kernels.mosaic_gpu import paged_attention as mosaic

_SKIP = mosaic.interpret_unavailable_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

TOL = 1e-2
NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def boundary_lengths(bs, extra=()):
  return [0, 1, bs - 1, bs, bs + 1] + list(extra)


def run_case(seed, *, block_size, group, head_dim, dtype="bfloat16", lengths=None,
             num_kv_heads=2, via_package=False, interpret=True, quant=None, **kw):
  """Runs the Mosaic kernel on a random poisoned cache; returns the relative error against
  the float64 oracle (and checks finiteness, exact zeros for length 0, no races)."""
  from mosaic_gpu_support import races_found  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  lengths = lengths if lengths is not None else boundary_lengths(block_size)
  q, k, v, ks, vs, tables = decode_case(
      rng, block_size=block_size, group=group, head_dim=head_dim, lengths=lengths,
      num_kv_heads=num_kv_heads, dtype=NP_DTYPES[dtype], quant=quant, spare_blocks=3)
  if quant:
    kw = dict(kw, k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs))
  args = [jnp.asarray(x) for x in (q, k, v, tables, np.asarray(lengths, np.int32))]
  if via_package:
    out = pallas_kernels.paged_attention(*args, interpret=interpret, gpu_backend="mosaic_gpu",
                                         **kw)
  else:
    out = mosaic.paged_attention(*args, interpret=interpret, **kw)
  out = jax.block_until_ready(out)
  if interpret:
    assert not races_found(), "GPU interpret mode reported a race"
  out, want = check_decode_output(out, q, k, v, ks, vs, tables, lengths, kw,
                                  finite_msg="NaN/inf: a stale page reached the output")
  return rel_err(out, want)


# block_size, group, head_dim, dtype, extra lengths, knobs. Together: pages smaller than a
# tile (several TMAs per stage), equal, bigger (page slices), split-K, GQA 1/4/8, D 64..256,
# soft cap + sliding window, fp16.
DEFAULT_CASES = [
    (16, 4, 128, "bfloat16", (200,), {}),
    (256, 8, 64, "bfloat16", (600,), dict(num_splits=3)),
    (64, 1, 64, "float16", (300,), dict(soft_cap=5.0, sliding_window=70, num_stages=2)),
    (32, 8, 256, "bfloat16", (), dict(num_splits=2)),
]


@pytest.mark.parametrize("block_size,group,head_dim,dtype,extra,kw", DEFAULT_CASES)
def test_interpret_matches_oracle(block_size, group, head_dim, dtype, extra, kw):
  err = run_case(block_size + 3 * group + head_dim, block_size=block_size, group=group,
                 head_dim=head_dim, dtype=dtype, lengths=boundary_lengths(block_size, extra),
                 **kw)
  assert err <= TOL, err


@pytest.mark.parametrize("quant,block_size,head_dim", [
    ("int8", 16, 128),
    pytest.param("fp8", 64, 64, marks=pytest.mark.slow),
    pytest.param("int8", 256, 256, marks=pytest.mark.slow),
    pytest.param("fp8", 32, 128, marks=pytest.mark.slow)])
def test_quantized_pages(quant, block_size, head_dim):
  """int8 / fp8 pages with per-token scales (through the package entry)."""
  err = run_case(7 + block_size + head_dim, block_size=block_size, group=4,
                 head_dim=head_dim, quant=quant, via_package=True, num_splits=2,
                 lengths=boundary_lengths(block_size, (300,)))
  assert err <= TOL, err


def test_package_entry_runs_mosaic_under_interpret():
  """Contract: pallas_kernels.paged_attention(gpu_backend="mosaic_gpu", interpret=True)."""
  err = run_case(5, block_size=128, group=4, head_dim=128, lengths=[129, 0, 257],
                 via_package=True, tile_kv=128, num_splits=2)
  assert err <= TOL, err


def test_reference_matches_the_same_oracle():
  rng = np.random.default_rng(1)
  lengths = [0, 1, 63, 64, 65]
  k, v, _, _, tables = make_cache(rng, num_kv_heads=2, num_blocks=12, block_size=64,
                                  head_dim=64, lengths=lengths, pages_per_seq=3,
                                  dtype=ml_dtypes.bfloat16)
  q = rng.normal(size=(5, 8, 64)).astype(ml_dtypes.bfloat16)
  ref = pallas_kernels.paged_attention_reference(
      *[jnp.asarray(x) for x in (q, k, v, tables, np.asarray(lengths, np.int32))])
  want = decode_oracle(q, k, v, None, None, tables, lengths, sm_scale=1 / 8, soft_cap=None,
                       window=None)
  assert rel_err(np.asarray(ref.astype(jnp.float32)), want) <= TOL


def test_unsupported_shapes_are_refused_with_the_reason():
  q = jnp.zeros((1, 4, 128), jnp.bfloat16)
  pages = jnp.zeros((2, 4, 8, 128), jnp.bfloat16)
  args = (jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match="block_size 8"):
    mosaic.paged_attention(q, pages, pages, *args)
  with pytest.raises(ValueError, match="232,448"):
    mosaic.paged_attention(q, pages.reshape(2, 2, 16, 128), pages.reshape(2, 2, 16, 128),
                           *args, tile_kv=128, num_stages=3)
  with pytest.raises(ValueError, match="dtypes"):
    mosaic.paged_attention(q.astype(jnp.float32), pages.astype(jnp.float32),
                           pages.astype(jnp.float32), *args)
  assert mosaic.supported_reason(32, 8, 128, 64, jnp.bfloat16, jnp.bfloat16) is None
  assert "head_dim" in mosaic.supported_reason(32, 8, 96, 64, jnp.bfloat16, jnp.bfloat16)


SLOW_GRID = [(bs, g, d) for bs in (16, 32, 64, 128, 256) for g in (1, 4, 8)
             for d in (64, 128, 256)]


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("block_size,group,head_dim", SLOW_GRID)
def test_wide_grid(block_size, group, head_dim):
  splits = 1 + (block_size + group + head_dim) % 3
  err = run_case(block_size * 7 + group * 3 + head_dim, block_size=block_size, group=group,
                 head_dim=head_dim, num_kv_heads=1 if group == 8 else 2,
                 lengths=boundary_lengths(block_size, (3 * block_size + 2, 1023)),
                 num_splits=splits)
  assert err <= TOL, err


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(soft_cap=2.0), dict(sliding_window=100),
                                dict(sliding_window=1, num_splits=4),
                                dict(soft_cap=30.0, sliding_window=257, tile_kv=128),
                                dict(sm_scale=0.3, num_stages=1)])
def test_wide_features(kw):
  err = run_case(21, block_size=32, group=4, head_dim=128, dtype="float16",
                 lengths=boundary_lengths(32, (700,)), **kw)
  assert err <= TOL, err


# Deviceless compile for sm_90a at real decode shapes (B, Hq, Hkv, D, block_size, context).
# Default: one shape per model family; the rest (knob and dtype variants) are slow.
COMPILE_DEFAULT = ("llama3_8b", "qwen_like_14_2_64", "gemma_like_d256", "llama3_8b_int8")
COMPILE_SHAPES = {
    "llama3_8b": ((32, 32, 8, 128, 64, 4096), {}),
    "llama3_8b_b64_bs16": ((64, 32, 8, 128, 16, 4096), {}),
    "llama3_8b_bs256_slices": ((32, 32, 8, 128, 256, 4096), {}),
    "llama3_8b_bs128_tile128": ((32, 32, 8, 128, 128, 4096), dict(tile_kv=128)),
    "qwen_like_14_2_64": ((32, 14, 2, 64, 64, 4096), {}),
    "gemma_like_d256": ((16, 16, 8, 256, 64, 8192), {}),
    "llama3_8b_int8": ((32, 32, 8, 128, 64, 4096), dict(page_dtype=jnp.int8)),
    "llama3_8b_fp8_bs16": ((32, 32, 8, 128, 16, 4096), dict(page_dtype=jnp.float8_e4m3fn)),
    "gemma_like_d256_int8": ((16, 16, 8, 256, 64, 8192), dict(page_dtype=jnp.int8)),
}


@pytest.mark.parametrize("name", [n if n in COMPILE_DEFAULT else
                                  pytest.param(n, marks=pytest.mark.exhaustive)
                                  for n in sorted(COMPILE_SHAPES)])
def test_deviceless_sm90_compile(name):
  why = compile_target.unavailable_reason()
  if why:
    pytest.skip(why)
  from mosaic_gpu_support import mosaic_resources  # pylint: disable=g-import-not-at-top
  (batch, hq, hkv, d, bs, ctx), kw = COMPILE_SHAPES[name]
  kw = dict(kw)
  page_dtype = kw.pop("page_dtype", jnp.bfloat16)
  pages = ctx // bs
  a = compile_target.abstract
  quantized = page_dtype != jnp.bfloat16
  fn = lambda q, k, v, t, l, ks, vs: pallas_kernels.paged_attention(
      q, k, v, t, l, k_scales=ks, v_scales=vs, gpu_backend="mosaic_gpu", **kw)
  scales = a((hkv, batch * pages, bs), jnp.float32) if quantized else None
  kernels, report = mosaic_resources(
      fn, a((batch, hq, d), jnp.bfloat16), a((hkv, batch * pages, bs, d), page_dtype),
      a((hkv, batch * pages, bs, d), page_dtype), a((batch, pages), jnp.int32),
      a((batch,), jnp.int32), scales, scales)
  assert len(kernels) == 1 and kernels[0].name.startswith(f"paged_decode_mgpu_bs{bs}_")
  kernel = kernels[0]
  print(name, kernel, "xla temp bytes", report.temp_bytes)
  assert kernel.spill_bytes == 0
  assert kernel.registers <= 255
  assert kernel.shared_memory <= compile_target.SM90_SHARED_MEMORY_BYTES
  # No pool-sized buffer: XLA's temps hold the padded query and the split partials only.
  assert report.temp_bytes < hkv * batch * pages * bs * d * 2


ON_SM90 = jax.default_backend() == "gpu" and \
    str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


@pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_size,group,head_dim", [(16, 4, 128), (64, 4, 128),
                                                       (256, 8, 64), (32, 1, 256)])
def test_compiled_kernel_on_sm90(block_size, group, head_dim):
  err = run_case(block_size + group + head_dim, block_size=block_size, group=group,
                 head_dim=head_dim, interpret=False,
                 lengths=boundary_lengths(block_size, (513, 1023, 4096)))
  assert err <= TOL, err
