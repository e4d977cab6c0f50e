"""`LayerStack`: one array per layer that indexes like the stacked `[num_layers, ...]` array.

Why not one stacked array: a Pallas kernel (an XLA custom call) cannot take a view into a
bigger buffer, so handing layer `l` of a stacked `[L, Hkv, NB, bs, D]` pool to the attention
kernel makes XLA copy that layer's whole pool into a temp buffer (and, after the K/V write,
back). XLA's deviceless sm_90 compile of a 2-layer Llama-8B-shaped forward showed four such
512 MiB copies and ~1.09 GB of temp buffers per step (`tests/gpu_compile_model_test.py`).
With one array per layer, `stack[l]` IS the buffer the kernel reads and the K/V scatter
updates in place (when the pool is donated): no copy.

Code written against the stacked layout keeps working through the array-like surface:

    stack[l]                    layer l's array itself (no copy)
    stack[:, :, ids]            per-layer `a[:, ids]`, stacked (a copy of the selection only)
    stack.at[:, :, ids].set(x)  per-layer in-place scatter of x[l]: a new LayerStack
    stack.shape / dtype / ndim  of the stacked view: (num_layers,) + layer shape
    np.asarray(stack)           the stacked host copy
    stack.sharding, stack.addressable_shards   as the stacked array's (tests of sharded pools)

It is a pytree whose children are the per-layer arrays, so jit, donation, `tree_map` and
shardings (a LayerStack of PartitionSpecs) see one leaf per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np


def _split_index(index) -> Tuple[Any, tuple]:
  index = index if isinstance(index, tuple) else (index,)
  if not index:
    return slice(None), ()
  return index[0], tuple(index[1:])


@jax.tree_util.register_pytree_node_class
class LayerStack:
  """A tuple of per-layer arrays (same shape and dtype) seen as one `[L, ...]` array.

  Attributes:
    layers: tuple of L arrays (or ShapeDtypeStructs, PartitionSpecs: any pytree leaf).
  """

  def __init__(self, layers: Sequence[Any]):
    self.layers = tuple(layers)

  @classmethod
  def from_stacked(cls, x) -> "LayerStack":
    """Splits a stacked `[L, ...]` array into L arrays (a copy; for setup and tests)."""
    return cls(tuple(x[i] for i in range(x.shape[0])))

  # Pytree ------------------------------------------------------------------------------

  def tree_flatten(self):
    return self.layers, None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(children)

  def __repr__(self):
    return f"LayerStack({list(self.layers)!r})"

  # Array-like surface ------------------------------------------------------------------

  def __len__(self) -> int:
    return len(self.layers)

  def __iter__(self):
    return iter(self.layers)

  @property
  def shape(self) -> Tuple[int, ...]:
    return (len(self.layers),) + tuple(self.layers[0].shape)

  @property
  def dtype(self):
    return self.layers[0].dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def nbytes(self) -> int:
    return self.size * jnp.dtype(self.dtype).itemsize

  def _select(self, first) -> Tuple[Any, ...]:
    if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
      return (self.layers[first],)
    if isinstance(first, slice):
      return self.layers[first]
    raise TypeError(f"a LayerStack's layer index must be an int or a slice (each layer is "
                    f"its own array), got {type(first).__name__}")

  def __getitem__(self, index):
    first, rest = _split_index(index)
    if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
      layer = self.layers[first]
      return layer[rest] if rest else layer
    return jnp.stack([a[rest] if rest else a for a in self._select(first)])

  @property
  def at(self) -> "_AtIndexer":
    return _AtIndexer(self)

  def __array__(self, dtype=None, copy=None):
    del copy
    out = np.stack([np.asarray(a) for a in self.layers])
    return out if dtype is None else out.astype(dtype)

  def astype(self, dtype) -> "LayerStack":
    return LayerStack(tuple(a.astype(dtype) for a in self.layers))

  def is_deleted(self) -> bool:
    return all(a.is_deleted() for a in self.layers)

  @property
  def sharding(self):
    """The stacked view's sharding: a NamedSharding gains an unsplit leading layer axis."""
    s = self.layers[0].sharding
    if isinstance(s, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.spec))
    return s

  @property
  def addressable_shards(self) -> list:
    """Per device: the stacked shard `[L, ...]` (index with a leading full slice)."""
    per_layer = [sorted(a.addressable_shards, key=lambda s: s.device.id) for a in self.layers]
    return [_StackedShard(device=shards[0].device, index=(slice(None),) + tuple(shards[0].index),
                          data=jnp.stack([s.data for s in shards]))
            for shards in zip(*per_layer)]


@dataclasses.dataclass(frozen=True)
class _StackedShard:
  device: Any
  index: tuple
  data: jax.Array


class _AtIndexer:

  def __init__(self, stack: LayerStack):
    self._stack = stack

  def __getitem__(self, index) -> "_AtUpdate":
    return _AtUpdate(self._stack, index)


class _AtUpdate:
  """`stack.at[first, *rest].set(values)`: per selected layer l, `a.at[rest].set(values[i])`."""

  def __init__(self, stack: LayerStack, index):
    self._stack = stack
    self._first, self._rest = _split_index(index)

  def _apply(self, method: str, values, **kwargs) -> LayerStack:
    layers = list(self._stack.layers)
    first = self._first
    picked = ([int(first)] if isinstance(first, (int, np.integer))
              else list(range(len(layers)))[first] if isinstance(first, slice) else None)
    if picked is None:
      self._stack._select(first)  # raises the TypeError
    int_index = isinstance(first, (int, np.integer))
    if not int_index and np.ndim(values):   # one slice of `values` per picked layer
      chex.assert_axis_dimension(values, 0, len(picked),
                                 custom_message="LayerStack.at[...] values: one per layer")
    for i, l in enumerate(picked):
      vals = values if int_index or np.ndim(values) == 0 else values[i]
      ref = layers[l].at[self._rest] if self._rest else layers[l].at[...]
      layers[l] = getattr(ref, method)(vals, **kwargs)
    return LayerStack(layers)

  def set(self, values, **kwargs) -> LayerStack:
    return self._apply("set", values, **kwargs)

  def add(self, values, **kwargs) -> LayerStack:
    return self._apply("add", values, **kwargs)
