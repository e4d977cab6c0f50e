"""`gpu_backend` dispatch of the public kernels: Triton or Mosaic GPU.

  paged_attention(..., gpu_backend="auto" | "triton" | "mosaic_gpu", **tuning)
  ragged_paged_attention(..., gpu_backend=..., **tuning)

"auto" picks Mosaic GPU when the target is a Hopper GPU (compute capability 9.x: the kernel
uses wgmma, which sm_100 does not have) AND `mosaic_paged_attention.supported_reason` accepts
the shape AND no Triton-only tuning knob was passed; otherwise Triton. On a CPU (no GPU
target) "auto" is Triton, so `interpret=True` with "auto" runs the Triton interpreter on
every jax; `gpu_backend="mosaic_gpu", interpret=True` runs the Mosaic kernel under GPU
interpret mode (jax >= 0.11.2). The target is the first device of the default backend, or
the device kind of an abstract mesh (deviceless compiles, see compile_target.py).

The ragged (prefill + decode) entry dispatches the same way, to
mosaic_ragged_paged_attention.py or the Triton ragged kernel.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import Optional, Tuple

import jax

from pallas_kernels.mosaic_gpu import paged_attention as _mosaic_decode
from pallas_kernels.mosaic_gpu import ragged_paged_attention as _mosaic_ragged

# By module path: the package rebinds these names to the dispatching functions.
_triton_decode_module = importlib.import_module("pallas_kernels.triton.paged_attention")
_triton_ragged_module = importlib.import_module("pallas_kernels.triton.ragged_paged_attention")

GPU_BACKENDS = ("auto", "triton", "mosaic_gpu")
_log = logging.getLogger("pallas_kernels")
_logged = set()
MOSAIC_DECODE_KNOBS = ("num_splits", "tile_kv", "num_stages")
MOSAIC_RAGGED_KNOBS = ("q_per_tile", "num_splits", "tile_kv", "num_stages")
# Hopper device kinds by name, for targets that only carry a kind (abstract devices).
_SM90_KIND = re.compile(r"\b(GH200|H100|H200|H800|H20)\b")


def check_gpu_backend(gpu_backend) -> str:
  if gpu_backend not in GPU_BACKENDS:
    raise ValueError(f"gpu_backend must be one of {GPU_BACKENDS}, got {gpu_backend!r}")
  return gpu_backend


def compute_capability(device=None) -> Optional[Tuple[int, int]]:
  """(major, minor) of a CUDA device (or of the abstract mesh's device kind), else None."""
  if device is None:
    device = _abstract_target() or _default_device()
  if device is None or getattr(device, "platform", "gpu") not in ("gpu", "cuda"):
    return None
  cc = getattr(device, "compute_capability", None)
  if cc:
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)
  return (9, 0) if _SM90_KIND.search(getattr(device, "device_kind", "") or "") else None


def _default_device():
  try:
    return jax.devices()[0]
  except RuntimeError:  # pragma: no cover - no backend at all
    return None


def _abstract_target():
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get_mesh() if get_mesh is not None else None
  device = getattr(mesh, "abstract_device", None) if mesh is not None else None
  return device if getattr(device, "device_kind", None) else None


def choose_decode_backend(gpu_backend, *, num_q_heads, num_kv_heads, head_dim, block_size,
                          q_dtype, page_dtype, quantized=False, tuning=(),
                          capability="default",
                          mosaic_knobs=MOSAIC_DECODE_KNOBS) -> Tuple[str, str]:
  """("triton" | "mosaic_gpu", why) for a decode (or, with the ragged kernel's
  `mosaic_knobs`, ragged) call. `capability` (major, minor) or None overrides the
  detected target (tests)."""
  check_gpu_backend(gpu_backend)
  if gpu_backend != "auto":
    return gpu_backend, "requested"
  cc = compute_capability() if capability == "default" else capability
  if cc is None or cc[0] != 9:
    return "triton", f"target compute capability {cc} is not sm_90"
  if quantized:  # the Mosaic decode kernel takes them, but only when asked for
    return "triton", "int8 / fp8 pages (Mosaic GPU: only with gpu_backend='mosaic_gpu')"
  foreign = sorted(set(tuning) - set(mosaic_knobs))
  if foreign:
    return "triton", f"Triton tuning knobs {foreign} given"
  why = _mosaic_decode.supported_reason(num_q_heads, num_kv_heads, head_dim, block_size,
                                        q_dtype, page_dtype)
  if why is not None:
    return "triton", f"Mosaic kernel does not support {why}"
  return "mosaic_gpu", "sm_90 target and supported shape"


def _log_choice(entry, requested, backend, why):
  """One INFO line per distinct choice (at trace time: the engine's start-up compile)."""
  key = (entry, requested, backend, why)
  if key not in _logged:
    _logged.add(key)
    _log.info("pallas_kernels.%s: gpu_backend=%s -> %s (%s)", entry, requested, backend, why)


def _check_mosaic_knobs(tuning, knobs):
  foreign = sorted(set(tuning) - set(knobs))
  if foreign:
    raise ValueError(f"tuning knobs {foreign} are Triton's; gpu_backend='mosaic_gpu' takes "
                     f"{knobs}")


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                    interpret=False, gpu_backend="auto", **tuning):
  """Decode attention over a paged KV cache on the chosen GPU backend.

  Arguments and result as `pallas_kernels.paged_attention.paged_attention` (Triton) and
  `mosaic_paged_attention.paged_attention` (Mosaic GPU); `tuning` holds the chosen
  kernel's keyword-only knobs (Triton: num_splits, tile_tokens, num_warps, num_stages;
  Mosaic GPU: num_splits, tile_kv, num_stages).
  gpu_backend: "auto" (module docstring), "triton" or "mosaic_gpu".
  """
  num_kv_heads, _, block_size, _ = k_pages.shape
  backend, why = choose_decode_backend(
      gpu_backend, num_q_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim=q.shape[-1],
      block_size=block_size, q_dtype=q.dtype, page_dtype=k_pages.dtype,
      quantized=k_scales is not None or v_scales is not None, tuning=tuning)
  _log_choice("paged_attention", gpu_backend, backend, why)
  if backend == "triton":
    return _triton_decode_module.paged_attention(
        q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales,
        interpret=interpret, **tuning)
  _check_mosaic_knobs(tuning, MOSAIC_DECODE_KNOBS)
  return _mosaic_decode.paged_attention(
      q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales,
      interpret=interpret, **tuning)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           k_scales=None, v_scales=None, interpret=False, gpu_backend="auto",
                           **tuning):
  """Mixed prefill + decode attention on the chosen GPU backend.

  Arguments and result as `pallas_kernels.ragged_paged_attention.ragged_paged_attention`
  (Triton) and `mosaic_ragged_paged_attention.ragged_paged_attention` (Mosaic GPU);
  `tuning` holds the chosen kernel's knobs (Triton: q_per_tile, short_q_per_tile,
  kv_per_tile, kv_splits, num_warps, num_stages; Mosaic GPU: q_per_tile, num_splits,
  tile_kv, num_stages). gpu_backend: "auto" (module docstring), "triton", "mosaic_gpu".
  """
  num_kv_heads, _, block_size, _ = k_pages.shape
  backend, why = choose_decode_backend(
      gpu_backend, num_q_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim=q.shape[-1],
      block_size=block_size, q_dtype=q.dtype, page_dtype=k_pages.dtype,
      quantized=k_scales is not None or v_scales is not None, tuning=tuning,
      mosaic_knobs=MOSAIC_RAGGED_KNOBS)
  _log_choice("ragged_paged_attention", gpu_backend, backend, why)
  semantic = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
  if backend == "triton":
    return _triton_ragged_module.ragged_paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, k_scales=k_scales,
        v_scales=v_scales, interpret=interpret, **semantic, **tuning)
  _check_mosaic_knobs(tuning, MOSAIC_RAGGED_KNOBS)
  return _mosaic_ragged.ragged_paged_attention(
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, k_scales=k_scales,
      v_scales=v_scales, interpret=interpret, **semantic, **tuning)
