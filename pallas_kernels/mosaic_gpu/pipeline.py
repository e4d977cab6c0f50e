"""The Mosaic GPU (Hopper) attention pipeline shared by the paged decode and ragged kernels.

One program = one warpgroup = one 64-row query tile of one KV head (decode: the GQA group
of one sequence, zero-padded; ragged: q_per_tile tokens x G heads). `attend_pages` runs
its KV loop: the live key range [start_tok, end_tok) of one sequence, cut into kv tiles of
`tile_kv` tokens and divided between `num_splits` programs; each kv tile arrives by TMA,
one copy per page (several per tile for small pages, a slice of a page for big ones),
into a `num_stages`-deep shared-memory ring; QK^T and PV run on wgmma with both operands
in shared memory (P goes through shared memory: GPU interpret mode needs that); online
softmax in base 2 with f32 accumulators; edge tiles get their dead V rows zeroed (stale
pages may hold NaN); int8 / fp8 pages are converted per step into a q-dtype tile and their
per-token scales multiply logits (K) and probabilities (V). The result is normalized, put
in the query's shared-memory tile and copied out with the log-sum-exp.

Compiled, PV accumulates in place (`pl.run_state` + `plgpu.ACC.init`); GPU interpret mode
cannot seed an accumulator, so there PV goes into a fresh one and is added (`interpret`).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import checks
from pallas_kernels import common
from pallas_kernels import sm90

try:  # Mosaic GPU Pallas; its interpreter needs jax >= 0.11.2 (checked by callers).
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - very old jax
  pl = plgpu = None

MASK_VALUE = common.MASK_VALUE
Q_ROWS = 64               # wgmma M: every query tile has 64 rows.
SM90_SHARED_MEMORY_BYTES = sm90.SHARED_MEMORY_BYTES   # opt-in limit per block (227 KiB)
_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)
_SWIZZLE = 128            # bytes
_SMEM_SLACK = 4096        # Mosaic's alignment padding and barriers
_MIN_BLOCK_SIZE = 16
_DTYPES = ("bfloat16", "float16")
_QUANT_DTYPES = ("int8", "float8_e4m3fn")


def interpret_unavailable_reason() -> Optional[str]:
  """None when GPU interpret mode can run these kernels here, else a one-line reason."""
  if plgpu is None or not hasattr(plgpu, "InterpretGPUParams") or \
      common.jax_version() < (0, 11, 2):
    return f"Mosaic GPU interpret mode needs jax >= 0.11.2, this is jax {jax.__version__}"
  return None


def supported_reason(num_q_heads, num_kv_heads, head_dim, block_size, q_dtype,
                     page_dtype, quantized=False) -> Optional[str]:
  """None when the Mosaic kernels support the shape / dtypes, else why not (one line).
  `quantized`: int8 / float8_e4m3fn pages with per-token scales."""
  q_name, page_name = jnp.dtype(q_dtype).name, jnp.dtype(page_dtype).name
  if quantized:
    if q_name not in _DTYPES or page_name not in _QUANT_DTYPES:
      return (f"dtypes q={q_name} pages={page_name} with scales (Mosaic kernel: bf16/f16 q, "
              f"{'/'.join(_QUANT_DTYPES)} pages)")
  elif q_name not in _DTYPES or page_name != q_name:
    return f"dtypes q={q_name} pages={page_name} (Mosaic kernel: bf16/f16 pages = q dtype)"
  if block_size < _MIN_BLOCK_SIZE or block_size & (block_size - 1):
    return f"block_size {block_size} (Mosaic kernel: power of two >= {_MIN_BLOCK_SIZE})"
  if head_dim not in (64, 128, 256):
    return f"head_dim {head_dim} (Mosaic kernel: 64, 128 or 256)"
  if num_kv_heads < 1 or num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > Q_ROWS:
    return f"heads {num_q_heads}/{num_kv_heads} (Mosaic kernel: group of at most {Q_ROWS})"
  return None


def shared_memory_bytes(head_dim, tile_kv, num_stages, itemsize=2, page_itemsize=None) -> int:
  """Shared memory of one program (buffers only; barriers add a few bytes).
  `page_itemsize` (1) for int8 / fp8 pages: 8-bit + scale rings, one-slot compute tiles."""
  compute_slots = num_stages if page_itemsize is None else 1
  out = itemsize * head_dim * (Q_ROWS + 2 * compute_slots * tile_kv) + \
      itemsize * Q_ROWS * tile_kv + 4 * Q_ROWS
  if page_itemsize is not None:
    out += 2 * num_stages * tile_kv * (head_dim * page_itemsize + 4)
  return out


def default_num_stages(head_dim, tile_kv=64, page_itemsize=None) -> int:
  """The deepest K/V ring, up to 3, that fits in sm_90 shared memory."""
  for stages in (3, 2):
    if shared_memory_bytes(head_dim, tile_kv, stages, page_itemsize=page_itemsize) + \
        _SMEM_SLACK <= SM90_SHARED_MEMORY_BYTES:
      return stages
  return 1


def check_num_stages(num_stages, head_dim, tile_kv, page_itemsize=None) -> int:
  """Default or validated ring depth; ValueError when over the shared-memory budget."""
  if num_stages is None:
    return default_num_stages(head_dim, tile_kv, page_itemsize)
  checks.check_int("num_stages", num_stages, 1, 8)
  need = shared_memory_bytes(head_dim, tile_kv, num_stages,
                             page_itemsize=page_itemsize) + _SMEM_SLACK
  if need > SM90_SHARED_MEMORY_BYTES:
    raise ValueError(f"num_stages={num_stages} with tile_kv={tile_kv}, head_dim={head_dim} "
                     f"needs ~{need:,} B of shared memory > {SM90_SHARED_MEMORY_BYTES:,}")
  return int(num_stages)


def _transforms(dtype, head_dim):
  """Tiling + swizzle of a [rows, head_dim] shared-memory tile for TMA and wgmma."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(_SWIZZLE, head_dim * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def scratch_types(dtype, page_dtype, head_dim, block_size, tile_kv, num_stages, quantized):
  """Shared memory and barriers of one program, in the order `attend_pages` unpacks."""
  transforms = _transforms(dtype, head_dim)
  compute_slots = 1 if quantized else num_stages
  copies = max(1, tile_kv // block_size) * (2 if quantized else 1)   # arrivals per stage
  scratch = [
      plgpu.SMEM((Q_ROWS, head_dim), dtype, transforms=transforms),                # q / out
      plgpu.SMEM((compute_slots, tile_kv, head_dim), dtype, transforms=transforms),  # K
      plgpu.SMEM((compute_slots, tile_kv, head_dim), dtype, transforms=transforms),  # V
      plgpu.SMEM((Q_ROWS, tile_kv), dtype, transforms=transforms),                  # P
      plgpu.SMEM((Q_ROWS,), jnp.float32),                                           # lse
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
  ]
  if quantized:  # 8-bit K / V rings and their scale rings
    page_transforms = _transforms(page_dtype, head_dim)
    scratch += [
        plgpu.SMEM((num_stages, tile_kv, head_dim), page_dtype, transforms=page_transforms),
        plgpu.SMEM((num_stages, tile_kv, head_dim), page_dtype, transforms=page_transforms),
        plgpu.SMEM((num_stages, tile_kv), jnp.float32),
        plgpu.SMEM((num_stages, tile_kv), jnp.float32),
    ]
  return tuple(scratch)


def _dequantize(src, dst):
  """8-bit [T, D] tile -> dst's dtype, one 128-column swizzle tile at a time (registers).
  fp8 goes through f32: sm_90 converts e4m3 only to f16 in hardware."""
  head_dim = src.shape[-1]
  chunk = min(head_dim, 128)
  for c in range(head_dim // chunk):
    cols = pl.ds(c * chunk, chunk)
    x = src.at[:, cols][...]
    if x.dtype != jnp.int8:
      x = x.astype(jnp.float32)
    dst.at[:, cols][...] = x.astype(dst.dtype)


def _columns(scale_ref, shape):
  """f32[T] scales in shared memory -> [64, T] broadcast along rows (WGMMA layout)."""
  cols = plgpu.load(scale_ref, layout=plgpu.Layout.WGMMA.reduce(0))
  return lax.broadcast_in_dim(cols, shape, [1])


def attend_pages(scratch, q_src, k_ref, v_ref, ks_ref, vs_ref, o_dst, lse_dst, *, h,
                 page_of, start_tok, end_tok, live_fn, num_splits, split, tile_kv,
                 num_stages, sm_scale, soft_cap, interpret):
  """The KV loop of one program (see the module docstring).

  scratch: from `scratch_types`. q_src: [64, D] query rows in GMEM. k_ref, v_ref:
  [Hkv, NB, bs, D] pages; ks_ref, vs_ref: f32[Hkv, NB, bs] scales or None. o_dst [64, D],
  lse_dst f32[64]: this program's outputs in GMEM. page_of(logical page) -> physical
  page (scalar reads of the block table). [start_tok, end_tok): keys any row may see;
  live_fn(key i32[64, tile_kv]) -> bool mask of the keys each row sees (causal, window).
  """
  q_smem, k_smem, v_smem, p_smem, lse_smem, q_bar, k_bars, v_bars, *quant = scratch
  quantized = bool(quant)
  k_land, v_land, ks_smem, vs_smem = quant if quantized else (k_smem, v_smem, None, None)
  _, _, block_size, head_dim = k_ref.shape
  dtype = q_smem.dtype
  pages_per_tile = max(1, tile_kv // block_size)
  tokens_per_copy = min(block_size, tile_kv)
  first_tile = lax.div(start_tok, jnp.int32(tile_kv))
  end_tile = lax.div(end_tok + tile_kv - 1, jnp.int32(tile_kv))
  per_split = lax.div(end_tile - first_tile + num_splits - 1, jnp.int32(num_splits))
  lo = first_tile + split * per_split
  num_steps = jnp.clip(jnp.minimum(lo + per_split, end_tile) - lo, 0, None)

  def issue(step):  # TMA of kv tile lo + step into ring slot step % num_stages.
    slot = lax.rem(step, jnp.int32(num_stages))
    tok0 = (lo + step) * tile_kv
    for i in range(pages_per_tile):
      tok = tok0 + i * tokens_per_copy
      page = page_of(lax.div(tok, jnp.int32(block_size)))
      rows = pl.ds(lax.rem(tok, jnp.int32(block_size)) if block_size > tile_kv else 0,
                   tokens_per_copy)
      dst = pl.ds(i * tokens_per_copy, tokens_per_copy)
      plgpu.copy_gmem_to_smem(k_ref.at[h, page, rows], k_land.at[slot, dst], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[h, page, rows], v_land.at[slot, dst], v_bars.at[slot])
      if quantized:
        plgpu.copy_gmem_to_smem(ks_ref.at[h, page, rows], ks_smem.at[slot, dst],
                                k_bars.at[slot])
        plgpu.copy_gmem_to_smem(vs_ref.at[h, page, rows], vs_smem.at[slot, dst],
                                v_bars.at[slot])

  plgpu.copy_gmem_to_smem(q_src, q_smem, q_bar)
  for s in range(num_stages):
    pl.when(s < num_steps)(functools.partial(issue, jnp.int32(s)))
  plgpu.barrier_wait(q_bar)

  def body(step, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(step, jnp.int32(num_stages))
    cslot = step * 0 if quantized else slot   # compute tile (a literal index fails to lower)
    tok0 = (lo + step) * tile_kv
    plgpu.barrier_wait(k_bars.at[slot])
    if quantized:
      _dequantize(k_land.at[slot], k_smem.at[cslot])
      plgpu.commit_smem()

    def qk_scope(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[cslot].transpose((1, 0)))
      return acc_ref[...]
    logits = pl.run_scoped(qk_scope, plgpu.ACC((Q_ROWS, tile_kv), jnp.float32))
    if quantized:
      logits = logits * _columns(ks_smem.at[slot], logits.shape)
    logits = logits * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    live = live_fn(tok0 + plgpu.broadcasted_iota(jnp.int32, (Q_ROWS, tile_kv), 1,
                                                 layout=plgpu.Layout.WGMMA))
    logits = jnp.where(live, logits * _LOG2E, MASK_VALUE)   # log2 domain
    m_new = jnp.maximum(m_i, logits.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    # A row may see no key of this tile (padding, causal): exp2(MASK - MASK) would be 1.
    p = jnp.where(live, jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0])),
                  0.0)
    l_i = l_i * alpha + p.sum(axis=1)
    if not quantized:
      p_smem[...] = p.astype(dtype)

    plgpu.barrier_wait(v_bars.at[slot])
    if quantized:
      p_smem[...] = (p * _columns(vs_smem.at[slot], p.shape)).astype(dtype)
      _dequantize(v_land.at[slot], v_smem.at[cslot])

    @pl.when((tok0 < start_tok) | (tok0 + tile_kv > end_tok))
    def _zero_dead_rows():  # stale values (even NaN) must not meet p = 0 in PV
      rows = tok0 + plgpu.broadcasted_iota(jnp.int32, (tile_kv, 64), 0,
                                           layout=plgpu.Layout.WGMMA)
      keep = (rows >= start_tok) & (rows < end_tok)
      for c in range(head_dim // 64):   # 64 columns at a time: acc holds the registers
        v_cols = v_smem.at[cslot, :, pl.ds(c * 64, 64)]
        v_tile = v_cols[...]
        v_cols[...] = jnp.where(keep, v_tile, jnp.zeros_like(v_tile))
    plgpu.commit_smem()

    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    v_tile_ref = v_smem.at[cslot]
    if not interpret:  # wgmma adds onto the rescaled acc (no second f32 tile)
      acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p_smem, v_tile_ref))(
          plgpu.ACC.init(acc))
    else:
      def pv_scope(pv_ref):
        plgpu.wgmma(pv_ref, p_smem, v_tile_ref)
        return pv_ref[...]
      acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((Q_ROWS, head_dim), jnp.float32))
    # Both wgmmas have been waited for: the slot is free for the tile num_stages ahead.
    nxt = step + num_stages
    pl.when(nxt < num_steps)(functools.partial(issue, nxt))
    return acc, m_new, l_i

  row_layout = plgpu.Layout.WGMMA.reduce(1)
  acc = plgpu.layout_cast(jnp.zeros((Q_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
  m_i = plgpu.layout_cast(jnp.full((Q_ROWS,), MASK_VALUE, jnp.float32), row_layout)
  l_i = plgpu.layout_cast(jnp.zeros((Q_ROWS,), jnp.float32), row_layout)
  acc, m_i, l_i = lax.fori_loop(0, num_steps, body, (acc, m_i, l_i))

  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
  lse_smem[...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, o_dst)
  plgpu.copy_smem_to_gmem(lse_smem, lse_dst)
  plgpu.wait_smem_to_gmem(0)


def run_kernel(body, inputs, out_shapes, scratch, *, grid, grid_names, name, interpret,
               cost_estimate=None):
  """`body` over `grid` on a Mosaic GPU mesh, compiled or under GPU interpret mode (races
  checked), declaring `cost_estimate` (a pl.CostEstimate or None).

  What `plgpu.kernel` does (the scratch allocated by a `run_scoped` around the body: some
  scratch types are transformed refs, which `pl.kernel`'s own scratch does not take), but
  through `pl.kernel`, the entry that takes a `cost_estimate` on jax 0.10 and 0.11.
  """
  params = dict(compiler_params=plgpu.CompilerParams())
  if interpret:
    params["interpret"] = plgpu.InterpretGPUParams(detect_races=True)
  mesh = plgpu.Mesh(grid=tuple(grid), grid_names=tuple(grid_names), kernel_name=name)

  def kernel_body(*refs):
    pl.run_scoped(functools.partial(body, *refs), *scratch)

  out = pl.kernel(kernel_body, out_type=tuple(out_shapes), mesh=mesh, name=name,
                  cost_estimate=cost_estimate, **params)(*inputs)
  return tuple(out)


def page_lookup(tables_ref, row, num_blocks: int):
  """`page_of(logical)` for `attend_pages`: the physical block of block-table row `row`'s
  logical block. Table entries past a sequence's length may be garbage, so the logical
  index is clamped to the table and the block id to [0, num_blocks)."""
  pages_per_seq = tables_ref.shape[1]

  def page_of(logical):
    logical = jnp.minimum(logical, pages_per_seq - 1)
    return jnp.clip(tables_ref[row, logical], 0, num_blocks - 1)

  return page_of


def launch(kernel, inputs, k_pages, k_scales, v_scales, *, sem: checks.Semantics, cfg,
           dtype, out_lead, grid, grid_names, name, interpret, **kernel_kw):
  """Runs `kernel(*inputs, ks_ref, vs_ref, o_ref, lse_ref, scratch, **knobs)` via
  `run_kernel`, the knobs both entries pass: `sem`'s sliding_window / sm_scale / soft_cap,
  `cfg`'s (a TuningConfig's) num_splits / tile_kv / num_stages, interpret, `kernel_kw`.

  k_pages [Hkv, NB, bs, D] (also among `inputs`) sizes the scratch. The f32 scales (when
  quantized) follow `inputs`; ks_ref / vs_ref are None otherwise.
  Returns o dtype[*out_lead, Q_ROWS, D] and lse f32[*out_lead, Q_ROWS].
  """
  _, _, block_size, head_dim = k_pages.shape
  tile_kv, num_stages = cfg.tile_kv, cfg.num_stages
  kernel = functools.partial(
      kernel, sliding_window=sem.sliding_window, num_splits=cfg.num_splits, tile_kv=tile_kv,
      num_stages=num_stages, sm_scale=sem.sm_scale, soft_cap=sem.soft_cap,
      interpret=interpret, **kernel_kw)
  quantized = k_scales is not None
  inputs = list(inputs)
  if quantized:
    inputs += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]

  def body(*refs):
    n = len(inputs)
    kernel(*refs[:n], *([] if quantized else [None, None]), refs[n], refs[n + 1],
           refs[n + 2:])

  num_kv_heads, q_blocks, num_splits = grid   # (h, b or t, s): one Q_ROWS block each
  kv_len = inputs[1].shape[1] * block_size     # block_tables [S, P]
  rows = q_blocks * num_kv_heads * Q_ROWS
  cost = common.attention_cost(
      q_tokens=q_blocks, num_q_heads=num_kv_heads * Q_ROWS, kv_len=kv_len,
      kv_reads=q_blocks * kv_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
      page_dtype=k_pages.dtype, q_dtype=dtype, quantized=quantized, soft_cap=sem.soft_cap,
      extra_bytes=(num_splits - 1) * rows * head_dim * jnp.dtype(dtype).itemsize
      + num_splits * rows * 4 + inputs[1].size * 4)
  return run_kernel(
      body, inputs,
      (jax.ShapeDtypeStruct((*out_lead, Q_ROWS, head_dim), dtype),
       jax.ShapeDtypeStruct((*out_lead, Q_ROWS), jnp.float32)),
      scratch_types(dtype, k_pages.dtype, head_dim, block_size, tile_kv, num_stages,
                    quantized),
      grid=grid, grid_names=grid_names, name=name, interpret=interpret, cost_estimate=cost)


def check_supported(entry: str, shapes: checks.AttentionShapes, interpret: bool) -> None:
  """One-line ValueError when the Mosaic kernels do not take this call (after
  `checks.check_decode` / `check_ragged`); "auto" falls back to Triton for these."""
  if plgpu is None:
    raise ValueError("Mosaic GPU Pallas is not available in this jax")
  why = supported_reason(shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim,
                         shapes.block_size, shapes.q_dtype, shapes.page_dtype,
                         shapes.quantized)
  if why is not None:
    raise ValueError(f"mosaic_gpu {entry} does not support {why}; use Triton")
  if interpret and interpret_unavailable_reason():
    raise ValueError(interpret_unavailable_reason())


def check_tile_kv(tile_kv) -> int:
  checks.check_choice("tile_kv", tile_kv, (64, 128))
  return int(tile_kv)
