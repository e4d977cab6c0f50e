"""Resource model of the Triton kernels on sm_90 (H100 / H200): defaults and knob budgets
(`decode_knobs`, `ragged_knobs`: what each op's TuningConfig.resolve returns).

Both kernels keep one K tile and one V tile of `tile_tokens x head_dim` (decode) or
`kv_per_tile x head_dim` (ragged) in shared memory per pipeline stage, plus layout-conversion
scratch, and hold the [rows, head_dim] f32 accumulator and the [rows, tile] logits in
registers. The limits of one sm_90 thread block are 232,448 B of (opt-in) shared memory
and 255 registers per thread; a config over either fails to compile (shared memory) or
spills (registers). The defaults below were chosen with the deviceless compile of
`pallas_kernels.deviceless` (`python -m experiments.gpu_compile_report`), and
`tests/gpu_compile_kernels_test.py` compiles every default for sm_90 with XLA's
fail-on-spill option on. Hand-set knobs are checked against the shared-memory estimate
before tracing (`check_shared_memory`), so a config over the budget fails with a one-line
ValueError naming the argument and the budget instead of a RESOURCE_EXHAUSTED from XLA.

float32 on the GPU: dots run as 3-pass TF32 on the tensor cores
(`lax.DotAlgorithmPreset.TF32_TF32_F32_X3`: the f32 operands are split into a TF32 high part
and a TF32 remainder, three MMAs, f32 accumulation; error ~1e-6 relative, the f32 test
tolerance). IEEE f32 dots (precision HIGHEST) compile to FMA loops that spill 15-60 KB per
thread at head_dim 128 and do not fit shared memory at the bf16 tile sizes. The Pallas
interpreter (CPU) keeps precision HIGHEST.
"""

from __future__ import annotations

import dataclasses
from jax import lax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import common
from pallas_kernels import sm90
from pallas_kernels import tiling

SHARED_MEMORY_BUDGET = sm90.SHARED_MEMORY_BYTES   # opt-in shared memory per thread block
F32_GPU_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
_SCRATCH_BYTES = 8192                # reduction / layout-conversion scratch (measured)


# What both Triton kernels take (each adds its own shape limits in `check_supported`).
Q_DTYPES = ("float32", "bfloat16", "float16")
PAGE_DTYPES = Q_DTYPES + ("int8", "float8_e4m3fn")


def check_dtypes(shapes: checks.AttentionShapes, q) -> None:
  """q's and the pages' dtypes and a head_dim in [16, 256] (one-line ValueError)."""
  if not 16 <= shapes.head_dim <= 256:
    raise ValueError(f"q has shape {tuple(q.shape)}; expected head_dim (dim 2) in [16, 256] "
                     f"(computed padded to a power of two)")
  if shapes.q_dtype.name not in Q_DTYPES:
    raise ValueError(f"q has dtype {shapes.q_dtype.name}; expected one of {Q_DTYPES}")
  if shapes.page_dtype.name not in PAGE_DTYPES:
    raise ValueError(f"k_pages has dtype {shapes.page_dtype.name}; expected one of "
                     f"{PAGE_DTYPES}")


def padded_head_dim(head_dim: int) -> int:
  """Head dim the kernels compute with: the next power of two (Triton tensor sizes).

  Pages keep their real head_dim; the kernels load the first `head_dim` features with a
  mask (zeros past it), so 80 / 96 run as 128 without copying the cache."""
  return max(16, common.next_pow2(head_dim))


def dot_precision(dtype, interpret: bool):
  """Precision of the kernels' dots for operands of `dtype` (see the module docstring)."""
  if jnp.dtype(dtype) != jnp.dtype(jnp.float32):
    return None                       # bf16 / fp16 operands, f32 accumulation
  return lax.Precision.HIGHEST if interpret else F32_GPU_PRECISION


def splits_f32_queries(q_dtype, page_dtype) -> bool:
  """True for float32 queries over int8 / fp8 pages: the kernels then compute in bf16.

  int8 and fp8 (e4m3) page values are exact in bf16, so K and V go to the tensor cores as
  bf16, and the f32 side of each dot (q, the probabilities) is split into a bf16 high
  part and a bf16 remainder: two bf16 MMAs with f32 accumulation, ~2^-17 relative error
  per operand (the f32 test tolerance holds), the same math in interpret mode and on the
  GPU. Why: with TF32 x3 the [16, D] f32 query is held as a TF32 high and remainder
  fragment in every warp (a 16-row dot replicates its A operand across the warps), plus
  the int8 -> f32 conversion of K/V: at head_dim 256 the decode kernel sat at 255
  registers and spilled 12-68 B per thread (jax 0.10.2, ptxas, block sizes 8-128), the
  ragged one 44-60 B, whatever the warps (4: 304 B, 16: 2,332 B) or stages (1: 52 B).
  Two bf16 fragments are half the registers of two f32 ones.
  """
  quantized = jnp.dtype(page_dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
  return quantized and jnp.dtype(q_dtype) == jnp.dtype(jnp.float32)


def bf16_parts(x):
  """(hi, lo) bf16 with hi + lo == x to ~2^-17 relative (x float32)."""
  hi = x.astype(jnp.bfloat16)
  return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def dot_parts(parts, b, dims, precision):
  """sum_i dot_general(parts[i], b) with f32 accumulation (one part: a plain dot)."""
  out = None
  for a in parts:
    d = lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)
    out = d if out is None else out + d
  return out


def _itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def kv_buffers(kernel: str, num_stages: int) -> int:
  """K/V tile buffers per operand: the decode kernel's cp.async ring holds stages - 1
  tiles in flight; the ragged kernel's gathers stage every tile through shared memory."""
  return max(1, num_stages - 1) if kernel == "decode" else max(1, num_stages)


def shared_memory_estimate(tile: int, head_dim_p: int, page_dtype, compute_dtype,
                           buffers: int, q_rows: int = 0) -> int:
  """Upper estimate of one program's shared memory (bytes).

  `buffers` K and V tiles of `tile` x `head_dim_p` in the page dtype, one operand tile
  and the [q_rows, head_dim_p] query in the compute dtype for the layout conversions
  feeding the MMA (twice for f32: TF32 x3 keeps a high and a remainder operand), and a
  fixed scratch. Calibrated on sm_90 compiles (jax 0.10.2 / Triton): above the measured
  value for every default in tests/gpu_compile_kernels_test.py.
  """
  pipeline = buffers * 2 * tile * head_dim_p * _itemsize(page_dtype)
  convert = (tile + q_rows) * head_dim_p * max(_itemsize(compute_dtype),
                                               _itemsize(page_dtype))
  if jnp.dtype(compute_dtype) == jnp.dtype(jnp.float32):
    convert *= 2
  return pipeline + convert + _SCRATCH_BYTES


def check_shared_memory(*, knob: str, value, tile: int, head_dim_p: int, page_dtype,
                        compute_dtype, buffers: int, q_rows: int = 0) -> None:
  """Raises a one-line ValueError when the estimate is over SHARED_MEMORY_BUDGET."""
  need = shared_memory_estimate(tile, head_dim_p, page_dtype, compute_dtype, buffers,
                                q_rows)
  if need > SHARED_MEMORY_BUDGET:
    raise ValueError(
        f"{knob}={value} needs ~{need:,} B of shared memory per thread block (tile {tile} x "
        f"head_dim {head_dim_p}, {buffers} buffers, {jnp.dtype(page_dtype).name} pages, "
        f"{jnp.dtype(compute_dtype).name} compute) > the sm_90 budget of "
        f"{SHARED_MEMORY_BUDGET:,} B: use a smaller tile or fewer stages")


def max_tile(head_dim_p: int, page_dtype, compute_dtype, buffers: int,
             q_rows: int = 0) -> int:
  """Largest power-of-two tile (<= 1024) whose shared-memory estimate fits the budget."""
  tile = 1024
  while tile > 16 and shared_memory_estimate(tile, head_dim_p, page_dtype, compute_dtype,
                                             buffers, q_rows) > SHARED_MEMORY_BUDGET:
    tile //= 2
  return tile


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
  tile_tokens: int
  num_warps: int
  num_stages: int


def decode_defaults(compute_dtype, head_dim_p: int, padded: bool = False,
                    page_dtype=None) -> DecodeTuning:
  """Decode kernel defaults (sm_90 compiles: no spill, shared memory in budget).

  3 stages: Triton then prefetches the block-table load of the next tile together with
  the K/V loads (cp.async; with 2 stages the page-id load stays a synchronous ld.global
  in every iteration's critical path) at no extra shared memory (73,760 vs 73,728 B at
  bf16 D 128). f32 (TF32 x3): 64 tokens x D 128 at 8 warps (178 registers), 16 x D 256
  at 8 (250 registers; 32 tokens spill), 32 x D <= 64 at 8 (94-113 registers; 64 tokens
  spill at 8 warps on jax 0.11's Triton and at 4 warps with int8 pages on 0.10's).

  f32 queries over int8 / fp8 pages (bf16 parts, `splits_f32_queries`; ptxas registers
  on jax 0.10.2, block sizes 8-128, all also spill-free on 0.11.2): D 256 16 tokens x 4
  warps, 141-150 registers (TF32 x3 at 8 warps: 255 + 12-68 B spill; bf16 parts at 8
  warps: 122-128, on the 128 occupancy step); D 128 64 x 8, 99-122 (TF32 x3: 178-185);
  D <= 64 32 x 8, 70-96; D 80 / 96 16 x 8, 102-119 (32 tokens: 96-175 on 0.10 but a
  spill on 0.11 at block size 8).
  """
  if page_dtype is not None and splits_f32_queries(compute_dtype, page_dtype):
    if head_dim_p > 128:
      return DecodeTuning(tile_tokens=16, num_warps=4, num_stages=3)
    tile = 16 if padded else (64 if head_dim_p > 64 else 32)
    return DecodeTuning(tile_tokens=tile, num_warps=8, num_stages=3)
  wide = jnp.dtype(compute_dtype).itemsize >= 4
  if wide:
    tile = 32 if head_dim_p <= 64 else (64 if head_dim_p <= 128 else 16)
  else:
    tile = 128 if head_dim_p <= 128 else 64
  if padded:  # the feature-masked gather of D 80 / 96 costs registers: 64 tokens spill
    tile = min(tile, 32)  # on jax 0.11 at block size 128 (32: 124 regs bf16, 199 f32)
  warps = 8 if wide or tile * head_dim_p >= 64 * 128 else 4
  return DecodeTuning(tile_tokens=tile, num_warps=warps, num_stages=3)


@dataclasses.dataclass(frozen=True)
class RaggedTuning:
  rows: int          # logit rows per prefill tile (q_per_tile * padded group)
  kv_per_tile: int
  num_warps: int
  num_stages: int


def ragged_defaults(compute_dtype, head_dim_p: int, padded: bool = False,
                    page_dtype=None) -> RaggedTuning:
  """Ragged kernel defaults (sm_90 compiles, tests/gpu_compile_kernels_test.py).

  Registers below are ptxas's (jax 0.10.2 PTX, sm_90a); every choice also compiles on jax
  0.11.2 with XLA's fail-on-spill on. ptxas spills a few bytes *below* 255 registers when
  a kernel needs slightly more than an occupancy step (the most registers that still fit
  one more block per SM: 96, 128, 168 at 4 warps; 80, 128 at 8 warps), so a default must
  need clearly more or less than a step, not only fewer than 255.

  bf16 / fp16: ~64 logit rows x 64 keys at D <= 128 with 8 warps (178 registers; 4 warps
  sit at 255 and spill 8 B in the mixed batch); D 256: 64 rows x 32 keys. f32 (TF32 x3)
  keeps the registers of its three operand pairs: 32 rows x 32 keys, 8 warps at D 128
  (232 registers); 16 rows x 16 keys at D 256 (32 rows spill 1.2 KB); at D <= 64 32 rows
  x 16 keys, 4 warps and 3 stages: 104-106 / 176 registers (short / long tile; with 2
  stages the Qwen-like G 8 short tile was held at 96 and spilled 12 B in the mixed batch
  at block size 128; 8 warps: held at 128, 16 B; 32 keys x 4 warps spill on jax 0.11).
  A padded head_dim (80, 96) gathers K/V with a feature mask, which costs registers:
  half the keys per step (64 keys spill 152 B at D 96), and half the rows for f32.

  f32 queries over int8 / fp8 pages compute in bf16 (`splits_f32_queries`), own table:
  D 256: 16 rows x 16 keys x 4 warps x 1 stage, 138-154 registers (TF32 x3 was 255 +
  44-60 B spill; bf16 parts at 8 warps sit exactly on the 128 step; 4 warps x 2 stages,
  157-160 on 0.10, spill on 0.11 in engine256; the gathers are not cp.async-pipelined,
  so one stage costs no overlap). D 128: 32 rows x 64 keys x 8 warps,
  100-104 / 182 (32 keys were held at 128 with a 32 B spill). D 80 / 96: 16 rows x 32
  keys x 8 warps, 157-172 (16 keys: held at 128, 16 B). D <= 64: 32 rows x 16 keys x 8
  warps, 71-77 / 104-106 (TF32 x3 with 4 warps was held at 168 with a 16 B spill at
  block size 64; bf16 parts with 4 warps sat at the 96 step).
  """
  if page_dtype is not None and splits_f32_queries(compute_dtype, page_dtype):
    if head_dim_p > 128:
      return RaggedTuning(rows=16, kv_per_tile=16, num_warps=4, num_stages=1)
    if head_dim_p > 64:
      return (RaggedTuning(rows=16, kv_per_tile=32, num_warps=8, num_stages=2) if padded
              else RaggedTuning(rows=32, kv_per_tile=64, num_warps=8, num_stages=2))
    return RaggedTuning(rows=32, kv_per_tile=16, num_warps=8, num_stages=2)
  if jnp.dtype(compute_dtype).itemsize >= 4:
    if head_dim_p > 128:
      tune = RaggedTuning(rows=16, kv_per_tile=16, num_warps=8, num_stages=2)
    elif head_dim_p > 64:
      tune = RaggedTuning(rows=32, kv_per_tile=32, num_warps=8, num_stages=2)
    else:
      tune = RaggedTuning(rows=32, kv_per_tile=16, num_warps=4, num_stages=3)
  elif head_dim_p > 128:
    tune = RaggedTuning(rows=64, kv_per_tile=32, num_warps=8, num_stages=2)
  else:
    tune = RaggedTuning(rows=64, kv_per_tile=64, num_warps=8, num_stages=2)
  if padded:
    wide = jnp.dtype(compute_dtype).itemsize >= 4
    tune = dataclasses.replace(tune, kv_per_tile=max(16, tune.kv_per_tile // 2), num_warps=8,
                               rows=max(16, tune.rows // 2) if wide else tune.rows)
  return tune


def default_num_splits(batch: int, num_kv_heads: int, pages_per_seq: int, block_size: int,
                       tile_tokens: int, target_programs: int = 528,
                       max_splits: int = 32) -> int:
  """Decode split-K heuristic: programs for about two waves of resident blocks (132 SMs x
  2 blocks of 256 threads at ~128 registers on H100/H200: 528), without splits shorter
  than two page tiles of the longest sequence the table can hold. B=64 x 8 KV heads at
  4K context: 2 splits (1,024 programs) instead of 512 programs for 264 slots."""
  max_tiles = -(-pages_per_seq // max(1, tile_tokens // block_size))
  want = -(-target_programs // (batch * num_kv_heads))
  return int(max(1, min(want, max_tiles // 2, max_splits)))


def default_num_warps(tile_tokens: int, head_dim: int, dtype=jnp.bfloat16) -> int:
  """Decode warps for a hand-set tile: 8 for big tiles and for float32, else 4
  (`decode_defaults` picks its own for its tile)."""
  wide = jnp.dtype(dtype).itemsize >= 4
  return 8 if wide or tile_tokens * padded_head_dim(head_dim) >= 64 * 128 else 4


# Ragged programs wanted in flight before split-K is used: about two waves of an H100/H200
# (132 SMs). Only a default; `kv_splits` overrides it.
RAGGED_TARGET_PROGRAMS = 264
RAGGED_MAX_DEFAULT_SPLITS = 16
MIN_DOT_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16.
NUM_WARPS = (1, 2, 4, 8, 16)


def default_q_per_tile(group: int, rows: int = 64):
  """Ragged (q_per_tile, short_q_per_tile): ~`rows` logit rows per prefill tile, 16 per
  short (decode) tile."""
  group_p = common.next_pow2(group)
  short = max(1, MIN_DOT_ROWS // group_p)
  return max(short, rows // group_p), short


def default_kv_splits(num_tiles: int, num_kv_heads: int, max_kv_tokens: int,
                      kv_per_tile: int) -> int:
  """Ragged split-K factor: fill ~RAGGED_TARGET_PROGRAMS programs, >= 4 KV steps per split
  at full length."""
  programs = num_tiles * num_kv_heads
  if programs >= RAGGED_TARGET_PROGRAMS:
    return 1
  wanted = -(-RAGGED_TARGET_PROGRAMS // programs)
  by_length = max(1, -(-max_kv_tokens // kv_per_tile) // 4)
  return int(max(1, min(wanted, by_length, RAGGED_MAX_DEFAULT_SPLITS)))


def decode_knobs(shapes, *, tile_tokens=None, num_splits=None, num_warps=None,
                 num_stages=None) -> dict:
  """The decode kernel's knobs for `shapes` (checks.AttentionShapes): the given ones
  checked against the sm_90 budgets (one-line ValueError naming the knob), defaults for
  the rest."""
  if num_splits is not None:
    checks.check_int("num_splits", num_splits, 1, 256)
  if num_stages is not None:
    checks.check_int("num_stages", num_stages, 1, 4, why="Triton software pipelining")
  head_dim_p = padded_head_dim(shapes.head_dim)
  dec = decode_defaults(shapes.q_dtype, head_dim_p, padded=head_dim_p != shapes.head_dim,
                        page_dtype=shapes.page_dtype)
  stages = dec.num_stages if num_stages is None else num_stages
  buffers = kv_buffers("decode", stages)
  top = max_tile(head_dim_p, shapes.page_dtype, shapes.q_dtype, buffers)
  if tile_tokens is not None:
    checks.check_int("tile_tokens", tile_tokens, MIN_DOT_ROWS, top, pow2=True,
                     why=f"Triton dot >= 16; above {top}, {stages} stages of K/V tiles at "
                     f"head_dim {head_dim_p} exceed the sm_90 shared-memory budget of "
                     f"{SHARED_MEMORY_BUDGET:,} B")
  if num_warps is not None:
    checks.check_choice("num_warps", num_warps, NUM_WARPS)
  tile = dec.tile_tokens if tile_tokens is None else tile_tokens
  check_shared_memory(knob="num_stages", value=stages, tile=tile, head_dim_p=head_dim_p,
                      page_dtype=shapes.page_dtype, compute_dtype=shapes.q_dtype,
                      buffers=buffers)
  if num_splits is None:
    num_splits = default_num_splits(shapes.rows, shapes.num_kv_heads, shapes.pages_per_seq,
                                    shapes.block_size, tile)
  if num_warps is None:  # the resource model's warps for its tile, else by tile size
    num_warps = (dec.num_warps if tile == dec.tile_tokens
                 else default_num_warps(tile, shapes.head_dim, shapes.q_dtype))
  return dict(tile_tokens=int(tile), num_splits=int(num_splits), num_warps=int(num_warps),
              num_stages=int(stages))


def ragged_knobs(shapes, *, interpret: bool, q_per_tile=None, short_q_per_tile=None,
                 kv_per_tile=None, kv_splits=None, num_warps=None, num_stages=None) -> dict:
  """The ragged kernel's knobs for `shapes` (checks.AttentionShapes): the given ones
  checked against the sm_90 budgets (one-line ValueError naming the knob), defaults for
  the rest (split-K: ~RAGGED_TARGET_PROGRAMS programs; 1 in interpret mode)."""
  group_p = common.next_pow2(shapes.group)
  min_tile = max(1, MIN_DOT_ROWS // group_p)
  head_dim_p = padded_head_dim(shapes.head_dim)
  tune = ragged_defaults(shapes.q_dtype, head_dim_p, padded=head_dim_p != shapes.head_dim,
                         page_dtype=shapes.page_dtype)
  default_long, default_short = default_q_per_tile(shapes.group, tune.rows)
  q_per_tile = default_long if q_per_tile is None else q_per_tile
  checks.check_int("q_per_tile", q_per_tile, min_tile, 1024, pow2=True)
  if short_q_per_tile is None:
    short_q_per_tile = min(default_short, q_per_tile)
  checks.check_int("short_q_per_tile", short_q_per_tile, min_tile, q_per_tile, pow2=True)
  num_warps = tune.num_warps if num_warps is None else num_warps
  num_stages = tune.num_stages if num_stages is None else num_stages
  checks.check_int("num_stages", num_stages, 1, 4)
  buffers = kv_buffers("ragged", num_stages)
  rows = q_per_tile * group_p
  top = max_tile(head_dim_p, shapes.page_dtype, shapes.q_dtype, buffers, rows)
  if kv_per_tile is None:
    kv_per_tile = min(tune.kv_per_tile, top)
  checks.check_int("kv_per_tile", kv_per_tile, 16, 1024, pow2=True)
  check_shared_memory(knob="q_per_tile/kv_per_tile", value=f"{q_per_tile}/{kv_per_tile}",
                      tile=kv_per_tile, head_dim_p=head_dim_p, page_dtype=shapes.page_dtype,
                      compute_dtype=shapes.q_dtype, buffers=buffers, q_rows=rows)
  if kv_splits is None:
    if interpret:
      kv_splits = 1  # the interpreter runs programs one by one: splitting only costs time
    else:
      first = tiling.tile_classes(shapes.rows, q_per_tile, short_q_per_tile, 1)[0]
      kv_splits = default_kv_splits(
          tiling.max_query_tiles(shapes.rows, shapes.num_seqs, first.q_per_tile,
                                 first.min_q_len, first.max_q_len),
          shapes.num_kv_heads, shapes.pages_per_seq * shapes.block_size, kv_per_tile)
  return dict(q_per_tile=int(q_per_tile), short_q_per_tile=int(short_q_per_tile),
              kv_per_tile=int(kv_per_tile), kv_splits=int(kv_splits),
              num_warps=int(num_warps), num_stages=int(num_stages))
