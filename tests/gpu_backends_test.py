"""`gpu_backend` dispatch (pallas_kernels/backends.py): choice logic and argument checks.

Runs on every jax (no kernel is interpreted here except the Triton one, which both venvs
run); the Mosaic kernel itself is tested in mosaic_paged_attention_test.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import backends

LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=64,
             q_dtype=jnp.bfloat16, page_dtype=jnp.bfloat16)


@pytest.mark.parametrize("capability,kw,want", [
    ((9, 0), {}, "mosaic_gpu"),
    ((9, 0), dict(block_size=8), "triton"),          # pages below 16 tokens
    ((9, 0), dict(head_dim=96), "triton"),
    ((9, 0), dict(q_dtype=jnp.float32, page_dtype=jnp.float32), "triton"),
    ((9, 0), dict(page_dtype=jnp.int8, quantized=True), "triton"),
    ((9, 0), dict(tuning=("tile_tokens",)), "triton"),  # a Triton knob pins Triton
    ((9, 0), dict(tuning=("num_splits", "tile_kv")), "mosaic_gpu"),
    ((8, 0), {}, "triton"),                          # A100: no wgmma
    ((10, 0), {}, "triton"),                         # Blackwell: no wgmma either
    (None, {}, "triton"),                            # CPU
])
def test_auto_choice(capability, kw, want):
  args = dict(LLAMA, **kw)
  got, why = backends.choose_decode_backend("auto", capability=capability, **args)
  assert got == want, why


@pytest.mark.parametrize("explicit", ["triton", "mosaic_gpu"])
def test_explicit_choice_is_kept(explicit):
  assert backends.choose_decode_backend(explicit, capability=None, **LLAMA)[0] == explicit


def test_bad_gpu_backend_is_one_line_value_error():
  q = jnp.zeros((1, 4, 64), jnp.bfloat16)
  pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
  tables, lengths = jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32)
  for fn, args in ((pallas_kernels.paged_attention, (q, pages, pages, tables, lengths)),
                   (pallas_kernels.ragged_paged_attention,
                    (q, pages, pages, tables, lengths, jnp.array([0, 1], jnp.int32), 1))):
    with pytest.raises(ValueError) as e:
      fn(*args, gpu_backend="cuda")
    msg = str(e.value)
    assert "\n" not in msg and "gpu_backend" in msg
    assert all(b in msg for b in ("auto", "triton", "mosaic_gpu"))


def test_device_kind_of_abstract_targets():
  class Fake:
    platform = "cuda"
    device_kind = "NVIDIA H200"
  assert backends.compute_capability(Fake()) == (9, 0)
  Fake.device_kind = "NVIDIA A100-SXM4-80GB"
  assert backends.compute_capability(Fake()) is None
  Fake.compute_capability = "8.0"
  assert backends.compute_capability(Fake()) == (8, 0)


def test_mosaic_rejects_triton_knobs_and_scales():
  q = jnp.zeros((1, 4, 64), jnp.bfloat16)
  pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
  args = (q, pages, pages, jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match="tile_tokens"):
    pallas_kernels.paged_attention(*args, gpu_backend="mosaic_gpu", tile_tokens=32)
  scales = jnp.ones((2, 4, 16), jnp.float32)
  with pytest.raises(ValueError, match="dtypes"):  # bf16 pages with scales: not int8/fp8
    pallas_kernels.paged_attention(*args, gpu_backend="mosaic_gpu", k_scales=scales,
                                   v_scales=scales)
  with pytest.raises(ValueError, match="scales"):
    pallas_kernels.ragged_paged_attention(*args[:4], jnp.ones((1,), jnp.int32),
                                          jnp.array([0, 1], jnp.int32), 1,
                                          gpu_backend="mosaic_gpu", k_scales=scales,
                                          v_scales=scales)
  with pytest.raises(ValueError, match="kv_per_tile"):
    pallas_kernels.ragged_paged_attention(*args[:4], jnp.ones((1,), jnp.int32),
                                          jnp.array([0, 1], jnp.int32), 1,
                                          gpu_backend="mosaic_gpu", kv_per_tile=32)


def test_ragged_auto_choice_uses_ragged_knobs():
  got, _ = backends.choose_decode_backend("auto", capability=(9, 0), tuning=("q_per_tile",),
                                          mosaic_knobs=backends.MOSAIC_RAGGED_KNOBS, **LLAMA)
  assert got == "mosaic_gpu"
  got, _ = backends.choose_decode_backend("auto", capability=(9, 0), tuning=("kv_splits",),
                                          mosaic_knobs=backends.MOSAIC_RAGGED_KNOBS, **LLAMA)
  assert got == "triton"


def test_auto_on_cpu_runs_triton_interpreter_with_its_knobs(caplog):
  """On a CPU host "auto" is Triton: its knobs pass through unchanged; the choice is
  logged once."""
  caplog.set_level("INFO", logger="pallas_kernels")
  backends._logged.clear()  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, 4, 32)), jnp.float32)
  pages = jnp.asarray(rng.normal(size=(2, 6, 8, 32)), jnp.float32)
  tables = jnp.asarray(rng.permutation(6)[:6].reshape(2, 3), jnp.int32)
  lengths = jnp.array([5, 20], jnp.int32)
  out = pallas_kernels.paged_attention(q, pages, pages, tables, lengths, interpret=True,
                                       num_splits=2, tile_tokens=16)
  want = pallas_kernels.paged_attention_reference(q, pages, pages, tables, lengths)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  assert "pallas_kernels.paged_attention: gpu_backend=auto -> triton" in caplog.text
