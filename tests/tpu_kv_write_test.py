"""The TPU K/V write kernel (pallas_kernels/tpu/kv_write.py) in the TPU interpreter.

Against paged_jax.kv_cache.write (the engine's write, the definition) on the same pages:
bf16 / f32 / int8 / fp8 pages, a prefill chunk that starts mid-group and crosses pages,
decode tokens of other sequences (some sharing a scale row), padding (-1) and slots past
the pool between them; bit-exact, no race, and the pages outside the written slots
untouched.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import kv_cache
from pallas_kernels.tpu import kv_write
from pallas_kernels.tpu import scales
from ragged_batches import _test_seed
from tpu_support import INTERPRET, run_checked


def _slots(rng, num_blocks, block_size):
  pages = rng.permutation(num_blocks)
  start = int(rng.integers(1, block_size))          # a chunk starting mid-page
  chunk = pages[0] * block_size + start + np.arange(block_size + 5)
  chunk = np.where(chunk < (pages[0] + 1) * block_size, chunk,
                   pages[1] * block_size + chunk - (pages[0] + 1) * block_size)
  decode = [p * block_size + int(rng.integers(0, block_size)) for p in pages[2:6]]
  slots = list(chunk[:7]) + [-1] + list(chunk[7:]) + decode + [num_blocks * block_size + 3]
  return jnp.asarray(np.array(slots, np.int32))


@pytest.mark.parametrize("page_dtype", ["bfloat16", "float32", "int8", "float8_e4m3fn"])
def test_write_matches_kv_cache_write(page_dtype):
  rng = np.random.default_rng(_test_seed())
  heads, num_blocks, block_size, head_dim = 2, 10, 16, 128
  shape = (heads, num_blocks, block_size, head_dim)
  k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
  slots = _slots(rng, num_blocks, block_size)
  new = [jnp.asarray(rng.standard_normal((slots.shape[0], heads, head_dim)), jnp.bfloat16)
         for _ in range(2)]
  dt = jnp.dtype(page_dtype)
  if page_dtype in ("int8", "float8_e4m3fn"):
    (kq, ks), (vq, vs) = kv_cache.quantize(k, dt), kv_cache.quantize(v, dt)
    pages = kv_cache.KVPages.from_stacked(kq[None], vq[None], ks[None], vs[None])
    want = kv_cache.write(pages, 0, *new, slots)
    rows = lambda s: scales.as_rows(s, num_blocks, block_size)
    out = run_checked(kv_write.write_kv, kq, vq, *new, slots, rows(ks), rows(vs),
                      interpret=INTERPRET)
  else:
    pages = kv_cache.KVPages.from_stacked(k.astype(dt)[None], v.astype(dt)[None])
    want = kv_cache.write(pages, 0, *new, slots)    # before the kernel takes the pages
    out = run_checked(kv_write.write_kv, pages.k[0], pages.v[0], *new, slots,
                      interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(out[0], np.float32),
                                np.asarray(want.k[0], np.float32))
  np.testing.assert_array_equal(np.asarray(out[1], np.float32),
                                np.asarray(want.v[0], np.float32))
  if len(out) == 4:
    for got, ref in ((out[2], want.k_scale[0]), (out[3], want.v_scale[0])):
      np.testing.assert_array_equal(np.asarray(got),
                                    np.asarray(scales.as_rows(ref, num_blocks, block_size)))


def test_scales_must_be_rows():
  pages = jnp.zeros((2, 4, 16, 128), jnp.int8)
  with pytest.raises(ValueError, match="scale rows"):
    kv_write.write_kv(pages, pages, jnp.zeros((3, 2, 128)), jnp.zeros((3, 2, 128)),
                      jnp.zeros((3,), jnp.int32), jnp.zeros((2, 4, 16)),
                      jnp.zeros((2, 4, 16)), interpret=True)
