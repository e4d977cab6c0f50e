"""The one backend table (pallas_kernels/backends.py): spellings, the "auto" choice by the
target device, knob routing, and the `backend=` / `gpu_backend=` arguments.

Runs on every jax (no kernel is interpreted here except the Triton one, which both venvs
run); the Mosaic kernels themselves are tested in mosaic_*_test.py.
"""

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import backends, checks, targets
from paged_jax import attention

LLAMA = checks.AttentionShapes(rows=4, num_q_heads=32, num_kv_heads=8, head_dim=128,
                               num_blocks=64, block_size=64, num_seqs=4, pages_per_seq=16,
                               q_dtype=jnp.dtype(jnp.bfloat16),
                               page_dtype=jnp.dtype(jnp.bfloat16), quantized=False)


@dataclasses.dataclass
class FakeDevice:
  """A device as targets.py sees one (a jax Device or an abstract mesh's device)."""
  platform: str = "gpu"
  device_kind: str = "NVIDIA H200"
  compute_capability: str = ""


H200, A100, B200 = FakeDevice(), FakeDevice(device_kind="A100", compute_capability="8.0"), \
    FakeDevice(device_kind="B200", compute_capability="10.0")
CPU, TPU = FakeDevice("cpu", "cpu"), FakeDevice("tpu", "TPU v5 lite")


@pytest.mark.parametrize("device,shapes,tuning,want", [
    (H200, {}, (), "mosaic_gpu"),
    (H200, dict(block_size=8), (), "triton"),                 # pages below 16 tokens
    (H200, dict(head_dim=96), (), "triton"),
    (H200, dict(q_dtype=jnp.dtype(jnp.float32), page_dtype=jnp.dtype(jnp.float32)), (),
     "triton"),
    (H200, dict(page_dtype=jnp.dtype(jnp.int8), quantized=True), (), "triton"),
    (H200, {}, ("tile_tokens",), "triton"),                   # a Triton knob pins Triton
    (H200, {}, ("num_splits", "tile_kv"), "mosaic_gpu"),
    (A100, {}, (), "triton"),                                 # no wgmma
    (B200, {}, (), "triton"),                                 # Blackwell: no wgmma either
    (CPU, {}, (), "triton"),                                  # interpret mode
    (TPU, {}, (), "tpu"),
])
def test_auto_family_by_target_device(device, shapes, tuning, want):
  key, why = backends.resolve("pallas", "decode", LLAMA._replace(**shapes), tuning,
                              where=device)
  assert key == backends.Backend("pallas", want, False), why


def test_ragged_auto_choice_uses_ragged_knobs():
  pick = lambda knob: backends.resolve("pallas", "ragged", LLAMA, (knob,), H200)[0].family
  assert pick("q_per_tile") == "mosaic_gpu"     # Mosaic's ragged kernel takes it
  assert pick("kv_splits") == "triton"


@pytest.mark.parametrize("device,want", [(H200, "pallas"), (TPU, "pallas:tpu"),
                                         (CPU, None)])
def test_auto_implementation_by_target_device(device, want):
  got = attention.resolve_backend("auto", where=device)
  assert got == (want or backends.resolve_implementation("auto", CPU).spelling)
  assert got in attention.BACKENDS and got != "auto"


def test_auto_follows_an_abstract_mesh_and_a_sharding():
  """Never the host alone: a deviceless compile's abstract mesh, or the sharding given."""
  from pallas_kernels.deviceless import target   # pylint: disable=g-import-not-at-top
  if target.unavailable_reason():
    pytest.skip(target.unavailable_reason())
  h200 = target.sm90_device()
  with target.gpu_target_context():
    assert attention.resolve_backend("auto") == "pallas"
    assert targets.compute_capability() == (9, 0)
  sharding = target.abstract((4,), jnp.float32).sharding
  assert attention.resolve_backend("auto", where=sharding) == "pallas"
  assert attention.resolve_backend("auto", where=h200) == "pallas"


def test_spellings_parse_and_round_trip():
  for spelling in attention.BACKENDS:
    assert backends.parse(spelling).spelling == spelling
  for spelling in ("pallas:tpu", "pallas_interpret:tpu", "pallas_interpret:mosaic_gpu"):
    assert spelling in attention.BACKENDS
  with pytest.raises(ValueError, match="tpu_please") as e:
    backends.parse("tpu_please")
  assert "\n" not in str(e.value) and "pallas:triton" in str(e.value)


def test_table_knobs_are_the_kernels_tuning_configs():
  """Each table entry's knob names are the fields of its op's TuningConfig."""
  for key, kernels in backends.TABLE.items():
    if key.family in (None, "tpu"):
      continue
    for op in ("decode", "ragged"):
      module = importlib.import_module(getattr(kernels, op).partition(":")[0])
      fields = {f.name for f in dataclasses.fields(module.TuningConfig)}
      assert set(kernels.knobs(op)) == fields, (key, op)


def test_tpu_entries_say_they_are_not_here_yet():
  q = jnp.zeros((1, 4, 64), jnp.bfloat16)
  pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
  args = (q, pages, pages, jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32))
  try:
    importlib.import_module("pallas_kernels.tpu.paged_attention")
    pytest.skip("the TPU kernels are here")
  except ImportError:
    pass
  with pytest.raises(NotImplementedError, match="pallas_kernels.tpu"):
    pallas_kernels.paged_attention(*args, backend="tpu", interpret=True)


def test_bad_gpu_backend_is_one_line_value_error():
  q = jnp.zeros((1, 4, 64), jnp.bfloat16)
  pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
  tables, lengths = jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32)
  for fn, args in ((pallas_kernels.paged_attention, (q, pages, pages, tables, lengths)),
                   (pallas_kernels.ragged_paged_attention,
                    (q, pages, pages, tables, lengths, jnp.array([0, 1], jnp.int32), 1))):
    for kw, name in ((dict(gpu_backend="cuda"), "gpu_backend"), (dict(backend="cuda"),
                                                                  "backend")):
      with pytest.raises(ValueError) as e:
        fn(*args, **kw)
      msg = str(e.value)
      assert "\n" not in msg and name in msg
      assert all(b in msg for b in ("auto", "triton", "mosaic_gpu"))
    with pytest.raises(ValueError, match="disagree"):
      fn(*args, backend="triton", gpu_backend="mosaic_gpu")


def test_device_kind_of_abstract_targets():
  assert targets.compute_capability(FakeDevice()) == (9, 0)
  assert targets.compute_capability(FakeDevice(device_kind="NVIDIA A100-SXM4-80GB")) is None
  assert targets.compute_capability(FakeDevice(compute_capability="8.0")) == (8, 0)
  assert targets.compute_capability(CPU) is None
  assert targets.platform(FakeDevice("cuda")) == "gpu" and targets.platform(TPU) == "tpu"


def test_mosaic_rejects_triton_knobs_and_scales():
  q = jnp.zeros((1, 4, 64), jnp.bfloat16)
  pages = jnp.zeros((2, 4, 16, 64), jnp.bfloat16)
  args = (q, pages, pages, jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32))
  with pytest.raises(ValueError, match="tile_tokens"):
    pallas_kernels.paged_attention(*args, gpu_backend="mosaic_gpu", tile_tokens=32)
  scales = jnp.ones((2, 4, 16), jnp.float32)
  with pytest.raises(ValueError, match="dtypes"):  # bf16 pages with scales: not int8/fp8
    pallas_kernels.paged_attention(*args, backend="mosaic_gpu", k_scales=scales,
                                   v_scales=scales)
  ragged = (*args[:4], jnp.ones((1,), jnp.int32), jnp.array([0, 1], jnp.int32), 1)
  with pytest.raises(ValueError, match="scales"):
    pallas_kernels.ragged_paged_attention(*ragged, gpu_backend="mosaic_gpu",
                                          k_scales=scales, v_scales=scales)
  with pytest.raises(ValueError, match="kv_per_tile"):
    pallas_kernels.ragged_paged_attention(*ragged, backend="mosaic_gpu", kv_per_tile=32)


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
  assert ("pallas_kernels.paged_attention: backend=pallas_interpret -> "
          "pallas_interpret:triton") in caplog.text
