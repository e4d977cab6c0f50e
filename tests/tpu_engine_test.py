"""The engine on the Pallas TPU kernels (issue 27 point 4).

- `attention_backend="pallas_interpret:tpu"`: the whole engine (ragged prefill chunks,
  the decode kernel on pure-decode steps, the multi-step decode loop, the TPU K/V write)
  run by the TPU interpreter gives the reference backend's greedy tokens, token for token;
  with int8 pages it holds their scales as scale rows (`kv_cache.scale_rows_for`) through
  a swap preemption and copy-on-write.
- The scale-rows layout through the whole engine on the reference backend (cheap): int8
  and fp8 pages swapped out and in and copied on write give the tokens of the blocks
  layout in a roomy pool.
- `kv_cache.write(..., backend=<a TPU spelling>)` (the in-place TPU kernel) stores what
  XLA's scatter stores, scales of int8 pages included.
- "auto" is decided by the device the step is compiled for: a compile-only TPU gives the
  TPU kernels on this CPU host (needs libtpu, else skipped), the host's own device gives
  the CPU path.
- The whole engine step compiles for v5e and v6e at tp=1 and tp=4 (libtpu's compile-only
  topologies) with the TPU kernels, no temporary of 1% of the pool or more, and the
  donated pages aliased; compiled the way a user does (`fn.trace(*args).lower().compile()`,
  no TPU default device). About a minute of CPU each: slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import kv_cache
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.engine import Engine, SamplingParams
from paged_jax.engine import compile as engine_compile
from paged_jax.engine.state import init_state
from paged_jax.models import llama
from pallas_kernels.tpu import compile_target as ct

import tpu_support

NO_LIBTPU = pytest.mark.skipif(ct.unavailable_reason() is not None,
                               reason=str(ct.unavailable_reason()))


def _engine_outputs(mc, cc, backend, prompts, sps, **options):
  params = jax.tree_util.tree_map(lambda x: x * 8.0 if x.ndim == 2 else x,
                                  llama.init_params(mc, jax.random.key(0)))
  engine = Engine(mc, params, cc, max_num_batched_tokens=32, attention_backend=backend,
                  **options)
  return [o.outputs for o in engine.generate(prompts, sps)]


def _engine_run(mc, cc, backend, prompts, sps, **options):
  """(outputs in prompt order, whether the pages held scale rows, swaps, swapped blocks,
  copy-on-write block copies), stepping the engine by hand."""
  params = jax.tree_util.tree_map(lambda x: x * 8.0 if x.ndim == 2 else x,
                                  llama.init_params(mc, jax.random.key(0)))
  engine = Engine(mc, params, cc, max_num_batched_tokens=32, attention_backend=backend,
                  **options)
  ids = [engine.add_request(p, sp) for p, sp in zip(prompts, sps)]
  got, cow = {}, 0
  while engine.has_unfinished():
    got.update((o.request_id, o.outputs) for o in engine.step())
    cow += engine.last_step.cow_copies
  return ([got[i] for i in ids], engine.state.pages.scale_rows, engine.num_swaps,
          engine.stats["swapped_blocks"], cow)


# A 17-token greedy prompt and a 3-token prompt sampled twice (n = 2: its children share
# the prompt's block and copy it on their first write) in a pool of 4 blocks of 16: the
# sampled group is swapped out while the first grows, and comes back.
SWAP_PROMPTS = [list(range(3, 20)), [7, 8, 9]]
SWAP_PARAMS = [SamplingParams(max_tokens=6, temperature=0.0),
               SamplingParams(max_tokens=5, n=2, temperature=0.8, seed=3)]
SWAP_POOL = dict(num_blocks=4, max_seqs=3)
SWAP_OPTIONS = dict(preemption_mode="swap", decode_steps_per_sync=2)


def _tiny(dtype="bfloat16", pool=None, **model):
  fields = dict(vocab_size=96, hidden_size=128, intermediate_size=128, num_layers=1,
                num_heads=2, num_kv_heads=1, max_position_embeddings=256, dtype="bfloat16")
  mc = ModelConfig(**{**fields, **model})
  cc = mc.cache_config(**{**dict(block_size=16, num_blocks=16, max_seqs=2, hybrid_kv=False,
                                 max_blocks_per_seq=4, dtype=dtype), **(pool or {})})
  return mc, cc


def test_engine_in_tpu_interpret_mode_equals_reference():
  """A 1-layer bf16 Llama (D 64, pages of 16): a 5- and a 20-token prompt (the second
  prefilled in chunks of the 32-token budget's share), then pure-decode steps."""
  mc, cc = _tiny()
  prompts = [[1, 2, 3, 4, 5], list(range(10, 30))]
  sps = SamplingParams(max_tokens=4, temperature=0.0)
  want = _engine_outputs(mc, cc, "reference", prompts, sps)
  got = tpu_support.run_checked(_engine_outputs, mc, cc, "pallas_interpret:tpu", prompts,
                                sps)
  assert got == want


@pytest.mark.parametrize("dtype", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
def test_scale_rows_through_swap_and_copy_on_write_keep_the_tokens(dtype):
  """The engine holding scale rows (as on the TPU kernels; here forced, on the reference
  backend): a swapped, copied-on-write sampling group and a greedy prompt decode what
  the blocks layout decodes in a pool where nothing is preempted."""
  mc, cc = _tiny(dtype, SWAP_POOL)
  rows = functools.partial(init_state, scale_rows=True)
  got, held_rows, swaps, swapped, cow = _engine_run(
      mc, cc, "reference", SWAP_PROMPTS, SWAP_PARAMS, init_state=rows, **SWAP_OPTIONS)
  assert held_rows and swaps > 0 and swapped > 0 and cow > 0, (swaps, swapped, cow)
  mc, roomy = _tiny(dtype)
  want, held_rows, swaps, _, _ = _engine_run(mc, roomy, "reference", SWAP_PROMPTS,
                                             SWAP_PARAMS, **SWAP_OPTIONS)
  assert not held_rows and swaps == 0
  assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("dtype,model", [
    ("int8", {}),
    ("bfloat16", dict(num_layers=2, attn_logit_softcapping=20.0, sliding_window=8,
                      layer_types=("sliding_attention", "full_attention"))),
], ids=["int8_pages", "softcap_window"])
def test_engine_in_tpu_interpret_mode_equals_reference_wide(dtype, model):
  """int8 pages (held as scale rows: the TPU write quantizes into them, the kernels read
  them) through a swap preemption; soft cap with a sliding layer; a 2-step decode loop
  and a parallel-sampling fork (copy-on-write pages) in both."""
  if dtype == "int8":
    mc, cc = _tiny(dtype, SWAP_POOL)
    want = _engine_run(mc, cc, "reference", SWAP_PROMPTS, SWAP_PARAMS, **SWAP_OPTIONS)
    got = tpu_support.run_checked(_engine_run, mc, cc, "pallas_interpret:tpu",
                                  SWAP_PROMPTS, SWAP_PARAMS, **SWAP_OPTIONS)
    assert got[1] and not want[1]                       # rows on the TPU kernels only
    assert got[2] > 0 and got[4] > 0, got[2:]           # swapped, copied on write
    assert got[0] == want[0] and got[2:] == want[2:]
    return
  mc, cc = _tiny(dtype, **model)
  prompts = [list(range(3, 20)), [7, 8, 9]]
  sps = [SamplingParams(max_tokens=6, temperature=0.0),
         SamplingParams(max_tokens=5, n=2, temperature=0.8, seed=3)]
  want = _engine_outputs(mc, cc, "reference", prompts, sps, decode_steps_per_sync=2)
  got = tpu_support.run_checked(_engine_outputs, mc, cc, "pallas_interpret:tpu", prompts,
                                sps, decode_steps_per_sync=2)
  assert got == want


@pytest.mark.parametrize("dtype,rows", [("bfloat16", False), ("int8", False), ("int8", True)],
                         ids=["bfloat16", "int8", "int8_scale_rows"])
def test_tpu_kv_write_stores_what_the_xla_scatter_stores(dtype, rows):
  """Layer 1 of a 2-layer pool; padding slots (-1) and a partly filled page; layer 0 and
  every untouched slot keep their bytes; scales held as blocks (the write views them as
  rows and back) or as scale rows (9 blocks of 16: the second row's padding stays)."""
  rng = np.random.default_rng(0)
  cc = CacheConfig(block_size=16, num_blocks=9 if rows else 8, max_seqs=2,
                   max_blocks_per_seq=4, num_layers=2, num_kv_heads=2, head_dim=64,
                   dtype=dtype)
  pages = kv_cache.init(cc, scale_rows=rows)
  assert pages.scale_rows == rows
  pages = jax.tree_util.tree_map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape) * 4, jnp.float32).astype(x.dtype)
      if x.dtype != jnp.float32 else jnp.asarray(rng.uniform(0.01, 0.1, x.shape), x.dtype),
      pages)
  slots = jnp.asarray([5, 6, 7, -1, 40, 41, 100, -1], jnp.int32)
  k_new, v_new = (jnp.asarray(rng.standard_normal((8, 2, 64)), jnp.bfloat16)
                  for _ in range(2))
  want = kv_cache.write(pages, 1, k_new, v_new, slots)
  got = tpu_support.run_checked(kv_cache.write, pages, 1, k_new, v_new, slots,
                                backend="pallas_interpret:tpu")
  for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                  np.asarray(w.astype(jnp.float32)))


def test_auto_on_the_host_is_not_the_tpu_path():
  mc, cc = _tiny()
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  chosen = engine_compile.step_backend("auto", mc, cc, cpu)
  assert chosen in ("cpu", "xla")
  assert engine_compile.step_backend("reference", mc, cc, cpu) == "reference"


@NO_LIBTPU
def test_auto_on_a_compile_only_tpu_is_the_tpu_kernels():
  """No TPU default device: the sharding's device alone decides."""
  mc, cc = _tiny()
  for chip in ("v5e", "v6e"):
    dev = ct.tpu_devices(chip)[0]
    assert engine_compile.step_backend("auto", mc, cc, dev) == "pallas:tpu"
    sharding = jax.sharding.SingleDeviceSharding(dev)
    assert engine_compile.step_backend("pallas", mc, cc, sharding) == "pallas:tpu"
    assert engine_compile.step_backend("reference", mc, cc, sharding) == "reference"


@NO_LIBTPU
@pytest.mark.slow
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("tp", [1, 4])
def test_engine_step_compiles_for_tpu_without_pool_sized_temporaries(chip, tp):
  from experiments import tpu_engine_compile as tec  # pylint: disable=g-import-not-at-top
  case = tec.StepCase("llama8b", chip=chip, tp=tp)
  row = tec.measure(case)
  assert row["attention"] == "pallas:tpu", row["kernels"]
  assert row["largest_temp_bytes"] < row["pool_bytes"] // 100, row
  assert row["alias_bytes"] >= row["pool_bytes"], row     # the pages updated in place


@NO_LIBTPU
@pytest.mark.slow
def test_speculating_step_compiles_for_tpu_without_pool_sized_temporaries():
  """The speculative decoding variant (k + 1 logits per row, verification, rollback):
  TPU kernels, pages updated in place, no temporary of 1% of the pool."""
  from experiments import tpu_engine_compile as tec  # pylint: disable=g-import-not-at-top
  row = tec.measure(tec.StepCase("llama8b", chip="v6e", spec=3))
  assert row["attention"] == "pallas:tpu", row["kernels"]
  assert row["largest_temp_bytes"] < row["pool_bytes"] // 100, row
  assert row["alias_bytes"] >= row["pool_bytes"], row


@NO_LIBTPU
@pytest.mark.slow
def test_int8_engine_step_on_tpu_copies_neither_pages_nor_scales():
  """int8 pages on v5e, tp 1: the engine holds its scales as scale rows, so no temporary
  is a layout copy of a layer's scales (f32[8, 8192, 16] tiled to 128 lanes, 32 MiB, was
  the largest); the largest is now no larger than the MLP's bf16[T, intermediate]
  activation, as in the bf16 step."""
  from experiments import tpu_engine_compile as tec  # pylint: disable=g-import-not-at-top
  case = tec.StepCase("llama8b", page_dtype="int8")
  row = tec.measure(case)
  mc = case.model_config()
  assert row["attention"] == "pallas:tpu", row["kernels"]
  assert row["alias_bytes"] >= row["pool_bytes"], row
  assert row["largest_temp_bytes"] <= case.tokens * mc.intermediate_size * 2, row


BUFFER_ASSIGNMENT = """\
allocation 1: size 268435456, parameter 27, shape |bf16[8,8192,16,128]| at ShapeIndex {}:
 value: <6795 state_pages_k_0_.1 @0> (size=268435456,offset=0): bf16[8,8192,16,128]{3,2,1,0}
allocation 632: size 23740928, preallocated-temp:
 value: <6849 fusion.37 @0> (size=7340032,offset=6078464): bf16[256,14336]{1,0:T(8,128)(2,1)}
 value: <6720 copy_bitcast_fusion.1 @0> (size=4194304,offset=7913472): f32[256,32,128]{2,0,1}
allocation 633: size 117440512, color 1, preallocated-temp:
 value: <6195 slice.458 @1> (size=29360128,offset=0): bf16[1024,14336]{1,0:T(8,128)S(1)}
"""


def test_temp_arena_values_reads_the_temporary_arenas_by_memory_space():
  """Parameters are not temporaries; each arena's values carry its color; largest first."""
  values = ct.temp_arena_values(BUFFER_ASSIGNMENT)
  assert [(v.name, v.nbytes, v.memory_space) for v in values] == [
      ("slice.458", 29360128, 1), ("fusion.37", 7340032, 0),
      ("copy_bitcast_fusion.1", 4194304, 0)]


@NO_LIBTPU
def test_int8_kernels_lower_for_a_compile_only_tpu_without_a_tpu_default_device():
  """The args' sharding alone names the chip (as in step_for_compile): no kernel may ask
  for the default device's chip while lowering (jnp's floor // did: scales.first_row)."""
  from pallas_kernels import tpu  # pylint: disable=g-import-not-at-top
  dev = ct.tpu_devices("v5e")[0]
  assert jax.config.jax_default_device is None or jax.config.jax_default_device != dev
  at = lambda shape, dtype: ct.abstract(shape, dtype, dev)
  k = at((2, 64, 16, 128), jnp.int8)
  rows = at((2, 8, 128), jnp.float32)
  new, slots = at((32, 2, 128), jnp.bfloat16), at((32,), jnp.int32)
  jax.jit(tpu.write_kv).trace(k, k, new, new, slots, rows, rows).lower()
  tables, lens = at((4, 8), jnp.int32), at((4,), jnp.int32)
  ragged = lambda *a: tpu.ragged_paged_attention(*a[:7], k_scales=a[7], v_scales=a[8])
  jax.jit(ragged).trace(at((32, 4, 128), jnp.bfloat16), k, k, tables, lens,
                        at((5,), jnp.int32), at((1,), jnp.int32), rows, rows).lower()
  decode = lambda *a: tpu.paged_attention(*a[:5], k_scales=a[5], v_scales=a[6])
  jax.jit(decode).trace(at((4, 4, 128), jnp.bfloat16), k, k, tables, lens, rows,
                        rows).lower()
