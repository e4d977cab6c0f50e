"""The jitted step's inputs and outputs, each as one int32 buffer: the host sends one
array per dispatch (`pack_inputs`) and fetches one per step (`fetch`, the engine's one
host sync); the step unpacks its inputs and packs its outputs (`packing`).

Why: JAX moves a pytree leaf by leaf, and at paper scale the per-leaf cost (~10 us to
send each of the ~30 StepInputs arrays, ~30 us to fetch each of the 17 StepOutputs
leaves on CPU) was more host time than the stand-in step's own work. Leaves travel
flattened in field order: int32 as is, other 32-bit types bitcast (exact), bools as
0/1. The layout (field, offsets, shape, dtype) is the pytree's static part, so a
different shape or dtype retraces like an unpacked leaf would (and the step's checks
see the original dtypes).

    step = packing(make_step(apply, jit=False, ...))   # (params, state, Packed) ->
    state, out = jax.jit(step)(params, state, pack_inputs(inputs))  # (state, Packed)
    outputs = fetch(out)                               # StepOutputs of numpy arrays
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from paged_jax.engine.state import StepOutputs

# (record class, ((field, start, stop, shape, dtype name), ...)): where each leaf lies
Layout = Tuple[type, Tuple[Tuple[str, int, int, Tuple[int, ...], str], ...]]


@jax.tree_util.register_pytree_node_class
class Packed:
  """A flax-struct record of arrays (StepInputs, StepOutputs) as one buffer.

  Attributes:
    buffer: i32[N] (numpy, a device array, or traced): every leaf flattened, in order.
    layout: static `Layout`: the record's class and where each field lies.

  Reading a field (`out.ok`) unpacks: traced inside jit, else on the host (one transfer
  when `buffer` is on the device).
  """

  def __init__(self, buffer, layout: Layout):
    self.buffer, self.layout = buffer, layout

  def tree_flatten(self):
    return (self.buffer,), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], layout)

  def unpack(self):
    """The record: numpy views of a host buffer, else jnp slices (inside jit)."""
    cls, fields = self.layout
    host = isinstance(self.buffer, np.ndarray)
    buf, out = self.buffer, {}
    for name, start, stop, shape, dtype in fields:
      a = buf[start:stop].reshape(shape)
      if dtype == "bool":
        a = a != 0
      elif dtype != "int32":
        a = a.view(dtype) if host else lax.bitcast_convert_type(a, jnp.dtype(dtype))
      out[name] = a
    return cls(**out)

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_") or name in ("buffer", "layout"):
      raise AttributeError(name)
    if isinstance(self.buffer, (np.ndarray, jax.core.Tracer)):
      return getattr(self.unpack(), name)
    return getattr(Packed(np.asarray(self.buffer), self.layout).unpack(), name)


def layout_of(record) -> Layout:
  """The layout of `record`'s leaves (arrays or ShapeDtypeStructs: only shapes and
  dtypes are read); ValueError for a dtype that does not fit 32 bits."""
  fields, start = [], 0
  for name in record.__dataclass_fields__:
    x = getattr(record, name)
    dtype = np.dtype(x.dtype)
    if dtype != np.bool_ and dtype.itemsize != 4:
      raise ValueError(f"{type(record).__name__}.{name} must be a 32-bit or bool array "
                       f"to pack, got {dtype}")
    size = int(np.prod(x.shape, dtype=np.int64))
    fields.append((name, start, start + size, tuple(x.shape), dtype.name))
    start += size
  return type(record), tuple(fields)


def _flat(x):
  if x.dtype == jnp.bool_:
    return x.reshape(-1).astype(jnp.int32)
  if x.dtype == jnp.int32:
    return x.reshape(-1)
  return lax.bitcast_convert_type(x, jnp.int32).reshape(-1)


def pack(record) -> Packed:
  """Traced (inside jit): `record`'s leaves as one i32 buffer."""
  leaves = [jnp.asarray(getattr(record, n)) for n in record.__dataclass_fields__]
  return Packed(jnp.concatenate([_flat(x) for x in leaves]), layout_of(record))


_HOST_LAYOUTS = {}   # (class, leaf shapes and dtypes) -> Layout: built once per shape


def pack_inputs(inputs):
  """Host: a record of numpy arrays (the engine's StepInputs) as a numpy `Packed`; a
  record holding anything else (device arrays, ShapeDtypeStructs) comes back as it is."""
  leaves = [getattr(inputs, n) for n in inputs.__dataclass_fields__]
  if not all(type(x) is np.ndarray for x in leaves):
    return inputs
  key = (type(inputs), *[(x.shape, x.dtype) for x in leaves])
  layout = _HOST_LAYOUTS.get(key)
  if layout is None:
    layout = _HOST_LAYOUTS[key] = layout_of(inputs)
  flat = [x.reshape(-1) if f[4] == "int32" else x.reshape(-1).astype(np.int32)
          if f[4] == "bool" else x.reshape(-1).view(np.int32) for x, f in zip(leaves, layout[1])]
  return Packed(np.concatenate(flat), layout)


def abstract_inputs(inputs) -> Packed:
  """A `Packed` of ShapeDtypeStructs for a record of ShapeDtypeStructs (compiling
  ahead of time the executable that `pack_inputs`' buffers run on)."""
  layout = layout_of(inputs)
  return Packed(jax.ShapeDtypeStruct((layout[1][-1][2],), jnp.int32), layout)


def packing(step: Callable[..., Any]) -> Callable[..., Any]:
  """`step` (params, state, StepInputs, **static) -> (state, StepOutputs) as one that
  also takes its inputs `Packed` and returns its outputs `Packed`."""
  @functools.wraps(step)
  def packed(params, state, inputs, **static):
    if isinstance(inputs, Packed):
      inputs = inputs.unpack()
    state, out = step(params, state, inputs, **static)
    return state, pack(out)
  return packed


def fetch(out) -> StepOutputs:
  """The one host sync of a step: `out` (Packed, or the StepOutputs of a step without
  packing) on the host as a StepOutputs of numpy arrays."""
  host = jax.device_get(out)   # looked up here: tests count and fault this call
  return host.unpack() if isinstance(host, Packed) else host
