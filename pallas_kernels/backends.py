"""The one backend table: every attention implementation, keyed by (implementation, kernel
family, interpret), and the one place "auto" is decided.

  spelling                        Backend key                     ops in
  "reference"                     ("reference", None, False)      reference.py (the oracle)
  "xla"                           ("xla", None, False)            cpu/xla_attention.py
  "cpu"                           ("cpu", None, False)            cpu/custom_calls.py
  "pallas:F", "pallas_interpret:F"  ("pallas", F, interpret)      triton/, mosaic_gpu/, tpu/
    for F in "triton", "mosaic_gpu", "tpu"
  "pallas", "pallas_interpret"    ("pallas", "auto", interpret)   family chosen per call
  "auto"                          ("auto", "auto", False)         implementation chosen too

`paged_jax.attention` takes the spellings (so does the engine's `attention_backend`);
`pallas_kernels.paged_attention(..., backend=F, interpret=...)` is ("pallas", F, interpret).
Either way one call to `attend` checks the arguments (checks.py, before anything is
traced), resolves "auto" and calls the op of TABLE[key] directly: there is no second
dispatch level.

"auto" decides by the device the call runs or is compiled on (targets.py), never by the
host alone. Implementation: a GPU -> "pallas"; a TPU -> "pallas:tpu"; a CPU -> "cpu"
(the XLA:CPU custom calls) where they build, else "xla". Kernel family: on a CUDA device
of compute capability 9.x, Mosaic GPU when `mosaic_gpu.pipeline.supported_reason`
accepts the shape and no Triton-only knob was passed (int8 / fp8 pages: only when asked
for), else Triton; on a TPU "tpu"; anywhere else (a CPU: interpret mode) Triton, so
"pallas_interpret" runs the Triton interpreter on every jax. Each distinct choice is
logged once at INFO. The "tpu" entries are `pallas_kernels.tpu`'s kernels (Mosaic TPU;
"pallas_interpret:tpu" runs them in the TPU interpreter on any backend); `tpu_key` says
whether a spelling runs them on the target device (the K/V write picks its kernel by it).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Dict, NamedTuple, Optional, Tuple

from pallas_kernels import checks
from pallas_kernels import scale_rows
from pallas_kernels import targets

IMPLEMENTATIONS = ("reference", "xla", "cpu", "pallas")
FAMILIES = ("triton", "mosaic_gpu", "tpu")
KERNEL_FAMILIES = ("auto",) + FAMILIES        # pallas_kernels.paged_attention(backend=...)
GPU_BACKENDS = ("auto", "triton", "mosaic_gpu")   # its older keyword, gpu_backend=
SEMANTIC_KWARGS = ("sm_scale", "soft_cap", "sliding_window", "k_scales", "v_scales")
_log = logging.getLogger("pallas_kernels")
_logged = set()


class Backend(NamedTuple):
  """A key of the backend table (implementation and family "auto" until resolved)."""
  implementation: str
  family: Optional[str] = None
  interpret: bool = False

  @property
  def spelling(self) -> str:
    if self.implementation != "pallas":
      return self.implementation
    kind = "pallas_interpret" if self.interpret else "pallas"
    return kind if self.family == "auto" else f"{kind}:{self.family}"


SPELLINGS: Dict[str, Backend] = {"auto": Backend("auto", "auto")}
SPELLINGS.update({name: Backend(name) for name in ("reference", "xla", "cpu")})
SPELLINGS.update({b.spelling: b for b in (Backend("pallas", f, i)
                                          for i in (False, True) for f in KERNEL_FAMILIES)})
BACKENDS = tuple(SPELLINGS)


@dataclasses.dataclass(frozen=True)
class Kernels:
  """One concrete backend: its decode and ragged ops ("module:function", imported on
  first use) and the tuning knobs each takes (its TuningConfig's fields)."""
  decode: str
  ragged: str
  decode_knobs: Tuple[str, ...] = ()
  ragged_knobs: Tuple[str, ...] = ()

  def op(self, name: str):
    module, _, function = getattr(self, name).partition(":")
    try:
      return getattr(importlib.import_module(module), function)
    except ImportError as e:
      raise NotImplementedError(f"{module} is not in this tree ({e})") from None

  def knobs(self, name: str) -> Tuple[str, ...]:
    return self.decode_knobs if name == "decode" else self.ragged_knobs


_PK = "pallas_kernels"
_FAMILY_KERNELS = {
    "triton": Kernels(f"{_PK}.triton.paged_attention:paged_attention",
                      f"{_PK}.triton.ragged_paged_attention:ragged_paged_attention",
                      ("tile_tokens", "num_splits", "num_warps", "num_stages"),
                      ("q_per_tile", "short_q_per_tile", "kv_per_tile", "kv_splits",
                       "num_warps", "num_stages")),
    "mosaic_gpu": Kernels(f"{_PK}.mosaic_gpu.paged_attention:paged_attention",
                          f"{_PK}.mosaic_gpu.ragged_paged_attention:ragged_paged_attention",
                          ("num_splits", "tile_kv", "num_stages"),
                          ("q_per_tile", "num_splits", "tile_kv", "num_stages")),
    "tpu": Kernels(f"{_PK}.tpu.paged_attention:paged_attention",
                   f"{_PK}.tpu.ragged_paged_attention:ragged_paged_attention",
                   ("kv_per_tile", "seqs_per_tile", "heads_per_tile", "vmem_limit_bytes"),
                   ("kv_per_tile", "q_per_tile", "heads_per_tile", "vmem_limit_bytes")),
}
TABLE: Dict[Backend, Kernels] = {
    Backend("reference"): Kernels(f"{_PK}.reference:paged_attention_reference",
                                  f"{_PK}.reference:ragged_paged_attention_reference"),
    Backend("xla"): Kernels(f"{_PK}.cpu.xla_attention:decode_attention",
                            f"{_PK}.cpu.xla_attention:ragged_attention"),
    Backend("cpu"): Kernels(f"{_PK}.cpu.custom_calls:decode_attention",
                            f"{_PK}.cpu.custom_calls:ragged_attention"),
    **{Backend("pallas", family, interpret): kernels
       for family, kernels in _FAMILY_KERNELS.items() for interpret in (False, True)},
}


def all_knobs(op: Optional[str] = None) -> Tuple[str, ...]:
  """Every tuning knob some backend's op ("decode", "ragged", or either) takes."""
  ops = ("decode", "ragged") if op is None else (op,)
  return tuple(sorted({k for kernels in TABLE.values() for o in ops for k in kernels.knobs(o)}))


def parse(backend) -> Backend:
  """A spelling (or a Backend) -> Backend; one-line ValueError listing the spellings."""
  if isinstance(backend, Backend):
    return backend
  if backend not in SPELLINGS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  return SPELLINGS[backend]


def _cpu_implementation() -> str:
  from pallas_kernels.cpu import custom_calls  # pylint: disable=g-import-not-at-top
  return "cpu" if custom_calls.unavailable_reason() is None else "xla"


def resolve_implementation(backend, where=None) -> Backend:
  """Implementation "auto" -> by the target device's platform; anything else unchanged."""
  backend = parse(backend)
  if backend.implementation != "auto":
    return backend
  kind = targets.platform(targets.target_device(where))
  if kind == "gpu":
    return Backend("pallas", "auto")
  if kind == "tpu":
    return Backend("pallas", "tpu")
  return Backend(_cpu_implementation())


def tpu_key(backend, where=None) -> Optional[Backend]:
  """("pallas", "tpu", interpret) when `backend` runs the TPU kernels on the target device
  (a ":tpu" spelling, or "auto" / "pallas" / "pallas_interpret" deciding on a TPU), else
  None. The family needs no shapes there, so the K/V write can ask before any call."""
  key = resolve_implementation(backend, where)
  if key.implementation != "pallas":
    return None
  if key.family == "auto" and targets.platform(targets.target_device(where)) == "tpu":
    key = key._replace(family="tpu")
  return key if key.family == "tpu" else None


def _choose_family(op: str, shapes: checks.AttentionShapes, tuning, where) -> Tuple[str, str]:
  device = targets.target_device(where)
  if targets.platform(device) == "tpu":
    return "tpu", "TPU target"
  cc = targets.compute_capability(device)
  if cc is None or cc[0] != 9:
    return "triton", f"target compute capability {cc} is not sm_90"
  if shapes.quantized:  # the Mosaic kernels take them, but only when asked for
    return "triton", "int8 / fp8 pages (Mosaic GPU: only with backend='mosaic_gpu')"
  foreign = sorted(set(tuning) - set(_FAMILY_KERNELS["mosaic_gpu"].knobs(op)))
  if foreign:
    return "triton", f"Triton tuning knobs {foreign} given"
  from pallas_kernels.mosaic_gpu import pipeline  # pylint: disable=g-import-not-at-top
  why = pipeline.supported_reason(shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim,
                                  shapes.block_size, shapes.q_dtype, shapes.page_dtype)
  if why is not None:
    return "triton", f"Mosaic kernel does not support {why}"
  return "mosaic_gpu", "sm_90 target and supported shape"


def resolve(backend, op: str, shapes: checks.AttentionShapes, tuning=(), where=None
            ) -> Tuple[Backend, str]:
  """(the concrete table key, why) for one call of `op` ("decode" | "ragged")."""
  requested = parse(backend)
  key = resolve_implementation(requested, where)
  why = "requested" if key == requested else "chosen by the target device's platform"
  if key.family == "auto":
    family, why = _choose_family(op, shapes, tuning, where)
    key = key._replace(family=family)
  return key, why


def _log_choice(op, requested: Backend, key: Backend, why: str) -> None:
  """One INFO line per distinct choice (at trace time: the engine's start-up compile)."""
  entry = "paged_attention" if op == "decode" else "ragged_paged_attention"
  line = (entry, requested.spelling, key.spelling, why)
  if requested != key and line not in _logged:
    _logged.add(line)
    _log.info("pallas_kernels.%s: backend=%s -> %s (%s)", *line)


def _split_kwargs(key: Backend, op: str, kw: dict) -> dict:
  """The keyword arguments `key`'s op gets: the semantic ones, and its own tuning knobs
  (other backends' knobs are dropped for reference / xla / cpu, refused for Pallas)."""
  unknown = sorted(set(kw) - set(SEMANTIC_KWARGS) - set(all_knobs()))
  if unknown:
    raise TypeError(f"unexpected attention arguments {unknown}; semantic arguments are "
                    f"{SEMANTIC_KWARGS}, tuning knobs {all_knobs()}")
  own = TABLE[key].knobs(op)
  if key.implementation == "pallas":
    foreign = sorted(k for k in kw if k not in SEMANTIC_KWARGS and k not in own)
    if foreign:
      raise ValueError(f"tuning knobs {foreign} are not taken by {key.spelling}'s {op} "
                       f"kernel; it takes {own}")
  return {k: v for k, v in kw.items() if k in SEMANTIC_KWARGS or k in own}


def attend(op: str, backend, args: tuple, kw: dict, *, where=None):
  """Runs `op` ("decode": paged_attention's arguments; "ragged": ragged_paged_attention's)
  on `backend` (a spelling or a Backend): checks, resolves "auto", calls TABLE's op.

  kw: the semantic arguments (SEMANTIC_KWARGS) and tuning knobs. where: the device or
  sharding the call is compiled for, when the default device is not it (targets.py).
  """
  requested = parse(backend)
  scales = (kw.get("k_scales"), kw.get("v_scales"))
  shapes = (checks.check_decode if op == "decode" else checks.check_ragged)(*args, *scales)
  checks.check_semantics(kw.get("sm_scale"), kw.get("soft_cap"), kw.get("sliding_window"),
                         head_dim=shapes.head_dim)
  tuning = [k for k in kw if k not in SEMANTIC_KWARGS]
  key, why = resolve(requested, op, shapes, tuning, where)
  _log_choice(op, requested, key, why)
  kwargs = _split_kwargs(key, op, kw)
  if key.implementation == "pallas":
    kwargs["interpret"] = key.interpret
  if shapes.quantized and key.family != "tpu":   # scale rows are the TPU kernels' form
    for name in ("k_scales", "v_scales"):
      kwargs[name] = scale_rows.as_blocks(kwargs[name], shapes.num_blocks, shapes.block_size)
  return TABLE[key].op(op)(*args, **kwargs)


def _pallas_backend(backend, gpu_backend, interpret) -> Backend:
  """pallas_kernels' `backend=` (and the older `gpu_backend=`) -> ("pallas", F, interpret)."""
  if gpu_backend is not None:
    if gpu_backend not in GPU_BACKENDS:
      raise ValueError(f"gpu_backend must be one of {GPU_BACKENDS}, got {gpu_backend!r}")
    if backend not in ("auto", gpu_backend):
      raise ValueError(f"backend={backend!r} and gpu_backend={gpu_backend!r} disagree")
    backend = gpu_backend
  if backend not in KERNEL_FAMILIES:
    raise ValueError(f"backend must be one of {KERNEL_FAMILIES}, got {backend!r}")
  return Backend("pallas", backend, bool(interpret))


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, k_scales=None, v_scales=None,
                    interpret=False, backend="auto", gpu_backend=None, **tuning):
  """Decode attention over a paged KV cache with a Pallas kernel family.

  Arguments and result as `triton/paged_attention.py` (and `reference.py`);
  `tuning`: the chosen kernel's keyword-only knobs (its `TuningConfig`: Triton
  tile_tokens, num_splits, num_warps, num_stages; Mosaic GPU num_splits, tile_kv,
  num_stages; TPU kv_per_tile, seqs_per_tile, heads_per_tile, vmem_limit_bytes).
  backend: "auto" (module docstring), "triton", "mosaic_gpu" or "tpu"
  (`gpu_backend=` is its older name). interpret: the family's interpreter on a CPU.
  """
  return attend("decode", _pallas_backend(backend, gpu_backend, interpret),
                (q, k_pages, v_pages, block_tables, lengths),
                dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                     k_scales=k_scales, v_scales=v_scales, **tuning))


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, sliding_window=None,
                           k_scales=None, v_scales=None, interpret=False, backend="auto",
                           gpu_backend=None, **tuning):
  """Mixed prefill + decode attention with a Pallas kernel family.

  Arguments and result as `triton/ragged_paged_attention.py` (and `reference.py`);
  `tuning`: the chosen kernel's knobs (Triton q_per_tile, short_q_per_tile, kv_per_tile,
  kv_splits, num_warps, num_stages; Mosaic GPU q_per_tile, num_splits, tile_kv,
  num_stages; TPU kv_per_tile, q_per_tile, heads_per_tile, vmem_limit_bytes).
  backend / gpu_backend / interpret as `paged_attention`.
  """
  return attend("ragged", _pallas_backend(backend, gpu_backend, interpret),
                (q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs),
                dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                     k_scales=k_scales, v_scales=v_scales, **tuning))
