"""The paged Llama forward and the whole engine step, compiled by XLA for a compile-only H200.

What only a GPU compile shows (`pallas_kernels.deviceless.target`): buffers XLA materialises
around the kernels. A Pallas kernel cannot read a view into a bigger buffer, so a stacked
`[num_layers, ...]` pool made XLA copy each layer's whole pool before every attention call
(measured on the old layout, 2-layer Llama-8B shapes, bf16 pool [2, 8, 16384, 16, 128]:
four 512 MiB copies (`wrapped_slice`, `loop_slice_fusion`) and 1,086,443,816 temp bytes per
forward; one array per layer: 22,401,320 temp bytes, no copy). These tests assert no buffer,
launch or copy of pool size, for sm_90, with ShapeDtypeStruct arguments (nothing allocated).

The whole engine step (`paged_jax.engine.step_for_compile`, 4 GiB pool, 4-step decode loop)
compiles with 17.4 MB of temp buffers and its pages aliased in place; its thunk sequence also
shows where a GPU run waits on the host (`host_readbacks`): the decode loop (a fixed-trip
`fori_loop`, finished slots masked) has a known trip count and its body no `lax.cond`, so
nothing is read back per iteration.
"""

import functools

import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.deviceless import target as ct
from paged_jax import kv_cache
from paged_jax.attention import AttentionMetadata
from paged_jax.models import llama
from tests.gpu_compile_support import (CACHE_4G, CACHE_512M, LLAMA8B_2L,
                                       host_readbacks, layer_pool_bytes, pool_copy_findings)

pytestmark = pytest.mark.skipif(ct.unavailable_reason() is not None,
                                reason=str(ct.unavailable_reason()))


def forward_args(config, cache, num_tokens: int, num_seqs: int):
  """Abstract (params, tokens, positions, pages, meta) on the compile-only H200."""
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  params = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
  pages = jax.eval_shape(lambda: kv_cache.init(cache))
  meta = AttentionMetadata(
      slot_mapping=i32(num_tokens), block_tables=i32(num_seqs, cache.max_blocks_per_seq),
      kv_lens=i32(num_seqs), cu_q_lens=i32(num_seqs + 1), num_seqs=i32(),
      logits_indices=i32(num_seqs))
  return ct.place((params, i32(num_tokens), i32(num_tokens), pages, meta))


def test_detector_flags_a_stacked_pool_copied_into_the_kernel():
  """The old layout's pattern (write into the stacked pool, hand layer 1 to a kernel) is
  reported: the checks below can fail."""
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  cache = CACHE_512M
  shape = (2, cache.num_kv_heads, cache.num_blocks, cache.block_size, cache.head_dim)

  def step(k, v, q, tables, lengths, slots, new):
    flat = (2, cache.num_kv_heads, cache.num_slots, cache.head_dim)
    k = k.reshape(flat).at[1, :, slots].set(new, mode="drop").reshape(shape)
    out = pallas_kernels.paged_attention(q, k[1], v[1], tables, lengths)
    return out, k

  bf16 = jnp.bfloat16
  args = ct.place((jax.ShapeDtypeStruct(shape, bf16), jax.ShapeDtypeStruct(shape, bf16),
                   jax.ShapeDtypeStruct((8, 32, 128), bf16),
                   jax.ShapeDtypeStruct((8, cache.max_blocks_per_seq), jnp.int32),
                   jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32),
                   jax.ShapeDtypeStruct((8, 8, 128), bf16)))
  _, findings = pool_copy_findings(jax.jit(step, donate_argnums=0), args, cache)
  assert findings, "a copy of the stacked layer was not detected"


@pytest.mark.parametrize("decode_only", [False, True])
def test_llama8b_forward_never_copies_the_kv_pool(decode_only):
  """2-layer Llama-8B forward through the model's attention dispatch ("pallas"): a mixed
  step (64 tokens over 8 sequences, the ragged kernel) or a decode-only one (8 tokens,
  `decode_only=True`: the decode kernel). The pages reach the kernels and the K/V write
  with no copy."""
  cache = CACHE_512M
  model = llama.LlamaForCausalLM(LLAMA8B_2L, attention_backend="pallas")
  params, tokens, positions, pages, meta = forward_args(
      LLAMA8B_2L, cache, num_tokens=8 if decode_only else 64, num_seqs=8)
  args = (params, tokens, positions, pages, meta.replace(decode_only=decode_only))
  pool = 2 * LLAMA8B_2L.num_layers * layer_pool_bytes(cache)
  report, findings, hlo = pool_copy_findings(jax.jit(model.apply, donate_argnums=(3,)), args,
                                             cache, pool_bytes_donated=pool, keep_hlo=True)
  assert not findings, findings
  assert not report.spilled_kernels
  # Kernel names (Triton launches or Mosaic GPU custom calls) say which kernel ran.
  assert ("ragged" in hlo) != decode_only, "the step ran the wrong attention kernel"
  assert "paged" in hlo


# The whole engine step: 4 GiB of bf16 pages (1 GiB per layer per K/V), a 4-step decode loop.
DECODE_STEPS = 4


@functools.lru_cache(maxsize=None)
def _engine_step_compile(speculative: bool = False):
  """(report, findings, optimized HLO) of the engine's jitted step for sm_90 (compiled once;
  `speculative`: its variant verifying 3 n-gram drafts per row)."""
  from paged_jax import engine  # pylint: disable=g-import-not-at-top
  step_for_compile = getattr(engine, "step_for_compile", None)
  if step_for_compile is None:
    pytest.skip("paged_jax.engine.step_for_compile is not there yet")
  sharding = jax.sharding.SingleDeviceSharding(ct.sm90_device())
  # "auto" on this CPU host: the sharding's H200 must pick the Pallas GPU kernels.
  fn, args = step_for_compile(LLAMA8B_2L, CACHE_4G, sharding=sharding,
                              max_num_batched_tokens=64, decode_steps_per_sync=DECODE_STEPS,
                              attention_backend="auto", speculative_config=(
                                  {"method": "ngram", "num_speculative_tokens": 3}
                                  if speculative else None))
  pool = 2 * LLAMA8B_2L.num_layers * layer_pool_bytes(CACHE_4G)
  assert pool >= 4 * 2**30
  return pool_copy_findings(fn, args, CACHE_4G, pool_bytes_donated=pool, keep_hlo=True,
                            **({"spec": True} if speculative else {}))


def test_auto_attention_is_decided_by_the_h200_sharding_not_the_host():
  """step_for_compile(sharding=<H200>) with "auto" (or family-"auto" "pallas") builds the
  step on the Mosaic GPU kernels: the host (a CPU) alone would give the jnp path, whose
  gathered K/V took 413.6 MB of temporaries in this compile (issue 27)."""
  from paged_jax.engine import compile as engine_compile  # pylint: disable=g-import-not-at-top
  h200 = jax.sharding.SingleDeviceSharding(ct.sm90_device())
  for spelling in ("auto", "pallas"):
    assert engine_compile.step_backend(spelling, LLAMA8B_2L, CACHE_4G,
                                       h200) == "pallas:mosaic_gpu"
  host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  assert engine_compile.step_backend("auto", LLAMA8B_2L, CACHE_4G, host) in ("cpu", "xla")


@pytest.mark.slow   # one compile of the whole step: ~20 s of CPU, minutes on a busy host
def test_engine_step_compiles_for_h200_without_pool_copies_or_spills():
  """Allocation, K/V write, attention, sampling and the multi-step decode loop, jitted as
  the engine runs them: compiles (no spill, shared memory within budget), never copies
  the 4 GiB pool, and updates it in place (the donated pages alias the outputs)."""
  report, findings, _ = _engine_step_compile()
  assert not findings, findings
  assert not report.spilled_kernels
  assert report.max_shared_memory <= ct.SM90_SHARED_MEMORY_BYTES


@pytest.mark.slow
def test_speculating_step_compiles_for_h200_without_pool_copies_or_spills():
  """The speculative decoding variant (k + 1 logits per row, verification, rollback of
  rejected drafts' blocks, the decode loop beside it) holds the same promises."""
  report, findings, hlo = _engine_step_compile(speculative=True)
  assert not findings, findings
  assert not report.spilled_kernels
  assert report.max_shared_memory <= ct.SM90_SHARED_MEMORY_BYTES
  readbacks = host_readbacks(hlo)
  assert not readbacks["while"] and not readbacks["conditional"], readbacks


@pytest.mark.slow
def test_multi_step_decode_loop_never_reads_back_to_the_host():
  """"One host sync per k tokens" holds on a GPU only if the decode loop body has no host
  readback: the loop needs a known trip count and its body no conditional."""
  _, _, hlo = _engine_step_compile()
  readbacks = host_readbacks(hlo)
  in_loop = [op for op in readbacks["conditional"] if op.startswith("jit(step)/while/")]
  assert not readbacks["while"] and not in_loop, readbacks
