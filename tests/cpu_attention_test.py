"""pallas_kernels/cpu_attention (the XLA:CPU custom calls, backend "cpu") against the
plain-jnp reference, the oracle, on the ragged kernel tests' random batches (decode rows,
prefill chunks starting mid-block, empty and dead sequences, padding rows, garbage and
out-of-range table entries, NaN in every slot no live sequence owns, GQA groups 1-4, soft
cap, sliding window); bf16 / quantized operands fall back to xla_attention and still match;
the f32 path really is the custom call; a failed build is a one-line reason; the engine on
it equals the dense oracle. Seeds come from the test id."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention
from paged_jax.engine import Engine
from pallas_kernels import cpu_attention
from pallas_kernels.reference import paged_attention_reference

import engine_oracle
from ragged_batches import TOL, _test_seed, assert_matches, make_batch, mixed_seqs, reference, rel_err

pytestmark = pytest.mark.skipif(cpu_attention.unavailable_reason() is not None,
                                reason=str(cpu_attention.unavailable_reason()))

_STATIC = ("sm_scale", "soft_cap", "sliding_window")
ragged = jax.jit(cpu_attention.ragged_attention, static_argnames=_STATIC)
decode = jax.jit(cpu_attention.decode_attention, static_argnames=_STATIC)
decode_ref = jax.jit(paged_attention_reference, static_argnames=_STATIC)

CASES = [   # (group, head_dim, block_size, q_dtype, page_dtype, semantic kwargs)
    (1, 64, 16, jnp.float32, None, {}),
    (2, 32, 8, jnp.float32, None, {"soft_cap": 3.0, "sliding_window": 19}),
    (4, 128, 1, jnp.float32, None, {"sm_scale": 0.3}),
    (4, 64, 4, jnp.float32, None, {"sliding_window": 1}),
    (4, 64, 4, jnp.bfloat16, None, {}),                       # falls back to xla
    (2, 64, 16, jnp.float32, jnp.int8, {}),                   # falls back to xla
]


@pytest.mark.parametrize("group,head_dim,block_size,q_dtype,page_dtype,kw", CASES)
def test_ragged_matches_reference(group, head_dim, block_size, q_dtype, page_dtype, kw):
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = mixed_seqs(rng, block_size, num_decode=5, prefill_q_lens=[1, 7, 23, 40])
  args, scales, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=group,
                                       head_dim=head_dim, block_size=block_size,
                                       q_dtype=q_dtype, page_dtype=page_dtype)
  out = ragged(*args, **kw, **scales)
  assert_matches(seed, out, reference(*args, **kw, **scales), row_valid, q_dtype)
  assert (np.asarray(out.astype(jnp.float32))[~row_valid] == 0).all()   # padding rows


@pytest.mark.parametrize("group,head_dim,block_size,q_dtype,page_dtype,kw", CASES)
def test_decode_matches_reference(group, head_dim, block_size, q_dtype, page_dtype, kw):
  seed = _test_seed()
  rng = np.random.default_rng(seed)
  seqs = [(1, int(n)) for n in rng.integers(1, 90, 6)] + [(1, block_size), (1, 1)]
  args, scales, _ = make_batch(rng, seqs=seqs, num_kv_heads=2, group=group,
                               head_dim=head_dim, block_size=block_size, q_dtype=q_dtype,
                               page_dtype=page_dtype, dead_seqs=0, padding_rows=0)
  q, k, v, tables, kv_lens = args[:5]
  lengths = kv_lens.at[3].set(0)            # a row with nothing cached returns zeros
  out = np.asarray(decode(q, k, v, tables, lengths, **kw, **scales).astype(jnp.float32))
  want = np.asarray(decode_ref(q, k, v, tables, lengths, **kw, **scales).astype(jnp.float32))
  assert np.isfinite(out).all() and (out[3] == 0).all(), f"seed={seed}"
  err = rel_err(out, want)
  assert err <= TOL[q_dtype], f"seed={seed}: rel err {err:.3g} > {TOL[q_dtype]}"


def test_f32_runs_the_custom_calls_and_other_dtypes_do_not():
  q = jnp.zeros((3, 4, 32), jnp.float32)
  pages = jnp.zeros((2, 5, 4, 32), jnp.float32)
  tables, lens = jnp.zeros((3, 2), jnp.int32), jnp.ones((3,), jnp.int32)
  cu, n = jnp.arange(4, dtype=jnp.int32), jnp.int32(3)
  hlo = lambda f, *a: jax.jit(f).lower(*a).as_text()
  assert "paged_jax_cpu_decode" in hlo(cpu_attention.decode_attention, q, pages, pages,
                                       tables, lens)
  assert "paged_jax_cpu_ragged" in hlo(cpu_attention.ragged_attention, q, pages, pages,
                                       tables, lens, cu, n)
  bf = pages.astype(jnp.bfloat16)
  assert "paged_jax_cpu" not in hlo(cpu_attention.decode_attention, q.astype(jnp.bfloat16),
                                    bf, bf, tables, lens)


def test_bad_semantic_arguments_are_one_line_errors():
  q = jnp.zeros((1, 2, 8), jnp.float32)
  pages = jnp.zeros((1, 2, 4, 8), jnp.float32)
  args = (q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match="soft_cap must be > 0"):
    cpu_attention.decode_attention(*args, soft_cap=0.0)
  with pytest.raises(ValueError, match="sliding_window must be >= 1"):
    cpu_attention.decode_attention(*args, sliding_window=0)


def test_a_failed_build_says_why_in_one_line(tmp_path, monkeypatch):
  monkeypatch.setenv("CXX", "false")   # a "compiler" that fails without a word
  with pytest.raises(RuntimeError, match="^false failed: "):
    cpu_attention._build(tmp_path / "lib.so")   # pylint: disable=protected-access
  assert not list(tmp_path.iterdir())   # no partial library left behind


def test_auto_is_cpu_and_dispatch_agrees():
  if jax.default_backend() == "cpu":
    assert attention.resolve_backend("auto") == "cpu"
  rng = np.random.default_rng(_test_seed())
  seqs = mixed_seqs(rng, 8, num_decode=3, prefill_q_lens=[9])
  args, _, row_valid = make_batch(rng, seqs=seqs, num_kv_heads=2, group=2, head_dim=32,
                                  block_size=8)
  via = attention.ragged_paged_attention(*args, backend="cpu", soft_cap=2.0, num_warps=4)
  want = reference(*args, soft_cap=2.0)
  assert rel_err(np.asarray(via)[row_valid], np.asarray(want)[row_valid]) <= 1e-5


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_engine_on_cpu_attention_equals_dense_oracle(decode_steps):
  """Greedy outputs through the engine on the cpu backend (chunked prefill, mixed and
  decode-only steps, preemption at a tight pool) equal the dense oracle's."""
  mc = engine_oracle.MC
  cc = mc.cache_config(block_size=4, num_blocks=14, max_seqs=5,
                       max_blocks_per_seq=engine_oracle.ORACLE_LEN // 4)
  eng = Engine(mc, engine_oracle.PARAMS, cc, max_num_batched_tokens=12,
               attention_backend="cpu", decode_steps_per_sync=decode_steps)
  eng.scheduler.lookahead = 0   # one token planned per row: the tight pool still preempts
  prompts = engine_oracle.random_prompts(_test_seed(), 5, 3, 20)
  outs = eng.generate(prompts, engine_oracle.greedy(9))
  assert eng.num_preemptions > 0
  for p, o in zip(prompts, outs):
    assert list(o.outputs[0]) == engine_oracle.dense_greedy(engine_oracle.PARAMS, p, 9)


def test_engine_step_reads_the_pool_in_place():
  """The compiled CPU step hands the donated K/V pool to the custom calls as it is: no
  copy of a pool-sized array anywhere in the optimized HLO."""
  import re   # pylint: disable=g-import-not-at-top
  from paged_jax.engine import step_for_compile   # pylint: disable=g-import-not-at-top
  mc = engine_oracle.MC
  cc = mc.cache_config(block_size=16, num_blocks=64, max_seqs=8, max_blocks_per_seq=8)
  fn, args = step_for_compile(mc, cc, max_num_batched_tokens=32, decode_steps_per_sync=2,
                              attention_backend="cpu")
  hlo = fn.trace(*args).lower().compile().as_text()
  assert 'custom_call_target="paged_jax_cpu_ragged"' in hlo
  assert 'custom_call_target="paged_jax_cpu_decode"' in hlo   # the decode loop's
  pool = f"f32[{mc.num_kv_heads},64,16,{mc.head_dim}]"
  copies = [l for l in hlo.splitlines()
            if pool in l.split("=", 1)[-1][:80] and re.search(r"\} copy\(", l)]
  assert not copies, copies[:2]
