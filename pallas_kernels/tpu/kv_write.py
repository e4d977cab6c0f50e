"""Writing a step's new K/V into the pages on TPU, in place (Pallas / Mosaic DMAs).

Why a kernel: XLA's TPU scatter (paged_jax.kv_cache.write's `.at[:, slots].set`) wants the
scattered slot axis major, so on a TPU it transposes the whole layer pool into that layout,
scatters, and transposes back: two copies of every K and V page array per layer per step
(seen in the compiled v5e module; tests/tpu_compile_test.py). This kernel updates the
donated pages where they are (input_output_aliases) and touches only the rows it writes.

A DMA into a bf16 / int8 page must start on an 8-row tile boundary, so the unit is an
8-row *group* of one page (all heads of the head block): read it, overwrite the new rows,
write it back. Tokens are taken in batch order (padding and slots outside the pool
dropped) and cut into *runs* of consecutive tokens that fall in one group; runs are
double-buffered (group reads of run r + 1 in flight while run r is merged), and a slot's
buffer is reused only after its previous write landed, so two runs of the same group never
overlap. Quantized pages (int8 / fp8, kv_cache.py's per-token absmax scale) also update
their scale rows (tpu/scales.py): one 128-lane row per run of runs sharing it, read before
the first and written after the last (synchronously: a cost of one DMA round trip per
scale row, paid only by quantized pools).

  k_pages, v_pages [Hkv, NB, bs, D]; k_new, v_new [T, Hkv, D]; slots i32[T]
  (block * bs + offset, < 0 = padding); scale rows f32[Hkv, ceil(NB * bs / 128), 128].

Integer / and % on traced values are lax.div / lax.rem (truncating: the floor for
the non-negative operands here). jnp's floor `//` and `%` lower through `sign`, which
makes Mosaic ask the chip (tpu_info) while lowering: without them the kernels lower
for a compile-only TPU with no TPU default device (engine.step_for_compile).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.tpu import attention_kernel
from pallas_kernels.tpu import scales as S

GROUP_ROWS = 8
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _runs(slots, num_slots):
  """Compacted tokens and their runs. Returns (tokens i32[T] in write order, run_start,
  run_len, run_group, run_first_srow, run_last_srow (all i32[T], valid below num_runs),
  num_runs i32[1])."""
  t = slots.shape[0]
  valid = (slots >= 0) & (slots < num_slots)
  tokens = jnp.argsort(~valid, stable=True).astype(jnp.int32)
  n = jnp.sum(valid).astype(jnp.int32)
  s = jnp.where(valid[tokens], slots[tokens], 0)
  grp = s // GROUP_ROWS
  srow = s // S.LANES
  idx = jnp.arange(t, dtype=jnp.int32)
  prev_grp = jnp.concatenate([jnp.full((1,), -1, jnp.int32), grp[:-1]])
  starts = (idx < n) & ((idx == 0) | (grp != prev_grp))
  num_runs = jnp.sum(starts).astype(jnp.int32)
  order = jnp.argsort(~starts, stable=True)                  # run starts first, in order
  run_start = jnp.where(idx < num_runs, order, t).astype(jnp.int32)
  next_start = jnp.concatenate([run_start[1:], jnp.full((1,), t, jnp.int32)])
  run_len = jnp.where(idx < num_runs, jnp.minimum(next_start, n) - run_start, 0)
  run_group = jnp.where(idx < num_runs, grp[jnp.minimum(run_start, t - 1)], 0)
  run_srow = run_group * GROUP_ROWS // S.LANES
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), run_srow[:-1]])
  nxt = jnp.concatenate([run_srow[1:], jnp.full((1,), -1, jnp.int32)])
  first = (idx < num_runs) & (run_srow != prev)
  last = (idx < num_runs) & ((run_srow != nxt) | (idx == num_runs - 1))
  return (tokens, s, run_start, run_len.astype(jnp.int32), run_group.astype(jnp.int32),
          first.astype(jnp.int32), last.astype(jnp.int32), num_runs.reshape(1))


def _kernel(tok_ref, slot_ref, rstart_ref, rlen_ref, rgrp_ref, sfirst_ref, slast_ref, nrun_ref,
            kn_hbm, vn_hbm, k_in, v_in, *rest, block_size, quant):
  del k_in, v_in
  if quant:
    (ks_in, vs_in, k_hbm, v_hbm, ks_hbm, vs_hbm, gbuf, tbuf, sbuf, sems, ssem) = rest
    del ks_in, vs_in
  else:
    k_hbm, v_hbm, gbuf, tbuf, sems = rest
  groups_per_page = block_size // GROUP_ROWS
  num_runs = nrun_ref[0]

  def group_copies(r, slot, to_hbm):
    grp = rgrp_ref[r]
    page, row0 = lax.div(grp, groups_per_page), lax.rem(grp, groups_per_page) * GROUP_ROWS
    out = []
    for kv, hbm in enumerate((k_hbm, v_hbm)):
      src = hbm.at[:, page, pl.ds(pl.multiple_of(row0, GROUP_ROWS), GROUP_ROWS)]
      dst = gbuf.at[slot, kv]
      out.append(pltpu.make_async_copy(dst, src, sems.at[1, slot]) if to_hbm else
                 pltpu.make_async_copy(src, dst, sems.at[0, slot]))
    return out

  def reads(r, slot, method):
    """Run r's group (K and V) and its new rows (at most GROUP_ROWS tokens, into
    tbuf[slot, kv, i]): start or wait."""
    for c in group_copies(r, slot, False):
      getattr(c, method)()

    def token(i, carry):
      tok = tok_ref[rstart_ref[r] + i]
      for kv, src in enumerate((kn_hbm, vn_hbm)):
        getattr(pltpu.make_async_copy(src.at[tok], tbuf.at[slot, kv, i], sems.at[0, slot]),
                method)()
      return carry

    lax.fori_loop(0, rlen_ref[r], token, 0)

  start_reads = functools.partial(reads, method="start")
  wait_reads = functools.partial(reads, method="wait")

  def srow_copies(r, to_hbm):
    row = lax.div(rgrp_ref[r] * GROUP_ROWS, S.LANES)
    out = []
    for kv, hbm in enumerate((ks_hbm, vs_hbm)):
      src, dst = hbm.at[:, pl.ds(row, 1)], sbuf.at[kv]
      out.append(pltpu.make_async_copy(dst, src, ssem) if to_hbm else
                 pltpu.make_async_copy(src, dst, ssem))
    return out

  @pl.when(num_runs > 0)
  def _prime():
    start_reads(0, 0)

  def run_body(r, carry):
    slot = lax.rem(r, 2)

    @pl.when(r + 1 < num_runs)
    def _prefetch():
      @pl.when(r >= 1)
      def _():                       # slot 1 - slot still holds run r - 1 going out
        for c in group_copies(r - 1, 1 - slot, True):
          c.wait()
      start_reads(r + 1, 1 - slot)

    wait_reads(r, slot)
    if quant:
      @pl.when(sfirst_ref[r] == 1)
      def _():
        for c in srow_copies(r, False):
          c.start()
        for c in srow_copies(r, False):
          c.wait()

    def put(i, c):
      row = lax.rem(slot_ref[rstart_ref[r] + i], GROUP_ROWS)
      rows = lax.broadcasted_iota(jnp.int32, (1, GROUP_ROWS, 1), 1)
      for kv in range(2):
        new = tbuf[slot, kv, i].astype(jnp.float32)[:, None, :]          # [HT, 1, D]
        if quant:
          qmax = _QMAX[jnp.dtype(gbuf.dtype).name]
          scale = jnp.max(jnp.abs(new), axis=2, keepdims=True) / qmax    # [HT, 1, 1]
          new = jnp.clip(new / jnp.where(scale > 0, scale, 1.0), -qmax, qmax)
          if jnp.dtype(gbuf.dtype) == jnp.int8:
            new = jnp.round(new)
          slot_in_row = lax.rem(slot_ref[rstart_ref[r] + i], S.LANES)
          lane = lax.broadcasted_iota(jnp.int32, (1, 1, S.LANES), 2)
          sbuf[kv] = jnp.where(lane == slot_in_row, scale, sbuf[kv])
        cur = gbuf[slot, kv]
        gbuf[slot, kv] = jnp.where(rows == row, new.astype(cur.dtype), cur)
      return c

    lax.fori_loop(0, rlen_ref[r], put, 0)
    for c in group_copies(r, slot, True):
      c.start()
    if quant:
      @pl.when(slast_ref[r] == 1)
      def _():
        for c in srow_copies(r, True):
          c.start()
        for c in srow_copies(r, True):
          c.wait()
    return carry

  lax.fori_loop(0, num_runs, run_body, 0)
  # Drain the last one or two group writes.
  @pl.when(num_runs >= 2)
  def _():
    for c in group_copies(num_runs - 2, lax.rem(num_runs, 2), True):
      c.wait()

  @pl.when(num_runs >= 1)
  def _():
    for c in group_copies(num_runs - 1, lax.rem(num_runs - 1, 2), True):
      c.wait()


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1, 5, 6))
def write_kv(k_pages, v_pages, k_new, v_new, slots, k_scales=None, v_scales=None, *,
             interpret=False):
  """Writes new tokens' K/V into their slots of one layer's pages, in place.

  Args:
    k_pages, v_pages: [Hkv, NB, bs, D] (donated; float, or int8 / fp8 with scale rows).
    k_new, v_new: [T, Hkv, D] new keys / values (any float dtype).
    slots: i32[T] flat slot (block * bs + offset); < 0 or past the pool: not written.
      Two tokens must not share a slot.
    k_scales, v_scales: scale rows f32[Hkv, ceil(NB * bs / 128), 128] (quantized pages).
    interpret: False, True or a pltpu.InterpretParams.
  Returns:
    (k_pages, v_pages) or (k_pages, v_pages, k_scales, v_scales), updated.
  """
  num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
  quant = k_scales is not None
  rows = (num_kv_heads, S.num_rows(num_blocks, block_size), S.LANES)
  if quant and (tuple(k_scales.shape) != rows or tuple(v_scales.shape) != rows):
    raise ValueError(f"k_scales / v_scales must be scale rows f32{list(rows)} (the form "
                     f"kept in place, tpu/scales.py), got {list(k_scales.shape)}")
  if block_size % GROUP_ROWS:
    raise ValueError(f"block_size={block_size} must be a multiple of {GROUP_ROWS}")
  runs = _runs(slots.astype(jnp.int32), num_blocks * block_size)
  hbm = pl.BlockSpec(memory_space=pltpu.HBM)
  dtype = k_pages.dtype
  scratch = [pltpu.VMEM((2, 2, num_kv_heads, GROUP_ROWS, head_dim), dtype),
             pltpu.VMEM((2, 2, GROUP_ROWS, num_kv_heads, head_dim), k_new.dtype)]
  operands = [k_new, v_new, k_pages, v_pages]
  out_shape = [jax.ShapeDtypeStruct(k_pages.shape, dtype)] * 2
  if quant:
    scratch.append(pltpu.VMEM((2, num_kv_heads, 1, S.LANES), jnp.float32))
    operands += [k_scales, v_scales]
    out_shape += [jax.ShapeDtypeStruct(k_scales.shape, jnp.float32)] * 2
  scratch.append(pltpu.SemaphoreType.DMA((2, 2)))
  if quant:
    scratch.append(pltpu.SemaphoreType.DMA(()))
  operands = [attention_kernel.in_hbm(x) for x in operands]
  first = len(runs) + 2                         # operand index of k_pages (after k/v_new)
  aliases = {first + i: i for i in range(len(out_shape))}
  from pallas_kernels.tpu.paged_attention import interpret_params  # pylint: disable=g-import-not-at-top
  # Per token: its new K and V rows read, its page rows read (the group merge) and written,
  # and its scales (quantized pages) read and written; whole groups at run ends are not
  # counted (at most two groups a run).
  num_tokens = slots.shape[0]
  rows = 2 * num_tokens * num_kv_heads * (head_dim * jnp.dtype(dtype).itemsize
                                          + (4 if quant else 0))
  new_bytes = (k_new.size + v_new.size) * jnp.dtype(k_new.dtype).itemsize
  cost = common.copy_cost(new_bytes + 4 * num_tokens + rows, rows)
  return tuple(pl.pallas_call(
      functools.partial(_kernel, block_size=block_size, quant=quant),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(runs), grid=(1,), in_specs=[hbm] * len(operands),
          out_specs=[hbm] * len(out_shape), scratch_shapes=scratch),
      out_shape=out_shape, input_output_aliases=aliases, cost_estimate=cost,
      interpret=interpret_params(interpret), name="tpu_kv_write")(*runs, *operands))
