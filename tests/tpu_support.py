"""Shared helpers of the TPU kernel tests: the strict interpreter, its race check, batches.

INTERPRET runs a Pallas TPU kernel on CPU with a happens-before race detector, NaN for
every uninitialized VMEM / SMEM byte, out-of-bounds reads raising, and DMAs landing only
when waited on (so a missing wait reads NaN). `run_checked` fails a test that raced.
On a TPU with PAGED_JAX_TEST_COMPILED=1 (experiments/tpu_check.sh) the same tests compile
the kernels for the chip instead (COMPILED; no race detector there).
"""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import ragged_batches

COMPILED = (os.environ.get("PAGED_JAX_TEST_COMPILED") == "1"
            and jax.default_backend() == "tpu")
INTERPRET = False if COMPILED else pltpu.InterpretParams(
    detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise",
    dma_execution_mode="on_wait")


def races_found() -> bool:
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mi  # pylint: disable=g-import-not-at-top
  return bool(mi.races is not None and mi.races.races_found)


def run_checked(fn, *args, **kwargs):
  """fn(*args, **kwargs) computed, then asserts the interpreter saw no race."""
  out = jax.block_until_ready(fn(*args, **kwargs))
  if not COMPILED:
    assert not races_found(), "TPU interpreter detected a data race"
  return out


@contextlib.contextmanager
def jax_kernels_interpreted():
  """JAX's own TPU kernels (no `interpret` argument) run in the TPU interpreter (on a TPU
  with COMPILED: compiled, as they are)."""
  if COMPILED:
    yield
    return
  with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(out_of_bounds_reads="raise")):
    yield


def decode_batch(rng, *, lengths, num_kv_heads, group, head_dim, block_size,
                 q_dtype=jnp.float32, page_dtype=None, pages_per_seq=None):
  """Decode inputs from ragged_batches.make_batch: one query per sequence, the stale
  slots NaN, garbage past each table's length. Returns (args, scale kwargs)."""
  seqs = [(1, n) if n else (0, 0) for n in lengths]
  args, scales, _ = ragged_batches.make_batch(
      rng, seqs=seqs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
      block_size=block_size, q_dtype=q_dtype, page_dtype=page_dtype, dead_seqs=0,
      padding_rows=0)
  _, k, v, tables, kv_lens, _, _ = args
  if pages_per_seq is not None:   # a table exactly as long as the longest sequence
    tables = tables[:, :pages_per_seq]
  q = jnp.asarray(rng.standard_normal((len(lengths), num_kv_heads * group, head_dim)),
                  jnp.float32).astype(q_dtype)
  return (q, k, v, tables, kv_lens), scales


def clean(args, scales):
  """The same batch without stale NaN and with every table entry a valid page: JAX's
  kernels trust their inputs (they neither clamp page ids nor mask NaN pages)."""
  args = list(args)
  num_blocks = args[1].shape[1]
  for i in (1, 2):
    if jnp.issubdtype(args[i].dtype, jnp.floating):
      args[i] = jnp.nan_to_num(args[i])
  args[3] = jnp.clip(args[3], 0, num_blocks - 1)
  scales = {k: jnp.nan_to_num(v) for k, v in scales.items()}
  return tuple(args), scales


def assert_close(out, want, q_dtype, rows=None):
  out = np.asarray(jnp.asarray(out, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert np.isfinite(out).all(), "non-finite output (stale data leaked?)"
  if rows is not None:
    assert (out[~rows] == 0).all(), "padding rows must be zero"
    out, want = out[rows], want[rows]
  err = ragged_batches.rel_err(out, want)
  assert err <= ragged_batches.TOL[q_dtype], f"rel err {err:.3g}"
