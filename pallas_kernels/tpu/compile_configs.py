"""The TPU kernel configurations to compile deviceless, ours and JAX's, for v5e / v6e.

Shared by tests/tpu_compile_test.py (compiles, no temporary over 1% of the pool) and
experiments/tpu_compile_report.py (VMEM / HBM per config beside JAX's kernels).

    case = Case("ragged", "llama8b", chip="v6e", block_size=64, seqs=256, context=8192)
    row = measure(case)       # ours: VMEM, temps, args; JAX's RPA compiled the same way

Shapes: Llama-3-8B (32 query / 8 KV heads, D 128) and a Gemma-2-like model (16 / 8 heads,
D 256, soft cap 50, sliding window 4096); bf16 queries over bf16, int8 or fp8 pages (the
quantized ones with scale rows, tpu/scales.py); 256-token ragged batches or decode
batches of `seqs` sequences, block tables spanning `context` tokens. The pool holds
exactly seqs x context tokens, so "1% of the pool" is the strictest reading.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels.tpu import compile_target as ct
from pallas_kernels.tpu import jax_baselines
from pallas_kernels.tpu import scales as S
from pallas_kernels.tpu import tuning
from pallas_kernels.tpu.paged_attention import paged_attention
from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention

MODELS = {  # name: (q heads, kv heads, head_dim, semantics)
    "llama8b": (32, 8, 128, {}),
    "gemma": (16, 8, 256, {"soft_cap": 50.0, "sliding_window": 4096}),
}
QUANT = ("int8", "float8_e4m3fn")
JAX_RPA_RETRY_VMEM_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel call. kernel: "decode" (seqs queries) or "ragged" (tokens queries over
  seqs sequences); page_dtype: bfloat16 / int8 / float8_e4m3fn (q is bfloat16)."""
  kernel: str
  model: str
  chip: str = "v5e"
  page_dtype: str = "bfloat16"
  block_size: int = 16
  seqs: int = 64
  context: int = 4096
  tokens: int = 256
  knobs: Tuple[Tuple[str, Any], ...] = ()

  @property
  def name(self) -> str:
    work = f"S{self.seqs}xctx{self.context}"
    if self.kernel == "ragged":
      work += f"xT{self.tokens}"
    knobs = "".join(f",{k}={v}" for k, v in self.knobs)
    return (f"{self.chip}:{self.kernel}:{self.model}:{self.page_dtype}:bs{self.block_size}:"
            f"{work}{knobs}")

  @property
  def pages_per_seq(self) -> int:
    return -(-self.context // self.block_size)

  @property
  def num_blocks(self) -> int:
    return self.seqs * self.pages_per_seq

  @property
  def num_queries(self) -> int:
    return self.seqs if self.kernel == "decode" else self.tokens


def pool_bytes(case: Case) -> int:
  """K + V pages (and scale rows) of the pool."""
  _, hkv, d, _ = MODELS[case.model]
  page = hkv * case.num_blocks * case.block_size * d * jnp.dtype(case.page_dtype).itemsize
  scale = (hkv * S.num_rows(case.num_blocks, case.block_size) * S.LANES * 4
           if case.page_dtype in QUANT else 0)
  return 2 * (page + scale)


def kv_bytes_read(case: Case) -> int:
  """K/V bytes one call must read if every sequence spans the whole context (decode) or
  the batch is `seqs` decodes sharing it (ragged): the modelled HBM traffic."""
  _, hkv, d, sem = MODELS[case.model]
  tokens = min(case.context, sem.get("sliding_window") or case.context)
  per_token = hkv * 2 * (d * jnp.dtype(case.page_dtype).itemsize
                         + (4 if case.page_dtype in QUANT else 0))
  return case.seqs * tokens * per_token


def _abstract_inputs(case: Case, dev):
  hq, hkv, d, _ = MODELS[case.model]
  a = lambda shape, dt: ct.abstract(shape, dt, dev)
  pages = a((hkv, case.num_blocks, case.block_size, d), case.page_dtype)
  rows = (a((hkv, S.num_rows(case.num_blocks, case.block_size), S.LANES), jnp.float32)
          if case.page_dtype in QUANT else None)
  q = a((case.num_queries, hq, d), jnp.bfloat16)
  tables = a((case.seqs, case.pages_per_seq), jnp.int32)
  lens = a((case.seqs,), jnp.int32)
  return q, pages, rows, tables, lens


def build(case: Case, dev):
  """(jitted fn, abstract args) of our kernel for `case` on device `dev`."""
  sem, knobs = MODELS[case.model][3], dict(case.knobs)
  q, pages, rows, tables, lens = _abstract_inputs(case, dev)
  if case.kernel == "decode":
    def fn(q, k, v, t, n, ks, vs):
      return paged_attention(q, k, v, t, n, k_scales=ks, v_scales=vs, **sem, **knobs)
    return jax.jit(fn), (q, pages, pages, tables, lens, rows, rows)
  cu = ct.abstract((case.seqs + 1,), jnp.int32, dev)
  num = ct.abstract((), jnp.int32, dev)

  def rfn(q, k, v, t, kl, cu, n, ks, vs):
    return ragged_paged_attention(q, k, v, t, kl, cu, n, k_scales=ks, v_scales=vs, **sem,
                                  **knobs)
  return jax.jit(rfn), (q, pages, pages, tables, lens, cu, num, rows, rows)


def build_jax_rpa(case: Case, dev, vmem_limit_bytes=None, blocks=None):
  """(jitted fn, abstract args, knobs) of JAX's ragged paged attention on the same shape
  (its own combined page layout; decode = q_len 1 rows); `blocks` = (kv pages, queries)
  per block, default its tuned sizes for the chip."""
  hq, hkv, d, sem = MODELS[case.model]
  q, _, _, tables, lens = _abstract_inputs(case, dev)
  kv = ct.abstract((case.num_blocks, case.block_size, 2 * hkv, d), case.page_dtype, dev)
  cu = ct.abstract((case.seqs + 1,), jnp.int32, dev)
  num = ct.abstract((1,), jnp.int32, dev)
  bkv, bq = blocks or jax_baselines.jax_rpa_block_sizes(
      case.chip, jnp.bfloat16, case.page_dtype, hq, hkv, d, case.block_size,
      case.num_queries, case.pages_per_seq)
  extra = {"k_scale": 0.5, "v_scale": 0.5} if case.page_dtype in QUANT else {}

  def fn(q, kv, t, kl, cu, n):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # pylint: disable=g-import-not-at-top
    return kernel.ragged_paged_attention(q, kv, kl, t, cu, n, sm_scale=d ** -0.5,
                                         num_kv_pages_per_block=bkv,
                                         num_queries_per_block=bq,
                                         vmem_limit_bytes=vmem_limit_bytes, **sem, **extra)
  return jax.jit(fn), (q, kv, tables, lens, cu, num), {"num_kv_pages_per_block": bkv,
                                                        "num_queries_per_block": bq}


def _report_row(report: ct.CompileReport, prefix: str, pool: int) -> Dict[str, Any]:
  kernels = report.kernel(prefix)
  big = report.large_buffers(max(1, pool // 100))
  limits = [k.vmem_limit_bytes for k in kernels if k.vmem_limit_bytes is not None]
  return {"vmem_bytes": max((k.vmem_bytes for k in kernels), default=None),
          "vmem_limit_bytes": max(limits, default=None),
          "temp_bytes": report.temp_bytes, "argument_bytes": report.argument_bytes,
          "output_bytes": report.output_bytes,
          "largest_buffer_bytes": max((b.nbytes for b in report.buffers), default=0),
          "buffers_over_1pct_pool": [f"{b.op} {b.shape} S({b.memory_space})" for b in big]}


def measure(case: Case, with_jax: bool = True) -> Dict[str, Any]:
  """Compiles our kernel (and JAX's RPA) for case.chip; one JSON-able row."""
  hq, hkv, d, _ = MODELS[case.model]
  dev = ct.tpu_devices(case.chip)[0]
  pool = pool_bytes(case)
  fn, args = build(case, dev)
  ours = _report_row(ct.compile_report(fn, *args, chip=case.chip), "tpu_", pool)
  knobs = dict(case.knobs)
  tune = tuning.resolve(kind=case.kernel, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                        block_size=case.block_size, pages_per_seq=case.pages_per_seq,
                        num_rows=case.num_queries, q_dtype=jnp.bfloat16,
                        page_dtype=case.page_dtype, quantized=case.page_dtype in QUANT,
                        **knobs)
  ours["tuning"] = dataclasses.asdict(tune)
  row = {"case": case.name, **dataclasses.asdict(case), "pool_bytes": pool,
         "kv_bytes_read": kv_bytes_read(case),
         "modelled_time_us": kv_bytes_read(case) / ct.HBM_BYTES_PER_S[case.chip] * 1e6,
         "ours": ours, "jax_rpa": None, "jax_rpa_matched": None}
  row["knobs"] = dict(case.knobs)
  if with_jax:
    row["jax_rpa"] = measure_jax_rpa(case, dev, pool)
    # The same work per step as ours: K/V tokens per tile, queries per block.
    matched = (min(case.pages_per_seq, max(1, tune.kv_per_tile // case.block_size)),
               tune.q_per_tile if case.kernel == "ragged" else tune.seqs_per_tile)
    row["jax_rpa_matched"] = measure_jax_rpa(case, dev, pool, blocks=matched)
  return row


def measure_jax_rpa(case: Case, dev, pool: int, blocks=None) -> Dict[str, Any]:
  """JAX's RPA under the chip's default VMEM scope; when its blocks do not fit there,
  again with JAX_RPA_RETRY_VMEM_BYTES (as serving stacks pass), both recorded."""
  out: Dict[str, Any] = {}
  for limit in (None, JAX_RPA_RETRY_VMEM_BYTES):
    try:
      jfn, jargs, jknobs = build_jax_rpa(case, dev, vmem_limit_bytes=limit, blocks=blocks)
      row = _report_row(ct.compile_report(jfn, *jargs, chip=case.chip),
                        "ragged_paged_attention", pool)
      row["tuning"] = jknobs
      return {**out, **row}
    except Exception as e:  # pylint: disable=broad-except
      key = "error_default_vmem" if limit is None else "error"
      out[key] = str(e).strip().splitlines()[0][:200]
  return out


def default_cases() -> List[Case]:
  """Four compiles covering both chips, both kernels, both models, bs 16 / 64, int8."""
  return [
      Case("decode", "llama8b", "v5e", block_size=16, seqs=64, context=4096),
      Case("ragged", "llama8b", "v6e", block_size=64, seqs=256, context=8192),
      Case("ragged", "gemma", "v5e", block_size=16, seqs=16, context=8192),
      Case("decode", "llama8b", "v6e", "int8", block_size=16, seqs=256, context=2048),
  ]


def report_cases() -> List[Case]:
  """The compile report's 24: chips x kernels x models x block 16 / 64 at 64 sequences of
  4K (bf16), plus int8 and fp8 pages (Llama, block 16) and 256 x 8K (Llama, block 16)."""
  out = [Case(kernel, model, chip, "bfloat16", bs, 64, 4096)
         for chip, kernel, model, bs in itertools.product(("v5e", "v6e"), ("decode", "ragged"),
                                                         MODELS, (16, 64))]
  for chip, kernel in itertools.product(("v5e", "v6e"), ("decode", "ragged")):
    out.append(Case(kernel, "llama8b", chip, "int8" if chip == "v5e" else "float8_e4m3fn",
                    16, 64, 4096))
    out.append(Case(kernel, "llama8b", chip, "bfloat16", 16, 256, 8192))
  return out


def fits(case: Case) -> Case:
  """`case` with its sequences halved until the pool takes at most 3/4 of the chip's HBM
  (Gemma-like bf16 at 256 x 8K is 17 GB: more than a v5e holds)."""
  while case.seqs > 1 and pool_bytes(case) > ct.HBM_BYTES[case.chip] * 3 // 4:
    case = dataclasses.replace(case, seqs=case.seqs // 2)
  return case


def full_cases() -> List[Case]:
  """The slow grid: chips x kernels x models x block 16 / 64 x (16 seqs at 8K, 64 at 4K,
  256 at 8K; fewer where the pool would not fit the chip) x bf16 / int8 pages, plus fp8
  pages on v6e."""
  out = []
  for chip, kernel, model, bs, (seqs, ctx), pdt in itertools.product(
      ("v5e", "v6e"), ("decode", "ragged"), MODELS, (16, 64),
      ((16, 8192), (64, 4096), (256, 8192)), ("bfloat16", "int8")):
    out.append(fits(Case(kernel, model, chip, pdt, bs, seqs, ctx)))
  for kernel, bs in itertools.product(("decode", "ragged"), (16, 64)):
    out.append(Case(kernel, "llama8b", "v6e", "float8_e4m3fn", bs, 64, 4096))
  return out
