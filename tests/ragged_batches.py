"""Random ragged batches over a paged cache, shared by the attention tests (the Pallas
ragged kernel's and the xla path's): decode rows and prefill chunks of assorted lengths,
randomly permuted block tables with garbage past each length, NaN in every slot no live
sequence owns; seeds fixed by the test id; the jitted reference (the oracle)."""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import ragged_paged_attention_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
# One compiled program per shape (eager op-by-op dispatch of the oracle costs ~3x more).
reference = jax.jit(ragged_paged_attention_reference,
                    static_argnames=("sm_scale", "soft_cap", "sliding_window"))


def _test_seed(offset=0):
  """A seed fixed by the test's id (name and parameters): a failure replays exactly."""
  test_id = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
  return zlib.crc32(test_id.encode()) + offset


def make_batch(rng, *, seqs, num_kv_heads, group, head_dim, block_size, q_dtype=jnp.float32,
               page_dtype=None, dead_seqs=1, padding_rows=3, spare_blocks=4):
  """A random ragged batch over a paged cache.

  Args:
    seqs: list of (q_len, kv_len) for the live sequences (q_len <= kv_len).
  Returns:
    (args tuple for the kernel / reference, kwargs with k_scales / v_scales,
     row_valid bool[T]: rows that belong to a live sequence).
  """
  page_dtype = q_dtype if page_dtype is None else page_dtype
  num_live = len(seqs)
  num_seqs_max = num_live + dead_seqs
  pages_needed = [-(-kv // block_size) for _, kv in seqs]
  pages_per_seq = max(pages_needed + [1]) + 1
  num_blocks = sum(pages_needed) + spare_blocks
  perm = rng.permutation(num_blocks)
  tables = rng.integers(-num_blocks, 2 * num_blocks, (num_seqs_max, pages_per_seq))
  tables[rng.random(tables.shape) < 0.5] = -1  # past-the-end entries: -1 or garbage
  used = 0
  for i, n in enumerate(pages_needed):
    tables[i, :n] = perm[used:used + n]
    used += n
  kv_lens = np.array([kv for _, kv in seqs] + list(rng.integers(0, 50, dead_seqs)), np.int32)
  q_lens = [q for q, _ in seqs]
  cu = np.zeros(num_seqs_max + 1, np.int32)
  cu[1:num_live + 1] = np.cumsum(q_lens)
  cu[num_live + 1:] = cu[num_live]
  num_tokens = int(cu[num_live]) + padding_rows
  shape = (num_kv_heads, num_blocks, block_size, head_dim)
  quantized = jnp.dtype(page_dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))

  def pages():
    if jnp.dtype(page_dtype) == jnp.dtype(jnp.int8):
      x = rng.integers(-127, 128, shape).astype(np.float32)
    else:
      x = rng.standard_normal(shape).astype(np.float32)
    # Stale data: every slot no live sequence owns is NaN (pages never handed out, and
    # the tail of each sequence's last page).
    owned = np.zeros(shape[1:3], bool)
    for i, (_, kv) in enumerate(seqs):
      for pos in range(kv):
        owned[tables[i, pos // block_size], pos % block_size] = True
    if not quantized or jnp.dtype(page_dtype) != jnp.dtype(jnp.int8):
      x[:, ~owned] = np.nan
    return jnp.asarray(x).astype(page_dtype)

  scales = {}
  if quantized:
    lo, hi = (0.004, 0.02) if jnp.dtype(page_dtype) == jnp.dtype(jnp.int8) else (0.5, 1.5)
    for name in ("k_scales", "v_scales"):
      s = rng.uniform(lo, hi, shape[:3]).astype(np.float32)
      s[:, perm[used:]] = np.nan  # scales of never-used pages are stale too
      scales[name] = jnp.asarray(s)
  q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)),
                  jnp.float32).astype(q_dtype)
  args = (q, pages(), pages(), jnp.asarray(tables, jnp.int32), jnp.asarray(kv_lens),
          jnp.asarray(cu), jnp.int32(num_live))
  row_valid = np.arange(num_tokens) < cu[num_live]
  return args, scales, row_valid


def rel_err(out, ref):
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def assert_matches(seed, out, want, row_valid, q_dtype):
  """`out` equals the reference's `want` on the live rows (relative error within TOL),
  is finite everywhere and zero on padding rows. Returns out as f32 numpy."""
  out, want = np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
  assert out.shape == want.shape and out.dtype == want.dtype
  assert np.isfinite(out).all(), f"seed={seed}: non-finite output (stale data leaked?)"
  assert (out[~row_valid] == 0).all(), f"seed={seed}: padding rows must be zero"
  err = rel_err(out[row_valid], want[row_valid])
  assert err <= TOL[q_dtype], f"seed={seed}: rel err {err:.3g} > {TOL[q_dtype]}"
  return out


def mixed_seqs(rng, block_size, *, num_decode, prefill_q_lens, max_ctx=200):
  """Decode rows (q_len 1) and prefill chunks; chunk starts are often mid-block."""
  seqs = []
  for _ in range(num_decode):
    seqs.append((1, int(rng.choice([1, block_size - 1 or 1, block_size, block_size + 1,
                                    int(rng.integers(1, max_ctx))]))))
  for q_len in prefill_q_lens:
    prefix = int(rng.choice([0, int(rng.integers(1, max_ctx)), block_size,
                             3 * block_size - 1]))
    seqs.append((q_len, q_len + prefix))
  seqs.append((0, int(rng.integers(0, 40))))  # a sequence with nothing new this step
  order = rng.permutation(len(seqs))
  return [seqs[i] for i in order]
