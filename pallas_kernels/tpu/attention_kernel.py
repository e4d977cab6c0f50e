"""The Pallas TPU kernel behind both paged-attention entries (decode and ragged).

Grid (head blocks, query blocks), both sequential ("arbitrary"): one TensorCore walks the
work list of work.py. A *unit* is one K/V tile (kv_per_tile tokens = PT pages) of one
pair for all `heads_per_tile` KV heads. Units are double-buffered: while unit u is
computed, unit u + 1's pages are in flight into the other VMEM slot, along the prefetch
chain that crosses pair, program and head-block boundaries.

The pages stay where the engine keeps them, head-major [Hkv, NB, bs, D] (never copied):
one DMA per page brings that page of every head in the head block ([HT, bs, D], strided
over the head axis in HBM), so a unit costs 2 x PT DMA descriptors (4 x PT with scales),
as many as a [NB, bs, Hkv, D] layout would need. Pages at or past a pair's KV_END are not
fetched; their stale VMEM is masked with `where` (never multiplied), so NaN garbage cannot
leak. Block-table entries are clamped into [0, NB) before they address HBM.

Per unit and head (q rows R = query tokens x q-heads-per-KV-head, keys TK):
  s = q [R, D] . k [TK, D]^T (f32 accumulate) * sm_scale (* per-key scale for int8/fp8)
  soft cap, then the causal / length / window mask, then the online softmax update of
  m, l (VMEM [HT, R, 128], lane-replicated) and acc (VMEM [HT, R, D], f32).
Per-token int8/fp8 scales come as compact scale rows (scales.py: one 128-lane row DMA per
page) and become a lane vector [1, TK]: the K scale multiplies the logits' columns, the V
scale the probabilities' columns, so quantized K/V tiles go to the MXU as exact bf16/f32
integers without a per-row rescale.

Integer / and % on traced values are lax.div / lax.rem (truncating: the floor for
the non-negative operands here). jnp's floor `//` and `%` lower through `sign`, which
makes Mosaic ask the chip (tpu_info) while lowering: without them the kernels lower
for a compile-only TPU with no TPU default device (engine.step_for_compile).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.tpu import scales as S
from pallas_kernels.tpu import work as W


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static shape and semantics of one kernel build.

  Attributes:
    decode: True: one query per pair, the q block is [seqs, HT, G, D] and pair i of a
      program uses row block i; False: ragged, the q block is [1, HT, q_per_tile * G, D].
    heads_per_tile: HT, KV heads per program.
    group: G, query heads per KV head.
    kv_per_tile: TK, K/V tokens per unit.
    block_size, pages_per_seq, num_blocks: the pool's bs, P and NB.
    num_pairs: capacity of the work list.
    sm_scale, soft_cap, sliding_window: attention semantics (reference.py).
    quantized: pages carry f32 per-token scales.
  """
  decode: bool
  heads_per_tile: int
  group: int
  kv_per_tile: int
  block_size: int
  pages_per_seq: int
  num_blocks: int
  num_pairs: int
  sm_scale: float
  soft_cap: Optional[float]
  sliding_window: Optional[int]
  quantized: bool

  @property
  def pages_per_tile(self) -> int:
    return self.kv_per_tile // self.block_size


def _kernel(tables_ref, meta_ref, prog_ref, chain_ref, q_ref, k_hbm, v_hbm, *rest,
            cfg: KernelConfig):
  if cfg.quantized:
    (ks_hbm, vs_hbm, o_ref, kbuf, vbuf, ksbuf, vsbuf, sems, m_ref, l_ref, acc_ref,
     slot_ref, ybuf) = rest
  else:
    o_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref, slot_ref = rest
  ht, tk, bs, pt = cfg.heads_per_tile, cfg.kv_per_tile, cfg.block_size, cfg.pages_per_tile
  npairs = cfg.num_pairs
  rpp = S.rows_per_page(bs)
  rows, head_dim = q_ref.shape[2], q_ref.shape[3]
  hblk, prog = pl.program_id(0), pl.program_id(1)
  num_hblks = pl.num_programs(0)

  def meta(field, pair):
    return meta_ref[field * npairs + pair]

  def tile_pages(pair, tile):
    """The PT page ids of K/V tile `tile` of `pair` (clamped into the pool)."""
    base = meta(W.SEQ, pair) * cfg.pages_per_seq
    return [jnp.clip(tables_ref[base + jnp.minimum(tile * pt + i, cfg.pages_per_seq - 1)],
                     0, cfg.num_blocks - 1) for i in range(pt)]

  def unit_copies(h, pair, tile, slot):
    """[(condition, [DMA descriptors])] for unit (head block h, pair, K/V tile)."""
    n_pages = jnp.clip(pl.cdiv(meta(W.KV_END, pair), bs) - tile * pt, 0, pt)
    heads = pl.ds(h * ht, ht)
    sem = sems.at[slot]
    out = []
    for i, page in enumerate(tile_pages(pair, tile)):
      descs = [pltpu.make_async_copy(k_hbm.at[heads, page], kbuf.at[slot, :, i], sem),
               pltpu.make_async_copy(v_hbm.at[heads, page], vbuf.at[slot, :, i], sem)]
      if cfg.quantized:
        src = (heads, pl.ds(S.first_row(page, bs), rpp))
        dst = (slot, slice(None), pl.ds(i * rpp, rpp))
        descs += [pltpu.make_async_copy(ks_hbm.at[src], ksbuf.at[dst], sem),
                  pltpu.make_async_copy(vs_hbm.at[src], vsbuf.at[dst], sem)]
      out.append((i < n_pages, descs))
    return out

  def run_unit(h, pair, tile, slot, method):
    for cond, descs in unit_copies(h, pair, tile, slot):
      def go(descs=descs):
        for d in descs:
          getattr(d, method)()
      pl.when(cond)(go)

  start_unit = functools.partial(run_unit, method="start")
  wait_unit = functools.partial(run_unit, method="wait")

  def next_unit(pair, tile):
    """(exists, head block, pair, tile) of the unit after (hblk, pair, tile)."""
    same_pair = tile + 1 < meta(W.KV_HI, pair)
    nxt = chain_ref[pair]
    first = chain_ref[npairs]
    in_blk = nxt < npairs
    exists = same_pair | in_blk | ((hblk + 1 < num_hblks) & (first < npairs))
    n_h = jnp.where(same_pair | in_blk, hblk, hblk + 1)
    n_pair = jnp.minimum(jnp.where(same_pair, pair, jnp.where(in_blk, nxt, first)),
                         npairs - 1)
    n_tile = jnp.where(same_pair, tile + 1, meta(W.KV_LO, n_pair))
    return exists, n_h, n_pair, n_tile

  @pl.when((hblk == 0) & (prog == 0))
  def _prime():
    slot_ref[0] = 0
    first = chain_ref[npairs]
    pl.when(first < npairs)(lambda: start_unit(0, first, meta(W.KV_LO, first), 0))

  if not cfg.decode:
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

  def row_info(pair):
    """(query position [R, 1] or scalar, rows-of-this-pair mask [R, 1] or None)."""
    pos0 = meta(W.POS0, pair)
    if cfg.decode:
      return pos0, None
    tok = lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), jnp.int32(cfg.group))
    row0 = meta(W.ROW0, pair)
    mine = (tok >= row0) & (tok < row0 + meta(W.NROWS, pair))
    return pos0 + tok - row0, mine

  def compute(pair, tile, slot, grp):
    kv_end = meta(W.KV_END, pair)
    pos, mine = row_info(pair)
    key = tile * tk + lax.broadcasted_iota(jnp.int32, (1, tk), 1)
    visible = (key < kv_end) & (key <= pos)
    if cfg.sliding_window is not None:
      visible &= key > pos - cfg.sliding_window
    if mine is not None:
      visible &= mine
    v_ok = tile * tk + lax.broadcasted_iota(jnp.int32, (tk, 1), 0) < kv_end
    pages = tile_pages(pair, tile) if cfg.quantized else None

    def head(h, carry):
      q = q_ref[grp, h]                                           # [R, D]
      k = kbuf[slot, h].reshape(tk, head_dim)
      v = vbuf[slot, h].reshape(tk, head_dim)
      if k.dtype != q.dtype:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
      prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
      s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                          preferred_element_type=jnp.float32) * cfg.sm_scale
      if cfg.quantized:
        s = s * S.lane_vector(ksbuf[slot, h], pages, bs, ybuf)
      if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
      s = jnp.where(visible, s, -jnp.inf)
      m_prev = m_ref[h][:, :1]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - m_safe)
      alpha = jnp.exp(m_prev - m_safe)
      l_ref[h] = jnp.broadcast_to(alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True),
                                  (rows, 128))
      m_ref[h] = jnp.broadcast_to(m_new, (rows, 128))
      if cfg.quantized:
        p = p * jnp.where(key < kv_end, S.lane_vector(vsbuf[slot, h], pages, bs, ybuf), 0.0)
      v = jnp.where(v_ok, v, jnp.zeros_like(v))
      pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)
      acc_ref[h] = alpha * acc_ref[h] + pv
      return carry

    lax.fori_loop(0, ht, head, 0)

  def finalize(pair, grp):
    _, mine = row_info(pair)

    def head(h, carry):
      l = l_ref[h][:, :1]
      out = jnp.where(l > 0.0, acc_ref[h] / jnp.where(l > 0.0, l, 1.0), 0.0)
      out = out.astype(o_ref.dtype)
      o_ref[grp, h] = out if mine is None else jnp.where(mine, out, o_ref[grp, h])
      return carry

    lax.fori_loop(0, ht, head, 0)

  def pair_body(pair, carry):
    grp = pair - prog_ref[prog] if cfg.decode else 0
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def tile_body(tile, c):
      slot = slot_ref[0]
      exists, n_h, n_pair, n_tile = next_unit(pair, tile)
      pl.when(exists)(lambda: start_unit(n_h, n_pair, n_tile, 1 - slot))
      wait_unit(hblk, pair, tile, slot)
      compute(pair, tile, slot, grp)
      slot_ref[0] = 1 - slot
      return c

    lax.fori_loop(meta(W.KV_LO, pair), meta(W.KV_HI, pair), tile_body, 0)
    finalize(pair, grp)
    return carry

  lax.fori_loop(prog_ref[prog], prog_ref[prog + 1], pair_body, 0)


def in_hbm(x):
  """`x` pinned to HBM for the kernel. Without the constraint XLA may copy a whole operand
  that fits into VMEM before the call (seen: all the scale rows of a small int8 pool,
  every call), whatever the kernel's BlockSpec says."""
  return pltpu.with_memory_space_constraint(x, pltpu.HBM)


def paged_attention_call(q4, k_pages, v_pages, k_scales, v_scales, tables, wl: W.WorkList,
                         *, cfg: KernelConfig, row_blocks: int, vmem_limit_bytes=None,
                         interpret=False, name="tpu_paged_attention"):
  """Runs the kernel.

  Args:
    q4: [NQ, Hkv, R, D] query blocks (decode: [Bp, Hkv, G, D]; ragged [nT, Hkv, TQ*G, D]).
    k_pages, v_pages: [Hkv, NB, bs, D]; k_scales, v_scales: scale rows
      f32[Hkv, ceil(NB * bs / 128), 128] (scales.py) or None.
    tables: i32[S * P] flattened block table.
    wl: the work list (work.py).
    row_blocks: leading block size of q4 (seqs per program for decode, 1 for ragged).
  Returns:
    [NQ, Hkv, R, D] in q4.dtype.
  """
  nq, num_kv_heads, rows, head_dim = q4.shape
  ht = cfg.heads_per_tile
  page_dtype = k_pages.dtype
  grid = (num_kv_heads // ht, nq // row_blocks)
  block = pl.BlockSpec((row_blocks, ht, rows, head_dim), lambda h, g, *_: (g, h, 0, 0))
  hbm = pl.BlockSpec(memory_space=pltpu.HBM)
  pt = cfg.pages_per_tile
  scratch = [pltpu.VMEM((2, ht, pt, cfg.block_size, head_dim), page_dtype),
             pltpu.VMEM((2, ht, pt, cfg.block_size, head_dim), page_dtype)]
  operands = [q4, k_pages, v_pages]
  nrows = pt * S.rows_per_page(cfg.block_size)
  if cfg.quantized:
    scratch += [pltpu.VMEM((2, ht, nrows, S.LANES), jnp.float32)] * 2
    operands += [k_scales, v_scales]
  operands = operands[:1] + [in_hbm(x) for x in operands[1:]]
  scratch += [pltpu.SemaphoreType.DMA((2,)),
              pltpu.VMEM((ht, rows, 128), jnp.float32),
              pltpu.VMEM((ht, rows, 128), jnp.float32),
              pltpu.VMEM((ht, rows, head_dim), jnp.float32),
              pltpu.SMEM((1,), jnp.int32)]
  if cfg.quantized:
    scratch.append(pltpu.VMEM((nrows, S.LANES), jnp.float32))
  # Each query block (a sequence, or a query tile of one) reads its sequence's pages.
  kv_len = cfg.pages_per_seq * cfg.block_size
  cost = common.attention_cost(
      q_tokens=nq * rows // cfg.group, num_q_heads=num_kv_heads * cfg.group, kv_len=kv_len,
      kv_reads=nq * kv_len, num_kv_heads=num_kv_heads, head_dim=head_dim,
      page_dtype=page_dtype, q_dtype=q4.dtype, quantized=cfg.quantized,
      soft_cap=cfg.soft_cap, extra_bytes=tables.size * 4)
  call = pl.pallas_call(
      functools.partial(_kernel, cfg=cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=grid,
          in_specs=[block] + [hbm] * (len(operands) - 1),
          out_specs=block, scratch_shapes=scratch),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("arbitrary", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes),
      out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype), cost_estimate=cost,
      interpret=interpret, name=name)
  return call(tables, wl.meta, wl.prog_pairs, wl.chain, *operands)


def attend(q4, k_pages, v_pages, block_tables, wl: W.WorkList, k_scales, v_scales, *,
           decode: bool, tune, sm_scale, soft_cap, sliding_window, row_blocks: int,
           interpret, name: str):
  """The entries' common tail: the static config from the tuning, scales as scale rows,
  the flattened block table, then the kernel. Shapes as `paged_attention_call`;
  block_tables i32[S, P]; scales f32[Hkv, NB, bs] or scale rows."""
  _, num_blocks, block_size, _ = k_pages.shape
  cfg = KernelConfig(
      decode=decode, heads_per_tile=tune.heads_per_tile, group=q4.shape[2] // (
          1 if decode else tune.q_per_tile), kv_per_tile=tune.kv_per_tile,
      block_size=block_size, pages_per_seq=block_tables.shape[1], num_blocks=num_blocks,
      num_pairs=wl.num_pairs, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window, quantized=k_scales is not None)
  if k_scales is not None:
    k_scales = S.as_rows(k_scales, num_blocks, block_size)
    v_scales = S.as_rows(v_scales, num_blocks, block_size)
  return paged_attention_call(
      q4, k_pages, v_pages, k_scales, v_scales, block_tables.astype(jnp.int32).reshape(-1),
      wl, cfg=cfg, row_blocks=row_blocks, vmem_limit_bytes=tune.vmem_limit_bytes,
      interpret=interpret, name=name)
