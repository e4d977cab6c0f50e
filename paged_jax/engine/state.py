"""The pytrees the engine's jitted step takes and returns: its device state
(`EngineState`, donated into every step), one step's plan as fixed-shape arrays
(`StepInputs`, checked with chex at trace time by `check_inputs`) and what comes back
(`StepOutputs`). The step itself is in step.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import chex
import flax
import jax
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import kv_cache
from paged_jax.engine.params import MAX_STOP_IDS
from paged_jax import prefix_cache as pc
from paged_jax.prefix_cache import step as prefix_step


@flax.struct.dataclass
class KVGroup:
  """One KV group: the layers that share a block table (vLLM v1's KV cache group).

  Attributes:
    blocks: its BlockState (block tables, ref counts, free stack); every group has the
      same slots and lengths.
    pages: its KVPages, [num_layers_in_group, kv_heads, num_blocks, block_size, D].
    window: its keep rule, static: 0 keeps every block (full attention); W > 0 keeps
      only the blocks inside a W-token sliding window (`paged_jax.block_window`), and a
      prefix hit needs only those (`prefix_cache.sliding`).
  """
  blocks: bm.BlockState
  pages: kv_cache.KVPages
  window: int = flax.struct.field(pytree_node=False, default=0)


@flax.struct.dataclass
class EngineState:
  """Everything the device keeps between steps (donated into every step).

  Attributes:
    groups: the KV groups, a tuple of KVGroup: [0] the full-attention layers' (the one
      the prefix cache hashes and the host plans with), then, with hybrid KV
      (`CacheConfig.sliding_layers`), the sliding-window layers' (its pool sized so it
      never runs short: `CacheConfig.sliding_pool`).
    prefix: the prefix cache's `PrefixStepState` (None without prefix caching).
  """
  groups: Tuple[KVGroup, ...]
  prefix: Any = None

  @property
  def blocks(self) -> bm.BlockState:
    """The full-attention group's BlockState (group 0)."""
    return self.groups[0].blocks

  @property
  def pages(self) -> kv_cache.KVPages:
    """The full-attention group's KVPages (group 0)."""
    return self.groups[0].pages

  def with_full(self, blocks=None, pages=None, **fields) -> "EngineState":
    """This state with group 0's `blocks` / `pages` (those given) and other `fields`."""
    g = self.groups[0]
    g = g.replace(blocks=g.blocks if blocks is None else blocks,
                  pages=g.pages if pages is None else pages)
    return self.replace(groups=(g,) + tuple(self.groups[1:]), **fields)


def init_state(cache_config, *, scale_rows: bool = False, **prefix_kwargs) -> EngineState:
  """An empty EngineState (prefix state iff `cache_config.enable_prefix_caching`; the
  sliding group iff hybrid KV). `scale_rows`: int8 / fp8 scales held as scale rows, the
  TPU kernels' layout (`kv_cache.scale_rows_for(attention_backend)`)."""
  prefix = (prefix_step.init(cache_config, **prefix_kwargs)
            if cache_config.enable_prefix_caching else None)
  groups = [KVGroup(bm.init(cache_config), kv_cache.init(cache_config, scale_rows=scale_rows))]
  if cache_config.hybrid:
    groups.append(KVGroup(bm.init(cache_config.sliding_pool()),
                          kv_cache.init_sliding(cache_config, scale_rows=scale_rows),
                          window=cache_config.sliding_window))
  return EngineState(groups=tuple(groups), prefix=prefix)


def _field(dims, fill=0, dtype=np.int32):
  """A StepInputs field: its shape in the step's dimensions (T tokens, R rows, S slots,
  LK lookup tokens, or ints), its dtype, and the value of an unused entry (padding)."""
  return flax.struct.field(metadata=dict(dims=dims, fill=fill, dtype=np.dtype(dtype)))


@flax.struct.dataclass
class StepInputs:
  """One step's plan as fixed-shape arrays (T tokens, R rows, S slots). Each field's
  shape, dtype and padding value are declared here once (`_field`); `empty_inputs`
  and `check_inputs` read them.

  Token level [T]: tokens, positions, token_row (row of each token, -1 = padding),
    target_tokens (the prompt token after this one, whose log-probability the step
    reports when its `logprobs` variant runs; -1 = none).
  Row level [R] (the row bucket, >= the rows and >= the sampled slots): row_slot
    (slot of each attention row, -1 = padding; live rows first), row_q_len (new
    tokens of the row).
  Fork lanes [R] (used lanes first, -1 pad; the host sizes R to hold them, so a
    fork costs what is forked, not max_seqs): fork_src/fork_dst (beam forks, before
    the reservations), post_fork_src/post_fork_dst (parallel-sampling children
    forked from their leader after the prefill).
  Slot level [S]: free_slots (-1 pad), alloc_tokens (> 0: allocate that many
    tokens in this inactive slot), append_tokens (> 0: append; at most R slots
    allocate or append), sample_row (-1: no sample), temperature, top_k, top_p, seed,
    sample_index (tokens generated so far), remaining (tokens the sequence may still
    generate, >= 1 where sampling), stop_ids
    [S, MAX_STOP_IDS] (-1 pad), multi_step (not beam search: the device decides when
    the sequence finishes; it may continue in the decode loop and is freed by the step
    that finishes it).
  Prefix caching (lanes [S], used lanes first): attach_slot (-1 pad),
    attach_len, attach_start (offset in attach_tokens i32[LK], the packed prompts),
    attach_root u32[S, 2] / attach_tag (the request's cache salt,
    `prefix_cache.salt_key`).
  Speculative decoding: spec_len [S], draft tokens in the slot's row after its first
    token (0: none; the step's `spec` variant reads them).
  """
  tokens: jax.Array = _field(("T",))
  positions: jax.Array = _field(("T",))
  token_row: jax.Array = _field(("T",), -1)
  target_tokens: jax.Array = _field(("T",), -1)
  row_slot: jax.Array = _field(("R",), -1)
  row_q_len: jax.Array = _field(("R",))
  free_slots: jax.Array = _field(("S",), -1)
  fork_src: jax.Array = _field(("R",), -1)
  fork_dst: jax.Array = _field(("R",), -1)
  alloc_tokens: jax.Array = _field(("S",))
  append_tokens: jax.Array = _field(("S",))
  sample_row: jax.Array = _field(("S",), -1)
  post_fork_src: jax.Array = _field(("R",), -1)
  post_fork_dst: jax.Array = _field(("R",), -1)
  temperature: jax.Array = _field(("S",), 0.0, np.float32)
  top_k: jax.Array = _field(("S",))
  top_p: jax.Array = _field(("S",), 1.0, np.float32)
  seed: jax.Array = _field(("S",))
  sample_index: jax.Array = _field(("S",))
  remaining: jax.Array = _field(("S",), 1)
  stop_ids: jax.Array = _field(("S", MAX_STOP_IDS), -1)
  multi_step: jax.Array = _field(("S",), False, np.bool_)
  attach_slot: jax.Array = _field(("S",), -1)
  attach_len: jax.Array = _field(("S",))
  attach_start: jax.Array = _field(("S",))
  attach_tokens: jax.Array = _field(("LK",))
  attach_root: jax.Array = _field(("S", 2), np.asarray(pc.ROOT_HASH, np.uint32), np.uint32)
  attach_tag: jax.Array = _field(("S",))
  spec_len: jax.Array = _field(("S",))


def _input_shape(field, sizes) -> tuple:
  return tuple(sizes[d] if isinstance(d, str) else d for d in field.metadata["dims"])


def empty_inputs(num_tokens: int, max_seqs: int, lookup_len: int,
                 num_rows: Optional[int] = None) -> Dict[str, np.ndarray]:
  """Numpy arrays of a step that does nothing (every entry padding); R = num_rows
  (default max_seqs)."""
  sizes = dict(T=num_tokens, R=max_seqs if num_rows is None else num_rows, S=max_seqs,
               LK=lookup_len)
  return {f.name: np.full(_input_shape(f, sizes), f.metadata["fill"], f.metadata["dtype"])
          for f in dataclasses.fields(StepInputs)}


@flax.struct.dataclass
class StepOutputs:
  """ok: bool[] (False: reservation failed, nothing changed); status i32[S] of the
  first reservation; tokens i32[K, S] and valid bool[K, S] (token of slot s at
  decode iteration k); logprobs f32[K, S] (the sampled token's log-probability under
  the model's distribution, where valid); topk_logprobs f32[S, C] / topk_ids i32[S, C] (candidates
  from the first iteration's logits); num_free i32[] after the step;
  loop_out_of_blocks bool[] (the decode loop stopped for want of a block);
  available i32[]: free plus evictable (cached, unreferenced) blocks, what the
  next plan may use; hit_tokens i32[S] per slot (attached this step); num_evictable i32[];
  prefix_hit_blocks / prefix_query_blocks i32[] (running totals, 0 without caching);
  sole_blocks i32[S]: blocks only that slot references (with caching, besides the
  cache's own reference): what freeing the slot alone makes available;
  cow_copies i32[]: copy-on-write block copies the step made (decode loop included);
  finished bool[S]: `multi_step` slots whose sequence finished (stop id, max_tokens) in
  this step, which the step freed (effect 9); sliding_free i32[]: free blocks of the
  hybrid-KV sliding pool after the step (0 without hybrid KV); kv_log i32[E, 5] /
  kv_log_len i32[]: the prefix cache's event log since the last step read it (rows past E
  dropped; E = 0 without caching: `prefix_cache.events`); emitted i32[S]: tokens the
  first iteration emitted per slot (1 where sampled; with speculative drafts, the accepted
  ones + 1), before the decode loop's.

  The step's `logprobs` variant also fills (L = MAX_LOGPROBS there, else 0; T' = T there,
  else 0): top_logprobs f32[K, S, L] / top_ids i32[K, S, L], each sampled token's
  position's best alternatives; prompt_logprobs f32[T'], the log-probability of each
  token's `target_tokens` entry, with prompt_top_logprobs f32[T', L] / prompt_top_ids
  i32[T', L] its position's best alternatives, and prompt_slot / prompt_pos i32[T'] the
  slot and position of that token (-1 where no target): tokens move inside the step
  (prefix hits are taken out), so the host finds them by slot and position."""
  ok: jax.Array
  status: jax.Array
  tokens: jax.Array
  valid: jax.Array
  logprobs: jax.Array
  topk_logprobs: jax.Array
  topk_ids: jax.Array
  num_free: jax.Array
  loop_out_of_blocks: jax.Array
  available: jax.Array
  hit_tokens: jax.Array
  num_evictable: jax.Array
  prefix_hit_blocks: jax.Array
  prefix_query_blocks: jax.Array
  sole_blocks: jax.Array
  cow_copies: jax.Array
  finished: jax.Array
  sliding_free: jax.Array
  kv_log: jax.Array
  kv_log_len: jax.Array
  top_logprobs: jax.Array
  top_ids: jax.Array
  prompt_logprobs: jax.Array
  prompt_top_logprobs: jax.Array
  prompt_top_ids: jax.Array
  prompt_slot: jax.Array
  prompt_pos: jax.Array
  emitted: jax.Array


def check_inputs(inp: StepInputs, max_seqs: int) -> None:
  """chex, at trace time (free at run time): every StepInputs array has its declared
  shape and dtype for T tokens, R <= max_seqs rows, S = max_seqs slots and LK lookup
  tokens."""
  r = inp.row_slot.shape[0]
  sizes = dict(T=inp.tokens.shape[0], R=r, S=max_seqs, LK=inp.attach_tokens.shape[0])
  for f in dataclasses.fields(StepInputs):
    x = getattr(inp, f.name)
    chex.assert_shape(x, _input_shape(f, sizes), custom_message=f"StepInputs.{f.name}")
    chex.assert_type(x, f.metadata["dtype"], custom_message=f"StepInputs.{f.name}")
  if not 1 <= r <= max_seqs:
    raise ValueError(f"StepInputs has {r} rows; the row bucket must be in [1, {max_seqs}]")
