"""The CPU engine's attention backends against the plain-jnp reference, the oracle:
"xla" (pallas_kernels/cpu/xla_attention) and "cpu" (pallas_kernels/cpu/custom_calls, the
XLA:CPU custom calls; their own checks are in cpu_attention_test.py), on the ragged kernel
tests' random batches (decode rows, prefill chunks starting mid-block, empty and dead
sequences, padding rows, garbage table entries, NaN in every slot no live sequence owns,
int8 / fp8 pages with scales, which "cpu" hands to "xla"), plus the engine end to end
against the dense oracle (the query tiles: query_tiles_test.py). Seeds come from the
test id."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention
from paged_jax.engine import Engine
from pallas_kernels.cpu import custom_calls
from pallas_kernels.cpu import xla_attention
from pallas_kernels.reference import paged_attention_reference

import engine_oracle
from ragged_batches import (TOL, _test_seed, assert_matches, make_batch, mixed_seqs, reference,
                            rel_err)

_STATIC = ("sm_scale", "soft_cap", "sliding_window")
NO_CPU = custom_calls.unavailable_reason()
# Backend "cpu" (no tile knobs) and "xla" at several query-tile sizes.
IMPLS = [pytest.param("cpu", None, marks=pytest.mark.skipif(NO_CPU is not None,
                                                             reason=str(NO_CPU))),
         pytest.param("xla", 1, marks=pytest.mark.slow), ("xla", 16)]
BACKENDS = ["cpu", "xla"]   # tests taking these skip "cpu" themselves when it is missing
decode_ref = jax.jit(paged_attention_reference, static_argnames=_STATIC)


@functools.lru_cache(maxsize=None)
def kernels(backend: str, tile_tokens=None):
  """(ragged, decode), jitted, of one CPU backend (xla: at `tile_tokens` per tile)."""
  if backend == "cpu":
    return (jax.jit(custom_calls.ragged_attention, static_argnames=_STATIC),
            jax.jit(custom_calls.decode_attention, static_argnames=_STATIC))
  ragged = functools.partial(xla_attention.ragged_attention, tile_tokens=tile_tokens or 16,
                             tiles_per_step=3)
  return (jax.jit(ragged, static_argnames=_STATIC),
          jax.jit(xla_attention.decode_attention, static_argnames=_STATIC))


CASES = [   # (group, head_dim, block_size, q_dtype, page_dtype, semantic kwargs)
    (1, 64, 16, jnp.float32, None, {}),
    (2, 32, 8, jnp.float32, None, {"soft_cap": 3.0, "sliding_window": 19}),
    (4, 128, 1, jnp.float32, None, {"sm_scale": 0.3}),
    (4, 64, 4, jnp.float32, None, {"sliding_window": 1}),
    (4, 64, 4, jnp.bfloat16, None, {}),
    (2, 64, 16, jnp.float32, jnp.int8, {}),
    (4, 32, 16, jnp.bfloat16, jnp.float8_e4m3fn, {"sm_scale": 0.2}),
]


@pytest.mark.parametrize("backend,tile_tokens", IMPLS)
@pytest.mark.parametrize("group,head_dim,block_size,q_dtype,page_dtype,kw", CASES)
def test_ragged_matches_reference(group, head_dim, block_size, q_dtype, page_dtype, kw,
                                  backend, tile_tokens):
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = mixed_seqs(rng, block_size, num_decode=5, prefill_q_lens=[1, 7, 23, 40])
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=group,
                                       head_dim=head_dim, block_size=block_size,
                                       q_dtype=q_dtype, page_dtype=page_dtype)
  out = kernels(backend, tile_tokens)[0](*args, **kw, **scales)
  assert_matches(seed, out, reference(*args, **kw, **scales), row_valid, q_dtype)
  assert (np.asarray(out.astype(jnp.float32))[~row_valid] == 0).all()   # padding rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group,head_dim,block_size,q_dtype,page_dtype,kw", CASES)
def test_decode_matches_reference(group, head_dim, block_size, q_dtype, page_dtype, kw,
                                  backend):
  if backend == "cpu" and NO_CPU:
    pytest.skip(NO_CPU)
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = [(1, int(n)) for n in rng.integers(1, 90, 6)] + [(1, block_size), (1, 1)]
  args, scales, _ = make_batch(rng, seqs=seqs, num_kv_heads=2, group=group,
                               head_dim=head_dim, block_size=block_size, q_dtype=q_dtype,
                               page_dtype=page_dtype, dead_seqs=0, padding_rows=0)
  q, k, v, tables, kv_lens = args[:5]
  lengths = kv_lens.at[3].set(0)            # a row with nothing cached returns zeros
  out = np.asarray(kernels(backend)[1](q, k, v, tables, lengths, **kw, **scales).astype(
      jnp.float32))
  want = np.asarray(decode_ref(q, k, v, tables, lengths, **kw, **scales).astype(jnp.float32))
  assert np.isfinite(out).all() and (out[3] == 0).all(), f"seed={seed}"
  err = rel_err(out, want)
  assert err <= TOL[q_dtype], f"seed={seed}: rel err {err:.3g} > {TOL[q_dtype]}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_agrees(backend):
  if backend == "cpu" and NO_CPU:
    pytest.skip(NO_CPU)
  rng = np.random.default_rng(_test_seed())
  seqs = mixed_seqs(rng, 8, num_decode=3, prefill_q_lens=[9])
  args, _, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=2, head_dim=32,
                                  block_size=8)
  via = attention.ragged_paged_attention(*args, backend=backend, soft_cap=2.0, num_warps=4)
  want = reference(*args, soft_cap=2.0)
  assert rel_err(np.asarray(via)[row_valid], np.asarray(want)[row_valid]) <= 1e-5
  with pytest.raises(TypeError, match="softcap"):
    attention.ragged_paged_attention(*args, backend=backend, softcap=2.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decode_steps", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_engine_on_cpu_backends_equals_dense_oracle(decode_steps, backend):
  """Greedy outputs through the engine on each CPU backend (chunked prefill, mixed and
  decode-only steps, preemption at a tight pool) equal the dense oracle's."""
  if backend == "cpu" and NO_CPU:
    pytest.skip(NO_CPU)
  mc = engine_oracle.MC
  cc = mc.cache_config(block_size=4, num_blocks=14, max_seqs=5,
                       max_blocks_per_seq=engine_oracle.ORACLE_LEN // 4)
  eng = Engine(mc, engine_oracle.PARAMS, cc, max_num_batched_tokens=12,
               attention_backend=backend, decode_steps_per_sync=decode_steps)
  # Planned one token per row, so the pool this tight still preempts (and the decode
  # loop runs out of blocks) with 3 steps per sync; the lookahead is engine_test's.
  eng.scheduler.lookahead = 0
  prompts = engine_oracle.random_prompts(_test_seed(), 5, 3, 20)
  outs = eng.generate(prompts, engine_oracle.greedy(9))
  assert eng.num_preemptions > 0
  for p, o in zip(prompts, outs):
    assert list(o.outputs[0]) == engine_oracle.dense_greedy(engine_oracle.PARAMS, p, 9)
