"""The kernel calls both deviceless reports compile: real models' shapes, the benchmarks'
and the engine's workloads, and each call's abstract arguments on the compile-only H200.

    case = Case("decode", "llama8b", dtype="bfloat16", block_size=16, batch=64, context=4096)
    fn, args = build(case, backend="triton")   # jitted package entry, ShapeDtypeStructs
    kv_bytes(case, q_per_tile=lambda q_len: 16)

Shapes (MODELS): Llama-3-8B 32/8 x 128, Qwen-like 14/2 x 64, Gemma-like 8/4 x 256 with
soft cap and sliding window, D 80 / 96. Workloads (WORKLOADS): decode B 1..256 at 4K
context, a 2K prefill, chunked prefill, a mixed batch, the engine's default step buckets
of 8 and 256 tokens for 8 sequences. triton_configs.py and mosaic_configs.py pick their
cases from these and read back what the compiler made of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels.deviceless import target

MODELS = {  # name: (q heads, kv heads, head_dim, extra semantics)
    "llama8b": (32, 8, 128, {}),
    "qwen": (14, 2, 64, {}),
    "gemma": (8, 4, 256, {"soft_cap": 50.0, "sliding_window": 4096}),
    "d80": (32, 8, 80, {}),
    "d96": (16, 4, 96, {}),
}
# Ragged workloads: (name, [(q_len, kv_len)] per sequence, num_tokens (padded))
WORKLOADS = {
    "decode64": ([(1, 4096)] * 64, 64),
    "prefill2k": ([(2048, 2048)], 2048),
    "chunk4x512": ([(512, 4096)] * 4, 2048),
    "mixed": ([(1, 2048)] * 64 + [(512, 2048)] * 2, 1088),
    "engine8": ([(1, 1024)] * 8, 8),        # engine default bucket: max_seqs 8 decodes
    "engine256": ([(128, 512), (64, 64)] + [(1, 512)] * 6, 256),
}
QUANT = ("int8", "float8_e4m3fn")   # page dtypes that carry per-token scales


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel call. kernel: "decode" or "ragged"; workload: decode batch/context or a
  WORKLOADS name; dtype: q dtype; page_dtype: None (= dtype) or int8 / float8_e4m3fn;
  knobs: the kernel's tuning keywords."""
  kernel: str
  model: str
  dtype: str = "bfloat16"
  page_dtype: Optional[str] = None
  block_size: int = 16
  batch: int = 64
  context: int = 4096
  workload: str = "decode64"
  knobs: Tuple[Tuple[str, Any], ...] = ()

  @property
  def name(self) -> str:
    pages = f"/{self.page_dtype}" if self.page_dtype else ""
    work = (f"B{self.batch}xctx{self.context}" if self.kernel == "decode" else self.workload)
    knobs = "".join(f",{k}={v}" for k, v in self.knobs)
    return f"{self.kernel}:{self.model}:{self.dtype}{pages}:bs{self.block_size}:{work}{knobs}"

  @property
  def pdtype(self):
    return jnp.dtype(self.page_dtype or self.dtype)

  @property
  def quantized(self) -> bool:
    return self.page_dtype in QUANT


def build(case: Case, backend: str):
  """(jitted package entry with the case's semantics and knobs, abstract args on the
  compile-only H200) for the kernel family `backend` ("triton" | "mosaic_gpu")."""
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  hq, hkv, d, sem = MODELS[case.model]
  a = target.abstract
  knobs = dict(case.knobs)
  if case.kernel == "decode":
    num_seqs, rows = case.batch, case.batch
    pages_per_seq = -(-case.context // case.block_size)
  else:
    seqs, rows = WORKLOADS[case.workload]
    num_seqs = len(seqs)
    pages_per_seq = -(-max(kv for _, kv in seqs) // case.block_size)
  num_blocks = num_seqs * pages_per_seq
  pages = a((hkv, num_blocks, case.block_size, d), case.pdtype)
  scales = a((hkv, num_blocks, case.block_size), jnp.float32) if case.quantized else None
  common = (a((rows, hq, d), case.dtype), pages, pages, a((num_seqs, pages_per_seq), jnp.int32),
            a((num_seqs,), jnp.int32))
  if case.kernel == "decode":
    def fn(q, k, v, t, n, ks, vs):
      return pallas_kernels.paged_attention(q, k, v, t, n, k_scales=ks, v_scales=vs,
                                            backend=backend, **sem, **knobs)
    return jax.jit(fn), (*common, scales, scales)

  def rfn(q, k, v, t, kl, cu, n, ks, vs):
    return pallas_kernels.ragged_paged_attention(q, k, v, t, kl, cu, n, k_scales=ks,
                                                 v_scales=vs, backend=backend, **sem, **knobs)
  return jax.jit(rfn), (*common, a((num_seqs + 1,), jnp.int32), a((), jnp.int32), scales,
                        scales)


def kv_bytes(case: Case, q_per_tile: Callable[[int], int]) -> int:
  """K/V bytes (scales included) of the live keys the kernel must read: per sequence for
  decode, per query tile for ragged (each tile reads from the first key its first row sees
  to its last row's position; `q_per_tile(q_len)`: the tile size of such a sequence).
  Queries, outputs and split partials are not counted."""
  _, hkv, d, sem = MODELS[case.model]
  per_token = hkv * 2 * (d * case.pdtype.itemsize + (4 if case.quantized else 0))
  window = sem.get("sliding_window")
  if case.kernel == "decode":
    return case.batch * (min(case.context, window) if window else case.context) * per_token
  tokens = 0
  for q_len, kv_len in WORKLOADS[case.workload][0]:
    tq = q_per_tile(q_len)
    for start in range(0, q_len, tq):
      pos0 = kv_len - q_len + start
      end = pos0 + min(tq, q_len - start)
      tokens += end - (max(pos0 - window + 1, 0) if window else 0)
  return tokens * per_token
