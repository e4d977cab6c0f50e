"""The kernel configurations a GPU run can meet, compiled deviceless for sm_90 (H200).

Shared by tests/gpu_compile_kernels_test.py (asserts: compiles, no spill, shared memory in
budget, no pool-sized temp buffer) and experiments/gpu_compile_report.py (the table).

    case = Case("decode", "llama8b", dtype="bfloat16", block_size=16, batch=64, context=4096)
    row = measure(case)     # grid, warps, stages, shared memory, registers, spills, ...

Shapes are real models' (Llama-3-8B 32/8 x 128, Qwen-like 14/2 x 64, Gemma-like 8/4 x 256
with soft cap and sliding window, D 80 / 96); workloads are the benchmarks' and the
engine's (decode B 1..256 at 4K context, a 2K prefill, chunked prefill, a mixed batch, the
engine's default step buckets of 8 and 256 tokens for 8 sequences).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels.deviceless import target as ct
from pallas_kernels.triton import ragged_tiling
from pallas_kernels.triton import tuning

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
  WORKLOADS name; dtype: q dtype; page_dtype: None (= dtype) or int8 / float8_e4m3fn."""
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


def _pool(case: Case, num_blocks: int):
  hq, hkv, d, _ = MODELS[case.model]
  a = ct.abstract
  pages = a((hkv, num_blocks, case.block_size, d), case.pdtype)
  scales = (a((hkv, num_blocks, case.block_size), jnp.float32)
            if case.page_dtype in QUANT else None)
  return pages, scales


def build(case: Case):
  """(jitted fn, abstract args) for the compile-only H200."""
  from pallas_kernels.triton.paged_attention import paged_attention  # pylint: disable=g-import-not-at-top
  from pallas_kernels.triton.ragged_paged_attention import ragged_paged_attention  # pylint: disable=g-import-not-at-top
  hq, hkv, d, sem = MODELS[case.model]
  a = ct.abstract
  knobs = dict(case.knobs)
  if case.kernel == "decode":
    pages_per_seq = -(-case.context // case.block_size)
    pages, scales = _pool(case, case.batch * pages_per_seq)
    args = (a((case.batch, hq, d), case.dtype), pages, pages,
            a((case.batch, pages_per_seq), jnp.int32), a((case.batch,), jnp.int32),
            scales, scales)

    def fn(q, k, v, t, n, ks, vs):
      return paged_attention(q, k, v, t, n, k_scales=ks, v_scales=vs, **sem, **knobs)
    return jax.jit(fn), args
  seqs, tokens = WORKLOADS[case.workload]
  max_kv = max(kv for _, kv in seqs)
  pages_per_seq = -(-max_kv // case.block_size)
  num_seqs = len(seqs)
  pages, scales = _pool(case, num_seqs * pages_per_seq)
  args = (a((tokens, hq, d), case.dtype), pages, pages,
          a((num_seqs, pages_per_seq), jnp.int32), a((num_seqs,), jnp.int32),
          a((num_seqs + 1,), jnp.int32), a((), jnp.int32), scales, scales)

  def rfn(q, k, v, t, kl, cu, n, ks, vs):
    return ragged_paged_attention(q, k, v, t, kl, cu, n, k_scales=ks, v_scales=vs, **sem,
                                  **knobs)
  return jax.jit(rfn), args


def kv_bytes(case: Case) -> int:
  """K/V bytes the kernel must read (scales included): the modelled traffic."""
  _, hkv, d, sem = MODELS[case.model]
  per_token = hkv * 2 * (d * case.pdtype.itemsize + (4 if case.page_dtype in QUANT else 0))
  window = sem.get("sliding_window")
  if case.kernel == "decode":
    ctx = min(case.context, window) if window else case.context
    return case.batch * ctx * per_token
  seqs, _ = WORKLOADS[case.workload]
  cfg = resolved(case)
  tokens = 0
  for q_len, kv_len in seqs:
    tq = cfg["q_per_tile"] if q_len > cfg["short_q_per_tile"] else cfg["short_q_per_tile"]
    for start in range(0, q_len, tq):
      end = kv_len - q_len + min(start + tq, q_len)
      tokens += min(end, window) if window else end
  return tokens * per_token


def resolved(case: Case) -> Dict[str, Any]:
  """The knobs the kernel's defaults resolve to for this case."""
  from pallas_kernels.triton import paged_attention as _pa_unused  # pylint: disable=g-import-not-at-top,unused-import
  hq, hkv, d, _ = MODELS[case.model]
  knobs = dict(case.knobs)
  dp = tuning.padded_head_dim(d)
  if case.kernel == "decode":
    dec = tuning.decode_defaults(case.dtype, dp, padded=dp != d, page_dtype=case.pdtype)
    return {"tile_tokens": knobs.get("tile_tokens", dec.tile_tokens),
            "num_stages": knobs.get("num_stages", dec.num_stages)}
  fn, args = build(case)
  del fn
  cfg = ragged_tiling.validate(*args[:7], sm_scale=None, soft_cap=None, sliding_window=None,
                               k_scales=args[7], v_scales=args[8],
                               q_per_tile=knobs.get("q_per_tile"),
                               short_q_per_tile=knobs.get("short_q_per_tile"),
                               kv_per_tile=knobs.get("kv_per_tile"),
                               kv_splits=knobs.get("kv_splits"),
                               num_warps=knobs.get("num_warps"),
                               num_stages=knobs.get("num_stages"))
  return dataclasses.asdict(cfg)


def measure(case: Case, fail_on_spill: bool = True) -> Dict[str, Any]:
  """Compiles `case` for sm_90; one row per kernel launch of ours, plus totals."""
  fn, args = build(case)
  report = ct.compile_report(fn, *args, fail_on_spill=fail_on_spill)
  ours = [l for l in report.launches if l.name.startswith(("paged_decode", "ragged_paged"))]
  cfg = resolved(case)
  nbytes = kv_bytes(case)
  pool = 2 * args[1].size * jnp.dtype(args[1].dtype).itemsize
  launches = []
  for l in ours:
    threads = l.threads[0] * l.threads[1] * l.threads[2]
    programs = l.grid[0] * l.grid[1] * l.grid[2]
    blocks = (tuning.resident_blocks(l.registers, threads, l.shared_memory)
              if l.registers else None)
    launches.append({
        "kernel": l.name, "grid": list(l.grid), "warps": threads // 32,
        "stages": cfg.get("num_stages"), "shared_memory": l.shared_memory,
        "registers": l.registers, "spill_bytes": l.spill_bytes, "occupancy": l.occupancy,
        "resident_blocks_per_sm": blocks,
        "wave_efficiency": (tuning.wave_efficiency(programs, blocks * tuning.NUM_SMS)
                            if blocks else None)})
  hq, _, d, _ = MODELS[case.model]
  rows = case.batch if case.kernel == "decode" else WORKLOADS[case.workload][1]
  activation = rows * hq * tuning.padded_head_dim(d) * 4   # padded q / output rows in f32
  return {"case": case.name, "kernel": case.kernel, "model": case.model,
          "activation_bytes": activation,
          "dtype": case.dtype, "page_dtype": case.pdtype.name,
          "block_size": case.block_size, "resolved": cfg, "launches": launches,
          "temp_bytes": report.temp_bytes, "pool_bytes": pool, "kv_bytes_read": nbytes,
          "modelled_time_us": nbytes / tuning.HBM_BYTES_PER_S * 1e6,
          "max_shared_memory": max((l.shared_memory for l in ours), default=0),
          "spilled": [l.name for l in ours if l.spill_bytes]}


def default_cases() -> List[Case]:
  """A representative 20 compiles: each default tile class once per dtype family, plus
  the configurations that once spilled."""
  return [
      Case("decode", "llama8b", "bfloat16", batch=64),          # kernel_bench headline
      Case("decode", "llama8b", "float32", batch=8),            # finding 2 (was 270 KB)
      Case("decode", "llama8b", "float16", block_size=128, batch=8),
      Case("decode", "llama8b", "bfloat16", "int8", batch=8),
      Case("decode", "qwen", "bfloat16", "float8_e4m3fn", block_size=64, batch=256),
      Case("decode", "gemma", "bfloat16", block_size=32, batch=8),
      Case("decode", "gemma", "float32", block_size=8, batch=8),
      Case("decode", "d80", "bfloat16", batch=8),
      Case("ragged", "llama8b", "bfloat16", workload="mixed"),
      Case("ragged", "llama8b", "float32", workload="engine256"),   # finding 3 (spilled)
      Case("ragged", "llama8b", "float32", "int8", block_size=128, workload="engine8"),
      Case("ragged", "qwen", "float32", workload="engine256"),
      Case("ragged", "gemma", "bfloat16", block_size=64, workload="engine256"),
      Case("ragged", "gemma", "float32", block_size=8, workload="engine8"),
      Case("ragged", "d96", "bfloat16", "float8_e4m3fn", workload="engine256"),
      # Spilled on jax 0.10.2 before the bf16-parts path / occupancy-aware defaults
      # (pallas_kernels/tuning.py): f32 q over int8 pages at D 256, Qwen-like f32.
      Case("decode", "gemma", "float32", "int8", block_size=8, batch=64),
      Case("ragged", "gemma", "float32", "int8", block_size=64, workload="engine256"),
      Case("ragged", "qwen", "float32", block_size=128, workload="mixed"),
      Case("ragged", "qwen", "float32", "int8", block_size=64, workload="engine256"),
      Case("ragged", "llama8b", "float32", "int8", block_size=128, workload="mixed"),
  ]


def full_cases() -> List[Case]:
  """The slow grid: models x dtypes x page dtypes x block sizes 8..128 for the decode
  kernel (B 64, 4K context) and two ragged workloads per pair (block sizes alternating),
  plus the block sizes 1, 4, 256 that gpu_check.sh's decode tests use."""
  out = []
  dtypes = [("bfloat16", None), ("float16", None), ("float32", None),
            ("bfloat16", "int8"), ("bfloat16", "float8_e4m3fn"), ("float32", "int8")]
  for i, (model, (dt, pdt)) in enumerate(itertools.product(MODELS, dtypes)):
    for bs in (8, 16, 32, 64, 128):
      out.append(Case("decode", model, dt, pdt, bs, batch=64))
    out.append(Case("ragged", model, dt, pdt, (8, 32, 128)[i % 3], workload="mixed"))
    out.append(Case("ragged", model, dt, pdt, (16, 64)[i % 2], workload="engine256"))
  for dt, bs in itertools.product(("bfloat16", "float32"), (1, 4, 256)):
    out.append(Case("decode", "llama8b", dt, block_size=bs, batch=8, context=2048))
  return out
