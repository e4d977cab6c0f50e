"""packing.py: StepInputs / StepOutputs as one int32 buffer, through jit and back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine import packing
from paged_jax.engine.inputs import empty_inputs
from paged_jax.engine.state import StepInputs, StepOutputs


def random_inputs(seed: int) -> StepInputs:
  """Every StepInputs leaf filled with random values of its dtype (floats include
  -0.0, inf and nan: bitcasting must keep their bits)."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, v in empty_inputs(24, 8, 16, num_rows=4).items():
    if v.dtype == np.bool_:
      out[k] = rng.random(v.shape) < 0.5
    elif v.dtype == np.float32:
      x = rng.standard_normal(v.shape).astype(np.float32)
      x.reshape(-1)[:3] = [-0.0, np.inf, np.nan]
      out[k] = x
    else:
      info = np.iinfo(v.dtype)
      out[k] = rng.integers(info.min, info.max, v.shape, dtype=v.dtype, endpoint=True)
  return StepInputs(**out)


def assert_same_bits(want, got):
  for name in want.__dataclass_fields__:
    w, g = np.asarray(getattr(want, name)), np.asarray(getattr(got, name))
    assert (w.dtype, w.shape) == (g.dtype, g.shape), name
    np.testing.assert_array_equal(w.view(np.uint8), g.view(np.uint8), err_msg=name)


def test_inputs_round_trip_on_the_host_and_through_jit_bit_for_bit():
  inp = random_inputs(0)
  packed = packing.pack_inputs(inp)
  assert packed.buffer.dtype == np.int32 and packed.buffer.ndim == 1
  assert_same_bits(inp, packed.unpack())
  # Inside jit the step unpacks the inputs and packs what it returns.
  echo = jax.jit(lambda p: packing.pack(p.unpack()))
  out = echo(packed)
  assert isinstance(out, packing.Packed) and isinstance(out.buffer, jax.Array)
  assert_same_bits(inp, packing.fetch(out))
  np.testing.assert_array_equal(out.tokens, inp.tokens)   # a field read on a device buffer


def test_fetch_is_one_transfer_and_takes_unpacked_outputs_too(monkeypatch):
  fields = {n: jnp.full((3,), i, jnp.int32)
            for i, n in enumerate(StepOutputs.__dataclass_fields__)}
  fields.update(ok=jnp.ones((), jnp.bool_), topk_logprobs=jnp.full((3, 2), -1.5, jnp.float32))
  outs = StepOutputs(**fields)
  packed = jax.jit(packing.pack)(outs)
  leaves = []
  real = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: leaves.append(
      len(jax.tree_util.tree_leaves(x))) or real(x))
  got = packing.fetch(packed)
  assert leaves == [1]
  assert_same_bits(jax.device_get(outs), got)
  assert_same_bits(jax.device_get(outs), packing.fetch(outs))   # a step without packing


def test_a_leaf_that_does_not_fit_32_bits_is_refused_and_others_pass_through():
  bad = random_inputs(1).replace(seed=np.zeros((8,), np.int64))
  with pytest.raises(ValueError, match="StepInputs.seed must be a 32-bit or bool array"):
    packing.pack_inputs(bad)
  on_device = random_inputs(2).replace(tokens=jnp.zeros((24,), jnp.int32))
  assert packing.pack_inputs(on_device) is on_device


def test_a_new_dtype_or_shape_retraces_with_the_original_dtypes():
  traced = []

  @jax.jit
  def step(p):
    inp = p.unpack()
    traced.append((inp.temperature.dtype, inp.stop_ids.shape))
    return inp.temperature.sum()

  inp = random_inputs(3)
  step(packing.pack_inputs(inp))
  step(packing.pack_inputs(inp))
  step(packing.pack_inputs(inp.replace(temperature=np.zeros((8,), np.int32))))
  step(packing.pack_inputs(inp.replace(stop_ids=np.zeros((8, 1), np.int32))))
  assert traced == [(jnp.float32, inp.stop_ids.shape), (jnp.int32, inp.stop_ids.shape),
                    (jnp.float32, (8, 1))]
