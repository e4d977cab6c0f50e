"""Paged attention for XLA:CPU as FFI custom calls (C++, `cpu_paged_attention.cc`).

    out = custom_calls.decode_attention(q, k_pages, v_pages, block_tables, lengths)
    out = custom_calls.ragged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                                         cu_q_lens, num_seqs)

Same signatures and semantics as `xla_attention` (and `reference`, the oracle). The
plain-jnp path has XLA write each row's gathered K and V out before its dot and reduce
read them back; here the block-table walk is fused into an online softmax, so each K/V
byte is read once, straight from its page (measured 3-10x faster on the engine's decode
shapes, BENCHMARKS.md). The kernels take f32 q and f32 pages; anything else (bf16 / f16,
int8 / fp8 pages with scales) goes to `xla_attention`, as it does when the library cannot
be built (`unavailable_reason()` says why; the fallback is logged once).

The library is compiled on first use with the system C++ compiler (`$CXX`, else g++) for
this machine's CPU against the installed jaxlib's XLA FFI headers, and cached under
`$PAGED_JAX_CACHE` (default ~/.cache/paged_jax) keyed by source, jaxlib version and CPU;
a build writes a temporary file and renames it, so concurrent processes agree.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import checks
from pallas_kernels.cpu import xla_attention

_SOURCE = pathlib.Path(__file__).with_name("custom_calls.cc")
_TARGETS = {"decode": ("paged_jax_cpu_decode", "PagedJaxCpuDecode"),
            "ragged": ("paged_jax_cpu_ragged", "PagedJaxCpuRagged")}
# Vectorized, reassociated dot products; no -ffinite-math-only (the kernel starts its
# running max at -inf).
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-fopenmp", "-shared", "-fPIC",
          "-std=c++17", "-w")


def _cpu_signature() -> str:
  """The CPU's model and feature flags (a -march=native build runs only where they match)."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return platform.processor() or platform.machine()
  keep = [l for l in lines if l.startswith(("model name", "flags"))][:2]
  return "\n".join(keep) or platform.machine()


def _library_path() -> pathlib.Path:
  import jaxlib  # pylint: disable=g-import-not-at-top
  key = hashlib.sha256("\0".join([_SOURCE.read_text(), jax.ffi.include_dir(), jaxlib.__version__,
                                  " ".join(_FLAGS), _cpu_signature()]).encode()).hexdigest()[:16]
  return cache_root() / "cpu_kernels" / f"cpu_paged_attention-{key}.so"


def cache_root() -> pathlib.Path:
  """$PAGED_JAX_CACHE, else $XDG_CACHE_HOME/paged_jax or ~/.cache/paged_jax when writable
  (a sandboxed test may have no writable home), else the temp dir."""
  if os.environ.get("PAGED_JAX_CACHE"):
    return pathlib.Path(os.environ["PAGED_JAX_CACHE"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  if os.access(base, os.W_OK) or (not os.path.exists(base)
                                  and os.access(os.path.dirname(base) or ".", os.W_OK)):
    return pathlib.Path(base) / "paged_jax"
  return pathlib.Path(tempfile.gettempdir()) / "paged_jax-cache"


def _build(path: pathlib.Path) -> None:
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not cxx:
    raise RuntimeError("no C++ compiler found (set CXX or install g++)")
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
  os.close(fd)
  try:
    cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode:
      first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
      raise RuntimeError(f"{cxx} failed: {first}")
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def _load():
  """Builds (once per machine) and registers the kernels; (ok, reason)."""
  try:
    path = _library_path()
    if not path.exists():
      _build(path)
    lib = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in _TARGETS.values():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
  except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
    return False, f"the XLA:CPU paged-attention library is unavailable: {e}"
  return True, None


def unavailable_reason() -> Optional[str]:
  """None when the kernels are built and registered, else why not (one line)."""
  return _load()[1]


def supported(q, k_pages, k_scales=None) -> bool:
  """Whether the custom calls take these operands (else `xla_attention` runs)."""
  return (q.dtype == jnp.float32 and k_pages.dtype == jnp.float32 and k_scales is None
          and unavailable_reason() is None)


@functools.lru_cache(maxsize=None)
def _log_fallback(why: str) -> None:
  logging.getLogger(__name__).warning("paged attention on CPU falls back to xla: %s", why)


def _fallback_reason(q, k_pages, k_scales) -> str:
  return unavailable_reason() or (
      f"the custom call takes f32 q and f32 pages without scales, got q {q.dtype}, pages "
      f"{k_pages.dtype}{' with scales' if k_scales is not None else ''}")


def _attrs(sem: checks.Semantics) -> dict:
  return dict(scale=np.float32(sem.sm_scale),
              soft_cap=np.float32(0.0 if sem.soft_cap is None else sem.soft_cap),
              window=np.int32(0 if sem.sliding_window is None else sem.sliding_window))


def decode_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                     soft_cap=None, sliding_window=None, k_scales=None, v_scales=None):
  """One query per sequence at position lengths[b] - 1: q [B, Hq, D] -> [B, Hq, D].

  k_pages / v_pages [Hkv, NB, bs, D], block_tables i32[B, W], lengths i32[B] (0: zeros).
  Bad shapes or dtypes: a one-line ValueError (`checks.check_decode`) before any tracing.
  """
  checks.check_decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=q.shape[-1])
  if not supported(q, k_pages, k_scales):
    _log_fallback(_fallback_reason(q, k_pages, k_scales))
    return xla_attention.decode_attention(
        q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)
  call = jax.ffi.ffi_call(_TARGETS["decode"][0], jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q, k_pages, v_pages.astype(jnp.float32), block_tables.astype(jnp.int32),
              lengths.astype(jnp.int32), **_attrs(sem))


def ragged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *,
                     sm_scale=None, soft_cap=None, sliding_window=None, k_scales=None,
                     v_scales=None):
  """Mixed prefill + decode attention: q [T, Hq, D] -> [T, Hq, D] (causal; sequence i's
  new queries are q[cu_q_lens[i]:cu_q_lens[i+1]] at positions kv_lens[i] - q_len_i ..
  kv_lens[i] - 1; padding rows return zeros). Bad shapes or dtypes: a one-line ValueError
  (`checks.check_ragged`) before any tracing."""
  checks.check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                      k_scales, v_scales)
  sem = checks.check_semantics(sm_scale, soft_cap, sliding_window, head_dim=q.shape[-1])
  if not supported(q, k_pages, k_scales):
    _log_fallback(_fallback_reason(q, k_pages, k_scales))
    return xla_attention.ragged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
        v_scales=v_scales)
  call = jax.ffi.ffi_call(_TARGETS["ragged"][0], jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q, k_pages, v_pages.astype(jnp.float32), block_tables.astype(jnp.int32),
              kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
              jnp.asarray(num_seqs, jnp.int32).reshape(()), **_attrs(sem))
