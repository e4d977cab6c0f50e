"""The Pallas TPU paged-attention kernels in the TPU interpreter, against the references.

Every call runs in pltpu's interpreter with races detected, uninitialized memory as NaN,
out-of-bounds reads raising and DMAs landing only on wait (tests/tpu_support.py), on
random batches whose stale slots are NaN and whose block tables hold garbage past each
length (tests/ragged_batches.py). Checked against pallas_kernels.reference and, on clean
copies of the same inputs, against JAX's own TPU kernels (ragged paged attention; the
decode paged_attention). Interpretation is slow (each static configuration compiles for
seconds): the default cases cover every feature once, the wide grid is marked slow.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels import tpu
from pallas_kernels.tpu import jax_baselines
from ragged_batches import _test_seed, make_batch, mixed_seqs
from tpu_support import (COMPILED, INTERPRET, assert_close, clean, decode_batch,
                         jax_kernels_interpreted, run_checked)

_ragged_ref = jax.jit(reference.ragged_paged_attention_reference,
                      static_argnames=("sm_scale", "soft_cap", "sliding_window"))
_decode_ref = jax.jit(reference.paged_attention_reference,
                      static_argnames=("sm_scale", "soft_cap", "sliding_window"))
QDTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def check_ragged(*, block_size, num_kv_heads, group, head_dim, q="f32", pages=None,
                 window=None, cap=None, sm_scale=None, **knobs):
  rng = np.random.default_rng(_test_seed())
  q_dtype = QDTYPES[q]
  seqs = mixed_seqs(rng, block_size, num_decode=3, prefill_q_lens=[block_size + 3, 5],
                    max_ctx=4 * block_size)
  seqs.append((2, 2 * block_size + 1))
  args, scales, rows = make_batch(rng, seqs=seqs, num_kv_heads=num_kv_heads, group=group,
                                  head_dim=head_dim, block_size=block_size,
                                  q_dtype=q_dtype, page_dtype=pages)
  sem = dict(sm_scale=sm_scale, soft_cap=cap, sliding_window=window)
  out = run_checked(tpu.ragged_paged_attention, *args, **scales, **sem, interpret=INTERPRET,
                    **knobs)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert_close(out, _ragged_ref(*args, **scales, **sem), q_dtype, rows)


def check_decode(*, block_size, num_kv_heads, group, head_dim, q="f32", pages=None,
                 window=None, cap=None, sm_scale=None, **knobs):
  rng = np.random.default_rng(_test_seed())
  q_dtype = QDTYPES[q]
  full = 3 * block_size           # one sequence fills its whole table
  lengths = [0, 1, block_size, full, int(rng.integers(2, full)), block_size + 1]
  args, scales = decode_batch(rng, lengths=lengths, num_kv_heads=num_kv_heads, group=group,
                              head_dim=head_dim, block_size=block_size, q_dtype=q_dtype,
                              page_dtype=pages, pages_per_seq=3)
  sem = dict(sm_scale=sm_scale, soft_cap=cap, sliding_window=window)
  out = run_checked(tpu.paged_attention, *args, **scales, **sem, interpret=INTERPRET, **knobs)
  assert out.dtype == args[0].dtype
  assert (np.asarray(out[0], np.float32) == 0).all(), "length 0 must give zeros"
  assert_close(out, _decode_ref(*args, **scales, **sem), q_dtype)


# Default: every feature once, few static configurations (each one compiles for seconds).
RAGGED_DEFAULT = [
    dict(block_size=16, num_kv_heads=2, group=4, head_dim=128, q="bf16", kv_per_tile=32,
         q_per_tile=8),
    dict(block_size=32, num_kv_heads=2, group=1, head_dim=64, pages="int8", window=21,
         cap=20.0, kv_per_tile=128, q_per_tile=16),
]
DECODE_DEFAULT = [
    dict(block_size=16, num_kv_heads=1, group=8, head_dim=256, q="bf16", window=19,
         sm_scale=0.3, kv_per_tile=32, seqs_per_tile=4),
    dict(block_size=16, num_kv_heads=2, group=2, head_dim=128, pages="float8_e4m3fn",
         cap=5.0, kv_per_tile=16, seqs_per_tile=8, heads_per_tile=1),
]


@pytest.mark.parametrize("cfg", RAGGED_DEFAULT, ids=str)
def test_ragged_matches_reference(cfg):
  check_ragged(**cfg)


@pytest.mark.parametrize("cfg", DECODE_DEFAULT, ids=str)
def test_decode_matches_reference(cfg):
  check_decode(**cfg)


def test_ragged_matches_jax_rpa_reference():
  """Same inputs (clean copies, JAX's combined K/V layout), the reference JAX's RPA module
  ships with its kernel (the kernel itself does not run in either interpreter, see
  test_jax_rpa_kernel_is_not_interpretable)."""
  rng = np.random.default_rng(_test_seed())
  seqs = [(1, 37), (20, 20), (5, 40), (1, 1), (0, 9)]
  args, _, rows = make_batch(rng, seqs=seqs, num_kv_heads=2, group=4, head_dim=128,
                             block_size=16, q_dtype=jnp.float32, dead_seqs=0)
  args, _ = clean(args, {})
  sem = dict(soft_cap=30.0, sliding_window=24)
  ours = run_checked(tpu.ragged_paged_attention, *args, **sem, interpret=INTERPRET,
                     kv_per_tile=32, q_per_tile=8)
  theirs = jax_baselines.jax_ragged_reference(*args, **sem)
  live = int(rows.sum())
  assert theirs.shape[0] == live
  assert_close(ours[:live], theirs, jnp.float32)


@pytest.mark.skipif(not COMPILED, reason="JAX's RPA kernel runs only on a TPU (it does not "
                    "run in the interpreter): experiments/tpu_check.sh")
def test_ragged_matches_jax_rpa_kernel_on_tpu():
  rng = np.random.default_rng(_test_seed())
  seqs = [(1, 37), (20, 20), (5, 40), (1, 1), (0, 9), (33, 70)]
  args, _, rows = make_batch(rng, seqs=seqs, num_kv_heads=8, group=4, head_dim=128,
                             block_size=16, q_dtype=jnp.bfloat16, dead_seqs=0)
  args, _ = clean(args, {})
  sem = dict(soft_cap=30.0, sliding_window=24)
  ours = run_checked(tpu.ragged_paged_attention, *args, **sem, interpret=INTERPRET)
  theirs = jax.block_until_ready(jax_baselines.jax_ragged(
      *args, **sem, num_kv_pages_per_block=2, num_queries_per_block=16))
  assert_close(ours, theirs, jnp.bfloat16, rows)


@pytest.mark.slow
@pytest.mark.skipif(COMPILED, reason="about the interpreter")
@pytest.mark.xfail(strict=True, reason="JAX's RPA kernel reads through ref.reshape views, "
                   "which pltpu's interpreter cannot (jax 0.10.2 / 0.11.2); an XPASS means "
                   "it now can: compare against the kernel itself")
def test_jax_rpa_kernel_is_not_interpretable():
  rng = np.random.default_rng(_test_seed())
  args, _, _ = make_batch(rng, seqs=[(3, 20)], num_kv_heads=2, group=4, head_dim=128,
                          block_size=16, dead_seqs=0)
  args, _ = clean(args, {})
  with jax_kernels_interpreted():
    jax.block_until_ready(jax_baselines.jax_ragged(*args, num_kv_pages_per_block=1,
                                                   num_queries_per_block=8))


def test_decode_matches_jax_paged_attention():
  """Same head-major pages, JAX's paged decode kernel in the interpreter. It computes
  over bf16 copies of K/V even for f32 pages, hence the bf16 tolerance."""
  rng = np.random.default_rng(_test_seed())
  args, _ = decode_batch(rng, lengths=[5, 48, 17, 1], num_kv_heads=2, group=4,
                         head_dim=128, block_size=16, pages_per_seq=3)
  args, _ = clean(args, {})
  ours = run_checked(tpu.paged_attention, *args, soft_cap=10.0, interpret=INTERPRET,
                     kv_per_tile=32)
  with jax_kernels_interpreted():
    theirs = jax.block_until_ready(jax_baselines.jax_decode(
        *args, soft_cap=10.0, pages_per_compute_block=1))
  assert_close(ours, theirs, jnp.bfloat16)


def test_stale_nan_pages_never_reach_the_output():
  """A whole pool of NaN except the live slots, and a huge kv_len past the table: the
  kernel reads no key beyond the table and no page beyond a sequence's length."""
  rng = np.random.default_rng(_test_seed())
  args, _ = decode_batch(rng, lengths=[3, 33], num_kv_heads=2, group=2, head_dim=128,
                         block_size=16, pages_per_seq=3)
  q, k, v, tables, lens = args
  lens = lens.at[1].set(10_000)     # more keys than the table spans: clamped to 48
  out = run_checked(tpu.paged_attention, q, k, v, tables, lens, interpret=INTERPRET,
                    kv_per_tile=32)
  want = _decode_ref(q, k, v, tables, jnp.minimum(lens, 48))
  assert_close(out[:1], want[:1], jnp.float32)
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("bad, match", [
    (dict(q_shape=(4, 8)), "q must have shape"),
    (dict(heads=3), "num_kv_heads=3 must divide"),
    (dict(table_rows=3), "block_tables must have shape"),
    (dict(window=0), "sliding_window=0"),
    (dict(cap=-1.0), "soft_cap=-1.0"),
    (dict(pages="int8"), "need k_scales"),
    (dict(knobs=dict(kv_per_tile=24)), "kv_per_tile=24"),
    (dict(knobs=dict(heads_per_tile=3)), "heads_per_tile=3"),
])
def test_bad_arguments_raise_one_line_errors(bad, match):
  heads = bad.get("heads", 2)
  q = jnp.zeros(bad.get("q_shape", (4, 8, 128)), jnp.float32)
  pages = jnp.zeros((heads, 8, 16, 128), bad.get("pages", jnp.float32))
  tables = jnp.zeros((bad.get("table_rows", 4), 2), jnp.int32)
  with pytest.raises(ValueError, match=match):
    tpu.paged_attention(q, pages, pages, tables, jnp.ones((4,), jnp.int32),
                        sliding_window=bad.get("window"), soft_cap=bad.get("cap"),
                        interpret=True, **bad.get("knobs", {}))


# The wide grid: block sizes 16-128, GQA ratios 1 / 4 / 8, D 64 / 128 / 256, window and
# soft cap on and off, float / int8 / fp8 pages.
def _wide(kind):
  out = []
  combos = itertools.product((16, 32, 64, 128), ((4, 1), (2, 4), (1, 8)), (64, 128, 256))
  for i, (bs, (hkv, g), d) in enumerate(combos):
    pages = (None, "int8", "float8_e4m3fn")[i % 3]
    cfg = dict(block_size=bs, num_kv_heads=hkv, group=g, head_dim=d, pages=pages,
               q=("f32", "bf16")[i % 2], window=(None, bs + 3)[(i // 2) % 2],
               cap=(None, 25.0)[(i // 3) % 2], kv_per_tile=max(bs, 128) if i % 4 else bs)
    cfg.update(q_per_tile=(8, 16)[i % 2]) if kind == "ragged" else cfg.update(
        seqs_per_tile=(3, 8)[i % 2])
    out.append(cfg)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("cfg", _wide("ragged"), ids=str)
def test_ragged_wide_grid(cfg):
  check_ragged(**cfg)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", _wide("decode"), ids=str)
def test_decode_wide_grid(cfg):
  check_decode(**cfg)
