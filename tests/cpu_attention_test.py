"""What is particular to pallas_kernels/cpu/custom_calls.py (the XLA:CPU custom calls, backend
"cpu"): the f32 path really is the custom call and other dtypes are not; bad semantic
arguments and a failed build are one-line errors; "auto" picks it on a CPU; the compiled
engine step hands it the pool in place. Its results against the reference, and the engine
on it against the dense oracle, are checked beside the xla backend's in
xla_attention_test.py."""

import jax
import jax.numpy as jnp
import pytest

from paged_jax import attention
from pallas_kernels.cpu import custom_calls

import engine_oracle

pytestmark = pytest.mark.skipif(custom_calls.unavailable_reason() is not None,
                                reason=str(custom_calls.unavailable_reason()))


def test_f32_runs_the_custom_calls_and_other_dtypes_do_not():
  q = jnp.zeros((3, 4, 32), jnp.float32)
  pages = jnp.zeros((2, 5, 4, 32), jnp.float32)
  tables, lens = jnp.zeros((3, 2), jnp.int32), jnp.ones((3,), jnp.int32)
  cu, n = jnp.arange(4, dtype=jnp.int32), jnp.int32(3)
  hlo = lambda f, *a: jax.jit(f).lower(*a).as_text()
  assert "paged_jax_cpu_decode" in hlo(custom_calls.decode_attention, q, pages, pages,
                                       tables, lens)
  assert "paged_jax_cpu_ragged" in hlo(custom_calls.ragged_attention, q, pages, pages,
                                       tables, lens, cu, n)
  bf = pages.astype(jnp.bfloat16)
  assert "paged_jax_cpu" not in hlo(custom_calls.decode_attention, q.astype(jnp.bfloat16),
                                    bf, bf, tables, lens)


def test_bad_semantic_arguments_are_one_line_errors():
  q = jnp.zeros((1, 2, 8), jnp.float32)
  pages = jnp.zeros((1, 2, 4, 8), jnp.float32)
  args = (q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match="soft_cap must be a finite number > 0"):
    custom_calls.decode_attention(*args, soft_cap=0.0)
  with pytest.raises(ValueError, match="sliding_window must be an int >= 1"):
    custom_calls.decode_attention(*args, sliding_window=0)


def test_a_failed_build_says_why_in_one_line(tmp_path, monkeypatch):
  monkeypatch.setenv("CXX", "false")   # a "compiler" that fails without a word
  with pytest.raises(RuntimeError, match="^false failed: "):
    custom_calls._build(tmp_path / "lib.so")   # pylint: disable=protected-access
  assert not list(tmp_path.iterdir())   # no partial library left behind


def test_auto_is_cpu_on_a_cpu_platform():
  if jax.default_backend() != "cpu":
    pytest.skip("not a CPU platform")
  assert attention.resolve_backend("auto") == "cpu"


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
