"""KVPages: write / copy_blocks / zero_blocks / gather against a numpy model, jitted and
eagerly (chex.variants), with int8 / fp8 scales in either layout (blocks, or the TPU
kernels' scale rows: `kv_cache.init(..., scale_rows=True)`); donation; chex checks at the
ops' boundaries."""

import zlib

from absl.testing import absltest, parameterized
import chex
import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from paged_jax import kv_cache
from paged_jax.config import CacheConfig
from pallas_kernels import scale_rows

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _cfg(dtype="float32", **kw):
  base = dict(block_size=4, num_blocks=6, max_seqs=2, max_blocks_per_seq=3, num_layers=2,
              num_kv_heads=3, head_dim=8, dtype=dtype)
  base.update(kw)
  return CacheConfig(**base)


def _random_pages(cfg, rng, rows=False):
  """Pages filled with random data (never zeros), plus a numpy copy (scales in the blocks
  layout). `rows`: the pages hold their scales as scale rows (padding zero)."""
  pages = kv_cache.init(cfg)
  shape = pages.k.shape
  def rand(dt):
    if dt == jnp.int8:
      return rng.integers(-127, 128, shape).astype(np.int8)
    return rng.normal(size=shape).astype(np.float32).astype(dt)
  k, v = rand(pages.k.dtype), rand(pages.v.dtype)
  ks = vs = None
  if cfg.quantized:
    ks = rng.uniform(0.01, 1.0, shape[:-1]).astype(np.float32)
    vs = rng.uniform(0.01, 1.0, shape[:-1]).astype(np.float32)
  held = lambda s: None if s is None else jnp.asarray(
      np.stack([_np_rows(x, cfg) for x in s]) if rows else s)
  pages = kv_cache.KVPages.from_stacked(jnp.asarray(k), jnp.asarray(v), held(ks), held(vs))
  assert pages.scale_rows == (rows and cfg.quantized)
  model = {"k": np.array(k), "v": np.array(v), "k_scale": ks, "v_scale": vs}
  return pages, model


def _np_rows(scales, cfg):
  """f32[Hkv, NB, bs] -> scale rows f32[Hkv, ceil(NB * bs / 128), 128], by hand."""
  flat = scales.reshape(scales.shape[0], -1)
  out = np.zeros((scales.shape[0], -(-flat.shape[1] // 128) * 128), np.float32)
  out[:, :flat.shape[1]] = flat
  return out.reshape(scales.shape[0], -1, 128)


def _held_scales(pages, name, cfg):
  """A scale stack as [L, Hkv, NB, bs] numpy; rows' padding must have stayed zero."""
  x = np.asarray(getattr(pages, name))
  if not pages.scale_rows:
    return x
  assert x.shape[2:] == (scale_rows.num_rows(cfg.num_blocks, cfg.block_size), 128), x.shape
  flat = x.reshape(x.shape[0], x.shape[1], -1)
  n = cfg.num_blocks * cfg.block_size
  assert not flat[..., n:].any(), "a scale row's padding was written"
  return flat[..., :n].reshape(x.shape[:2] + (cfg.num_blocks, cfg.block_size))


def _np_quantize(x, dtype):
  qmax = _QMAX[dtype]
  x = x.astype(np.float32)
  scale = (np.abs(x).max(-1) / np.float32(qmax)).astype(np.float32)
  safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]
  y = np.clip(x / safe, -qmax, qmax)
  if dtype == "int8":
    return np.round(y).astype(np.int8), scale
  return y.astype(ml_dtypes.float8_e4m3fn), scale


def _np_write(model, cfg, layer, k_new, v_new, slots):
  bs = cfg.block_size
  for name, x in (("k", k_new), ("v", v_new)):
    if cfg.quantized:
      q, s = _np_quantize(x, cfg.dtype)
    else:
      q, s = x.astype(model[name].dtype), None
    for t, slot in enumerate(slots):
      if slot < 0:
        continue
      b, o = divmod(int(slot), bs)
      model[name][layer, :, b, o, :] = q[t]
      if s is not None:
        model[name + "_scale"][layer, :, b, o] = s[t]


def _assert_same(pages, model, cfg):
  """Float pages: bit-exact. Quantized pages: XLA may divide by the scale as a
  multiply by its reciprocal (1 ulp), so a code may sit one step away and a scale
  1e-7 relative away; anything else is a real mismatch."""
  if model["k_scale"] is None:
    np.testing.assert_array_equal(np.asarray(pages.k), model["k"])
    np.testing.assert_array_equal(np.asarray(pages.v), model["v"])
    assert pages.k_scale is None and pages.v_scale is None
    return
  for name in ("k", "v"):
    got = np.asarray(getattr(pages, name)).astype(np.float32)
    want = model[name].astype(np.float32)
    step = 1.0 if model[name].dtype == np.int8 else np.abs(want) / 8 + 2.0**-9
    assert np.all(np.abs(got - want) <= step), name
    assert np.mean(got != want) < 0.01, name
    np.testing.assert_allclose(_held_scales(pages, name + "_scale", cfg),
                               model[name + "_scale"], rtol=1e-6)


class KVOpsTest(chex.TestCase):
  """The pure page ops, jitted and eagerly, against the numpy model."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      *((d, d, False) for d in ("float32", "bfloat16", "int8", "float8_e4m3fn")),
      ("int8_rows", "int8", True), ("float8_e4m3fn_rows", "float8_e4m3fn", True))
  def test_write_matches_numpy_model(self, dtype, rows):
    rng = np.random.default_rng(zlib.crc32(dtype.encode()))
    cfg = _cfg(dtype)
    pages, model = _random_pages(cfg, rng, rows)
    write = self.variant(kv_cache.write, static_argnums=1)
    for step in range(4):
      num_tokens = int(rng.integers(1, 10))
      slots = rng.choice(cfg.num_slots, size=num_tokens, replace=False).astype(np.int32)
      slots[rng.random(num_tokens) < 0.3] = -1   # padding rows: skipped
      if step == 1:   # past the pool (into a scale row's padding, were it not dropped)
        slots[-1] = cfg.num_slots + step
      layer = int(rng.integers(0, cfg.num_layers))
      k_new = (rng.normal(size=(num_tokens, 3, 8)) * rng.uniform(0.1, 50)).astype(np.float32)
      v_new = rng.normal(size=(num_tokens, 3, 8)).astype(np.float32)
      if step == 0:
        k_new[0] = 0.0   # an all-zero token must not divide by zero
      pages = write(pages, layer, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))
      _np_write(model, cfg, layer, k_new, v_new, np.where(slots < cfg.num_slots, slots, -1))
      _assert_same(pages, model, cfg)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("float32", "float32", False, 4), ("int8", "int8", False, 4),
      ("int8_rows", "int8", True, 4),            # 128 / 4 blocks share a row
      ("int8_rows_bs256", "int8", True, 256))    # a block spans two rows
  def test_copy_and_zero_blocks_match_numpy_model(self, dtype, rows, block_size):
    rng = np.random.default_rng(3)
    cfg = _cfg(dtype, block_size=block_size)
    pages, model = _random_pages(cfg, rng, rows)
    # A chain 1->2, 2->3 checks that all sources are read before any write.
    pairs = np.array([[1, 2], [2, 3], [-1, 0], [5, 4], [0, -1]], np.int32)
    pages = self.variant(kv_cache.copy_blocks)(pages, jnp.asarray(pairs))
    before = {k: (None if v is None else v.copy()) for k, v in model.items()}
    for src, dst in pairs:
      if src >= 0 and dst >= 0:
        for name in model:
          if model[name] is not None:
            model[name][:, :, dst] = before[name][:, :, src]
    _assert_same(pages, model, cfg)
    ids = np.array([4, -1, 0], np.int32)
    pages = self.variant(kv_cache.zero_blocks)(pages, jnp.asarray(ids))
    for name in model:
      if model[name] is not None:
        model[name][:, :, [4, 0]] = 0
    _assert_same(pages, model, cfg)
    # The swap's block reads / writes (engine/swap.py): blocks layout on the host side.
    ids = jnp.asarray([5, 1, 3], jnp.int32)
    got = kv_cache.read_blocks(pages, ids)
    for name in model:
      if model[name] is not None:
        np.testing.assert_array_equal(np.asarray(got[name]), model[name][:, :, [5, 1, 3]])
    pages = kv_cache.write_blocks(pages, jnp.asarray([2, -1, 6], jnp.int32), got)
    for name in model:
      if model[name] is not None:
        model[name][:, :, 2] = model[name][:, :, 5]
    _assert_same(pages, model, cfg)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("blocks", False), ("rows", True))
  def test_layer_view_and_gather(self, rows):
    rng = np.random.default_rng(11)
    cfg = _cfg("int8")
    pages, model = _random_pages(cfg, rng, rows)
    k, v, ks, vs = self.variant(kv_cache.layer, static_argnums=1)(pages, 1)
    chex.assert_shape(k, (3, 6, 4, 8))
    want_vs = _np_rows(model["v_scale"][1], cfg) if rows else model["v_scale"][1]
    chex.assert_shape([ks, vs], want_vs.shape)    # as held: the kernels read either
    chex.assert_trees_all_equal((v, vs), (model["v"][1], want_vs), strict=True)
    table = np.array([4, 0, 2], np.int32)
    kd, vd = self.variant(kv_cache.gather, static_argnums=1)(pages, 1, jnp.asarray(table))
    chex.assert_shape([kd, vd], (12, 3, 8))
    want = (model["k"][1].astype(np.float32) * model["k_scale"][1][..., None])[:, table]
    want = want.reshape(3, 12, 8).transpose(1, 0, 2)
    chex.assert_trees_all_close(kd, want, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_inconsistent_pages_and_inputs_are_named(self):
    """chex checks: eagerly before any work, under jit at trace time."""
    pages = kv_cache.init(_cfg("int8"))
    x, slots = jnp.ones((2, 3, 8)), jnp.array([0, 1], jnp.int32)
    wide_v = pages.replace(v=kv_cache.LayerStack([jnp.zeros((3, 6, 4, 16), jnp.int8)] * 2))
    f32_v = pages.replace(v=pages.v.astype(jnp.float32))
    short_scale = pages.replace(k_scale=kv_cache.LayerStack([jnp.zeros((3, 6, 2))] * 2))
    cases = [
        (lambda p: kv_cache.write(p, 0, x, x, slots), wide_v, r"KVPages.k vs KVPages.v"),
        (lambda p: kv_cache.copy_blocks(p, jnp.zeros((1, 2), jnp.int32)), f32_v,
         r"KVPages.k vs KVPages.v"),
        (lambda p: kv_cache.zero_blocks(p, jnp.zeros((1,), jnp.int32)), short_scale,
         r"KVPages scales"),
        (lambda p: kv_cache.write(p, 0, x.astype(jnp.int32), x, slots), pages, r"k_new, v_new"),
    ]
    for i, (op, arg, pattern) in enumerate(cases):
      with self.assertRaisesRegex(AssertionError, pattern, msg=f"case {i}"):
        self.variant(op)(arg)
    with self.assertRaisesRegex(TypeError, "both be set"):
      self.variant(kv_cache.zero_blocks)(pages.replace(v_scale=None), jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("dtype,rel", [("int8", 0.5 / 127), ("float8_e4m3fn", 1 / 16)])
def test_quantized_round_trip_error_is_bounded(dtype, rel):
  rng = np.random.default_rng(7)
  cfg = _cfg(dtype)
  pages = kv_cache.init(cfg)
  slots = np.array([0, 5, 9, 23], np.int32)
  k_new = (rng.standard_t(3, size=(4, 3, 8)) * 10).astype(np.float32)
  pages = kv_cache.write(pages, 1, jnp.asarray(k_new), jnp.asarray(k_new), jnp.asarray(slots))
  k_dense, _ = kv_cache.gather(pages, 1, jnp.arange(cfg.num_blocks, dtype=jnp.int32))
  got = np.asarray(k_dense)[slots]                      # [4, Hkv, D]
  absmax = np.abs(k_new).max(-1, keepdims=True)
  assert np.all(np.abs(got - k_new) <= rel * absmax + 1e-6)
  assert np.max(np.abs(got - k_new)) > 0              # really quantized


def _live_bytes(stats):
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_donated_write_keeps_one_copy_of_the_pages(dtype):
  cfg = _cfg(dtype, num_blocks=512, block_size=16, head_dim=64, num_layers=2, num_kv_heads=2)
  pages = kv_cache.init(cfg)
  page_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(pages))
  args = (pages, 1, jnp.ones((5, 2, 64)), jnp.ones((5, 2, 64)), jnp.arange(5, dtype=jnp.int32))
  donated = jax.jit(kv_cache.write, donate_argnums=0, static_argnums=1).lower(*args)
  plain = jax.jit(kv_cache.write, static_argnums=1).lower(*args)
  d, p = donated.compile().memory_analysis(), plain.compile().memory_analysis()
  # Donated: the outputs alias the page buffers and nothing page-sized is temporary.
  assert d.alias_size_in_bytes == page_bytes
  assert _live_bytes(d) < 1.1 * page_bytes
  # Not donated: the output is a second copy (this is what the test would catch).
  assert p.alias_size_in_bytes == 0
  assert _live_bytes(p) >= 2 * page_bytes
  num_leaves = len(jax.tree_util.tree_leaves(pages))
  assert donated.as_text().count("tf.aliasing_output") == num_leaves
  assert "tf.aliasing_output" not in plain.as_text()
  # At run time the donated input buffers are really consumed, and the values are the
  # undonated op's.
  want = jax.tree_util.tree_map(np.array, kv_cache.write(*args))
  new = kv_cache.write_donated(*args)
  assert pages.k.is_deleted() and not new.k.is_deleted()
  chex.assert_trees_all_equal(new, want, strict=True)


def test_bad_arguments_raise_clear_errors():
  cfg = _cfg()
  pages = kv_cache.init(cfg)
  x = jnp.ones((2, 3, 8))
  slots = jnp.array([0, 1], jnp.int32)
  with pytest.raises(ValueError, match="layer must be in"):
    kv_cache.write(pages, 2, x, x, slots)
  with pytest.raises(ValueError, match="k_new must have shape"):
    kv_cache.write(pages, 0, jnp.ones((2, 2, 8)), x, slots)
  with pytest.raises(ValueError, match="slot_mapping"):
    kv_cache.write(pages, 0, x, x, slots.astype(jnp.float32))
  with pytest.raises(ValueError, match="pairs must have shape"):
    kv_cache.copy_blocks(pages, jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="block_ids"):
    kv_cache.zero_blocks(pages, jnp.zeros((2, 2), jnp.int32))
  with pytest.raises(TypeError, match="cache_config"):
    kv_cache.init({"block_size": 4})
  with pytest.raises(TypeError, match="LayerStack"):   # a stacked array is no longer pages
    kv_cache.write(pages.replace(k=jnp.zeros(pages.k.shape)), 0, x, x, slots)
  with pytest.raises(TypeError, match="Python int"):
    kv_cache.layer(pages, jnp.int32(0))


def test_scale_rows_are_held_where_the_tpu_kernels_run():
  """`init(scale_rows=True)`: f32[Hkv, ceil(NB * bs / 128), 128] per layer; which
  backends get them; pages whose K and V scales disagree on the layout are refused."""
  cfg = _cfg("int8", num_blocks=40)                  # 160 slots: 2 rows, the second padded
  pages = kv_cache.init(cfg, scale_rows=True)
  assert pages.scale_rows and pages.k_scale.shape == (2, 3, 2, 128)
  assert pages.k.shape == kv_cache.init(cfg).k.shape and not kv_cache.init(cfg).scale_rows
  assert not kv_cache.init(_cfg(), scale_rows=True).quantized   # float pages: no scales
  for backend in ("pallas:tpu", "pallas_interpret:tpu"):
    assert kv_cache.scale_rows_for(backend)
  cpu = jax.devices("cpu")[0]
  for backend in (None, "reference", "xla", "cpu", "pallas_interpret:triton", "auto"):
    assert not kv_cache.scale_rows_for(backend, cpu), backend
  mixed = pages.replace(v_scale=kv_cache.init(cfg).v_scale)
  with pytest.raises(AssertionError, match="KVPages scales"):
    kv_cache.zero_blocks(mixed, jnp.zeros((1,), jnp.int32))


def test_layer_stack_indexes_like_the_stacked_array():
  """One array per layer, but `[:, :, ids]` reads, `.at[:, :, ids].set` writes, shape and
  np.asarray behave as on the stacked [L, Hkv, NB, bs, D] array (the swap path uses them)."""
  rng = np.random.default_rng(4)
  cfg = _cfg("int8")
  pages, model = _random_pages(cfg, rng)
  assert isinstance(pages.k, kv_cache.LayerStack) and len(pages.k.layers) == 2
  assert pages.k.shape == model["k"].shape and pages.k.dtype == jnp.int8
  assert kv_cache.layer(pages, 1)[0] is pages.k.layers[1]   # the buffer itself, no copy
  ids = jnp.asarray([5, 0, 3], jnp.int32)
  np.testing.assert_array_equal(np.asarray(pages.k[:, :, ids]), model["k"][:, :, [5, 0, 3]])
  new = rng.integers(-127, 128, (2, 3, 3, 4, 8)).astype(np.int8)
  updated = jax.jit(lambda s, x: s.at[:, :, ids].set(x, mode="drop"))(pages.k, new)
  model["k"][:, :, [5, 0, 3]] = new
  np.testing.assert_array_equal(np.asarray(updated), model["k"])
  assert isinstance(updated, kv_cache.LayerStack)
  with pytest.raises(TypeError, match="layer index"):
    pages.k[jnp.asarray(0)]


if __name__ == "__main__":
  absltest.main()
