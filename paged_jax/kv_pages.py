"""The paged KV cache's pytree: `KVPages` (and hybrid KV's `HybridPages`), how `init`
builds it and how `check_pages` checks it. The ops on it are in `kv_cache`, which
re-exports these names (`kv_cache.KVPages`, `kv_cache.init`, ...).

Layout (head-major, so one attention program reads one head's pages contiguously), one
array per layer (`layer_stack.LayerStack`):

    k[l], v[l]:             [num_kv_heads, num_blocks, block_size, head_dim]
    k_scale[l], v_scale[l]: f32[num_kv_heads, num_blocks, block_size]  (int8/fp8 only)
                        or, on the TPU kernels, the same numbers as scale rows
                        f32[num_kv_heads, ceil(num_blocks * block_size / 128), 128]
"""

from __future__ import annotations

from typing import Optional, Tuple

import chex
import flax
import jax.numpy as jnp

from paged_jax.config import CacheConfig
from paged_jax.layer_stack import LayerStack
from pallas_kernels import backends
from pallas_kernels import scale_rows as rows_layout


@flax.struct.dataclass
class KVPages:
  """K/V pages of every layer, one array per layer.

  Attributes:
    k: LayerStack of num_layers keys [num_kv_heads, num_blocks, block_size, head_dim]
      (indexes like [num_layers, num_kv_heads, num_blocks, block_size, head_dim]).
    v: same, values.
    k_scale: LayerStack of f32[num_kv_heads, num_blocks, block_size] per-token,
      per-head key scales for int8 / fp8 pages (or the same as scale rows f32[num_kv_heads,
      ceil(num_blocks * block_size / 128), 128], `scale_rows`); None for float pages.
    v_scale: same for values.
  """
  k: LayerStack
  v: LayerStack
  k_scale: Optional[LayerStack] = None
  v_scale: Optional[LayerStack] = None

  @classmethod
  def from_stacked(cls, k, v, k_scale=None, v_scale=None) -> "KVPages":
    """Pages from stacked `[num_layers, ...]` arrays (split per layer: a copy)."""
    split = lambda x: None if x is None else LayerStack.from_stacked(x)
    return cls(k=split(k), v=split(v), k_scale=split(k_scale), v_scale=split(v_scale))

  def map_layers(self, fn) -> "KVPages":
    """`fn(x)` on every per-layer array (pages and scales); None stays None."""
    apply = lambda s: None if s is None else LayerStack(tuple(fn(x) for x in s.layers))
    return KVPages(k=apply(self.k), v=apply(self.v), k_scale=apply(self.k_scale),
                   v_scale=apply(self.v_scale))

  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k.shape[1]

  @property
  def num_blocks(self) -> int:
    return self.k.shape[2]

  @property
  def block_size(self) -> int:
    return self.k.shape[3]

  @property
  def head_dim(self) -> int:
    return self.k.shape[4]

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None

  @property
  def scale_rows(self) -> bool:
    """Scales held as scale rows (the TPU kernels' layout), read from their shape."""
    return self.quantized and rows_layout.is_rows(self.k_scale.layers[0], self.num_blocks,
                                                  self.block_size)


@flax.struct.dataclass
class HybridPages:
  """K/V pages of a hybrid-KV cache (`CacheConfig.sliding_layers`): two pools, each with
  its own block ids (`paged_jax.block_window`). The model takes it where it takes KVPages.

  Attributes:
    full: KVPages of the full-attention layers, in layer order
      ([num_full_layers, Hkv, num_blocks, bs, D]).
    sliding: KVPages of the sliding-window layers ([num_sliding_layers, Hkv,
      num_sliding_blocks, bs, D]).
    sliding_layers: static, the model layer held at each index of `sliding`.
  """
  full: KVPages
  sliding: KVPages
  sliding_layers: Tuple[int, ...] = flax.struct.field(pytree_node=False)

  def locate(self, layer: int) -> Tuple[bool, int]:
    """(in the sliding pool?, index within its pool) of model layer `layer`."""
    if layer in self.sliding_layers:
      return True, self.sliding_layers.index(layer)
    return False, layer - sum(1 for i in self.sliding_layers if i < layer)

  @property
  def num_layers(self) -> int:
    return self.full.num_layers + self.sliding.num_layers


def scale_rows_for(backend: Optional[str], where=None) -> bool:
  """Whether an engine on `backend` (an attention spelling; None: XLA) should hold its
  scales as scale rows: where it runs the TPU kernels on the target device `where`
  (default: the default device), as `write` decides its kernel."""
  return backend is not None and backends.tpu_key(backend, where) is not None


def init(cache_config: CacheConfig, *, scale_rows: bool = False) -> KVPages:
  """Zero-filled pages shaped by `cache_config` (scales too, when quantized; as scale rows
  when `scale_rows`, see `scale_rows_for`). With hybrid KV: the main pool's, i.e. the
  full-attention layers' (`init_sliding` the others')."""
  if not isinstance(cache_config, CacheConfig):
    raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
  c = cache_config.full_pool() if cache_config.hybrid else cache_config
  shape = (c.num_kv_heads, c.num_blocks, c.block_size, c.head_dim)
  dtype = jnp.dtype(c.dtype)
  stack = lambda shp, dt: LayerStack(tuple(jnp.zeros(shp, dt) for _ in range(c.num_layers)))
  k_scale = v_scale = None
  if c.quantized:
    scale_shape = (rows_layout.rows_shape(*shape[:-1]) if scale_rows else shape[:-1])
    k_scale = stack(scale_shape, jnp.float32)
    v_scale = stack(scale_shape, jnp.float32)
  return KVPages(k=stack(shape, dtype), v=stack(shape, dtype), k_scale=k_scale,
                 v_scale=v_scale)


def init_sliding(cache_config: CacheConfig, *, scale_rows: bool = False) -> KVPages:
  """Zero-filled pages of the sliding-window layers' pool (hybrid KV only)."""
  if not cache_config.hybrid:
    raise ValueError("init_sliding needs a hybrid-KV CacheConfig (sliding_layers set)")
  return init(cache_config.sliding_pool(), scale_rows=scale_rows)


def check_pages(pages: KVPages) -> None:
  """Pages built as `init` builds them: K and V LayerStacks of equal per-layer shapes and
  dtypes `[num_kv_heads, num_blocks, block_size, head_dim]`, and for quantized pages both
  scales, f32 `[num_kv_heads, num_blocks, block_size]` per layer or all as scale rows
  `[num_kv_heads, ceil(num_blocks * block_size / 128), 128]` (chex: static, so inside jit
  this runs once at trace time)."""
  for name in ("k", "v"):
    if not isinstance(getattr(pages, name), LayerStack):
      raise TypeError(f"KVPages.{name} must be a LayerStack (one array per layer), got "
                      f"{type(getattr(pages, name)).__name__}; build pages with "
                      f"kv_cache.init or KVPages.from_stacked")
  chex.assert_rank(pages.k.layers, 4, custom_message="KVPages.k layers")
  chex.assert_trees_all_equal_shapes_and_dtypes(pages.k, pages.v,
                                                custom_message="KVPages.k vs KVPages.v")
  if (pages.k_scale is None) != (pages.v_scale is None):
    raise TypeError("KVPages: k_scale and v_scale must both be set (int8 / fp8 pages) or "
                    "both be None")
  if pages.k_scale is not None:
    scales = list(pages.k_scale.layers) + list(pages.v_scale.layers)
    blocks = pages.k.layers[0].shape[:-1]
    chex.assert_shape(scales, rows_layout.rows_shape(*blocks) if pages.scale_rows else blocks,
                      custom_message="KVPages scales [num_kv_heads, num_blocks, block_size] "
                      "(or all scale rows [num_kv_heads, ceil(num_blocks * block_size / 128),"
                      " 128])")
    chex.assert_type(scales, jnp.float32, custom_message="KVPages scales")
    chex.assert_equal(len(scales), 2 * pages.num_layers, custom_message="KVPages scale layers")
