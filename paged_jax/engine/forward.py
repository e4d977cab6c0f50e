"""The model's side of the engine step: attention metadata for the step's packed rows over
its KV groups (the full-attention group, then hybrid KV's sliding one), and one forward
through `apply_fn` with the groups' pages. `step.make_step` calls these for its first
forward and each decode-loop iteration.

Shapes: S slots, R rows (the step's row bucket), T tokens, W block-table columns.
"""

from __future__ import annotations

import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax import block_window
from paged_jax import kv_cache
from paged_jax.attention import AttentionMetadata

_I32 = jnp.int32


def build_metadata(blocks: bm.BlockState, row_slot, row_q_len, token_row, positions,
                   width=None):
  """AttentionMetadata for packed rows (after the reservation of this step's tokens).

  row_slot / row_q_len: i32[R] (R = the step's row bucket, <= max_seqs); the block
  tables are the live rows' views `block_tables[row_slot, :width]` ([R, W], W = the
  width bucket, default max_blocks_per_seq): a gather of R x W ids, so attention
  reads only the blocks the bucket covers, and the full-size state is untouched.
  """
  s_max = blocks.max_seqs
  rows = row_slot.shape[0]
  width = blocks.max_blocks_per_seq if width is None else width
  live = row_slot >= 0
  rs = jnp.clip(row_slot, 0, s_max - 1)
  q_lens = jnp.where(live, row_q_len, 0)
  cu = jnp.concatenate([jnp.zeros((1,), _I32), jnp.cumsum(q_lens).astype(_I32)])
  token_slot = jnp.where(token_row >= 0, row_slot[jnp.clip(token_row, 0, rows - 1)], -1)
  return AttentionMetadata(
      slot_mapping=bm.token_slots(blocks, token_slot, positions),
      block_tables=blocks.block_tables[rs, :width],
      kv_lens=jnp.where(live, blocks.seq_lens[rs], 0),
      cu_q_lens=cu,
      num_seqs=jnp.sum(live).astype(_I32),
      logits_indices=jnp.maximum(cu[1:] - 1, 0))


def metadata(bs, row_slot, row_q_len, token_row, positions, width, decode_only):
  """The step's AttentionMetadata over the KV groups `bs` (BlockStates, the full-attention
  group first); with hybrid KV its `sliding` part reads the windowed group's tables
  (released entries as block 0)."""
  meta = build_metadata(bs[0], row_slot, row_q_len, token_row, positions,
                        width).replace(decode_only=decode_only)
  if len(bs) == 1:
    return meta
  sm = build_metadata(bs[1], row_slot, row_q_len, token_row, positions, width)
  sm = sm.replace(block_tables=block_window.attention_tables(sm.block_tables),
                  decode_only=decode_only)
  return meta.replace(sliding=sm)


def forward(apply_fn, params, tokens, positions, pgs, meta, sliding_layers):
  """(logits, the groups' pages) of one forward; with hybrid KV the model gets both
  groups' pages as one `kv_cache.HybridPages`."""
  if len(pgs) == 1:
    logits, pg = apply_fn(params, tokens, positions, pgs[0], meta)
    return logits, [pg]
  pages = kv_cache.HybridPages(full=pgs[0], sliding=pgs[1], sliding_layers=sliding_layers)
  logits, pages = apply_fn(params, tokens, positions, pages, meta)
  return logits, [pages.full, pages.sliding]
