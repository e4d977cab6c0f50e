"""Deviceless sm_90 (H200) compile of the kernel configurations a GPU run can choose.

XLA's own GPU compiler (Triton -> PTX -> SASS, shared-memory planning) runs here for a
compile-only H200 (pallas_kernels/deviceless/target.py), with its fail-on-spill option on. Each
case must compile, use no more than the sm_90 shared memory per block (232,448 B), spill
no registers (ptxas, where a ptxas is found; the compile fails on a spill anyway), and keep
XLA's temp buffers far below the KV pool (no copy of the cache, split-K partials sized by
work). The cases (pallas_kernels/deviceless/triton_configs.py): Llama-3-8B 32/8 x 128, Qwen-like
14/2 x 64, Gemma-like 8/4 x 256 with soft cap and sliding window, D 80 / 96; bf16, fp16,
f32, int8 and fp8 pages; block sizes 8..128 (1, 4, 256 too); the benchmarks' decode
batches and ragged scenarios and the engine's default step buckets. The default suite
compiles a representative ~20; the full grid is marked slow.
Skipped, with the reason, where the jax-cuda12 plugin wheels are not installed.
"""

import pytest

from pallas_kernels.deviceless import triton_configs as compile_configs
from pallas_kernels.deviceless import target as compile_target
from pallas_kernels.triton import tuning

pytestmark = pytest.mark.skipif(compile_target.unavailable_reason() is not None,
                                reason=str(compile_target.unavailable_reason()))

# Temp buffers may hold split-K partials and the padded query / output, never anything
# near the K/V pool (a copy of the cache would be >= the pool).
TEMP_FRACTION_OF_POOL = 0.05
TEMP_FLOOR_BYTES = 32 << 20


def check(case):
  row = compile_configs.measure(case, fail_on_spill=True)
  assert row["launches"], f"{case.name}: no kernel launch of ours in the compiled program"
  for launch in row["launches"]:
    assert launch["shared_memory"] <= tuning.SHARED_MEMORY_BUDGET, (case.name, launch)
    assert not launch["spill_bytes"], (case.name, launch)
    if launch["registers"] is not None:
      assert launch["registers"] <= 255, (case.name, launch)
  # Plus a few copies of the (padded) query / output rows: they scale with the step's
  # tokens, not with the pool.
  limit = (max(TEMP_FLOOR_BYTES, TEMP_FRACTION_OF_POOL * row["pool_bytes"])
           + 4 * row["activation_bytes"])
  assert row["temp_bytes"] <= limit, (
      f"{case.name}: temp buffers {row['temp_bytes']:,} B > {limit:,.0f} B "
      f"(pool {row['pool_bytes']:,} B)")
  return row


@pytest.mark.parametrize("case", compile_configs.default_cases(), ids=lambda c: c.name)
def test_default_configs_compile_for_sm90(case):
  check(case)


def test_shared_memory_model_bounds_the_compiler():
  """The estimate the knob validation uses is above what XLA allocates (so a config the
  validation accepts fits), for the decode default and a knob-set ragged tile."""
  case = compile_configs.Case("decode", "llama8b", "float32", batch=8)
  row = check(case)
  dec = tuning.decode_defaults("float32", 128)
  est = tuning.shared_memory_estimate(dec.tile_tokens, 128, "float32", "float32",
                                      tuning.kv_buffers("decode", dec.num_stages))
  assert row["max_shared_memory"] <= est <= tuning.SHARED_MEMORY_BUDGET


def test_long_prefill_split_partials_are_small():
  """Finding 4: a 1 x 2048 prefill with split-K on the short-tile launch used to allocate
  and zero-fill splits x T x heads x D f32 (~268 MB at Llama-8B shapes)."""
  case = compile_configs.Case("ragged", "llama8b", "bfloat16", workload="prefill2k",
                              knobs=(("kv_splits", 16),))
  row = check(case)
  assert row["temp_bytes"] < 16 << 20, row["temp_bytes"]


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("case", compile_configs.full_cases(), ids=lambda c: c.name)
def test_full_grid_compiles_for_sm90(case):
  check(case)
