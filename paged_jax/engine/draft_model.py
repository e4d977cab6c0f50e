"""Speculative decoding's `draft_model` proposer: a smaller paged model drafts k tokens.

    Engine(mc, params, cc, speculative_config={"method": "draft_model",
                                               "model": (draft_mc, draft_params),
                                               "num_speculative_tokens": 3})

Design (after vLLM v1's draft-model proposer): the draft model's K/V live in pages of
their own, `DraftModel.pages` ([draft layers, kv heads, num_blocks, block_size, D]),
indexed by the SAME block tables as the target's full-attention group (group 0): position
p of the sequence in slot s is at `block_tables[s, p // B]`, offset p % B, in both. So
the draft needs no allocator: its KV group is pages only, sharing group 0's BlockState.

One extra jitted dispatch per step (`propose`), before the target's plan, for the
sequences that may draft this step (`planning.may_draft`): it catches the draft's KV up
over each sequence's tokens from `computed` (positions whose draft K/V are in the pages)
to its last token, then runs k - 1 single-token iterations, each drafting the argmax
(greedy drafts; the target's `verify` runs rejection sampling for point-mass drafts, so
sampled rows keep the target's distribution). Positions past the target's computed
length (the last token, the drafts) need blocks the sequence does not hold yet: the
dispatch appends all k at once to a local copy of group 0's BlockState (the real one is
read, not donated, and never changes; a row whose append fails drafts nothing), so that
scratch K/V goes to blocks free in the real state or to the sequence's own partial last
block; the next catch-up overwrites it. A sequence's `computed` is therefore its target's
computed length after a full catch-up (the blocks under it are its own and stay so while
it runs); a new or preempted one starts at 0, or at its leading blocks whose draft K/V are
whole (prefix caching: `mark_whole`, `reusable`). The drafts only steer acceptance:
outputs are the target's whatever the draft K/V hold. Catch-up is chunked: at most
`catchup_tokens` tokens a dispatch (the target's budget), in order of the running queue;
a sequence that does not fit catches up partly and drafts later.

Not supported (one-line ValueErrors at construction or when a request is added): hybrid
KV (sliding-window models), preemption_mode "swap", decode_steps_per_sync > 1, n > 1
(parallel samples share blocks by copy-on-write, which copies only the target's pages),
quantized KV. Beams, and requests with logprobs, decode without drafts (as with ngram).

Shapes: S slots, R = S rows (one per slot), T catch-up tokens (a power-of-two bucket),
k = num_speculative_tokens, V the shared vocabulary.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Dict, List, Optional, Tuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import kv_cache
from paged_jax.config import OK
from paged_jax.engine import forward as forward_lib
from paged_jax.checks import consumed
from paged_jax.engine.commit import sigint_deferred
from paged_jax.engine.draft_reuse import mark_whole, reusable
from pallas_kernels.common import next_pow2

_I32 = jnp.int32


def load_model(model) -> Tuple[Any, Any]:
  """(ModelConfig, params) of `speculative_config["model"]`: such a pair, or a Hugging
  Face checkpoint directory."""
  from paged_jax.config import ModelConfig  # pylint: disable=g-import-not-at-top
  if isinstance(model, str):
    import os  # pylint: disable=g-import-not-at-top
    from paged_jax import models  # pylint: disable=g-import-not-at-top
    if not os.path.isdir(model):
      raise ValueError(f"speculative_config['model']: no checkpoint directory {model!r}")
    return models.load_hf_checkpoint(model)
  if (isinstance(model, (tuple, list)) and len(model) == 2
      and isinstance(model[0], ModelConfig)):
    return tuple(model)
  raise ValueError("speculative_config['model'] must be (ModelConfig, params) or a "
                   f"checkpoint directory, got {type(model).__name__}")


def truncated(model_config, params, num_layers: int):
  """(ModelConfig, params) of the first `num_layers` decoder layers of a Llama-layout model
  (its embeddings, final norm and head kept): a draft sharing the target's vocabulary."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  if not 1 <= num_layers <= model_config.num_layers:
    raise ValueError(f"num_layers must be in [1, {model_config.num_layers}], got {num_layers}")
  tree = params["params"] if "params" in params else params
  model = {k: v for k, v in tree["model"].items()
           if not k.startswith("layers_") or int(k.split("_")[1]) < num_layers}
  return (dataclasses.replace(model_config, num_layers=num_layers),
          {"params": {**tree, "model": model}})


def check_supported(model_config, draft_config, cache_config, options) -> None:
  """One-line ValueErrors for the combinations the draft_model proposer refuses."""
  if draft_config.vocab_size != model_config.vocab_size:
    raise ValueError(f"speculative_config['model']: the draft model's vocab_size="
                     f"{draft_config.vocab_size} must equal the target's "
                     f"{model_config.vocab_size} (one vocabulary)")
  if cache_config.hybrid or draft_config.sliding_layers or model_config.sliding_layers:
    raise ValueError("speculative_config['method']='draft_model' does not support "
                     "sliding-window (hybrid KV) models; use 'ngram'")
  if options.preemption_mode == "swap":
    raise ValueError("speculative_config['method']='draft_model' needs preemption_mode "
                     "'recompute' or 'auto', got 'swap'")
  if options.decode_steps_per_sync != 1:
    raise ValueError("speculative_config['method']='draft_model' needs "
                     f"decode_steps_per_sync=1, got {options.decode_steps_per_sync}")
  if cache_config.quantized:
    raise ValueError("speculative_config['method']='draft_model' does not support a "
                     f"quantized KV cache (dtype {cache_config.dtype})")


def make_propose(apply_fn, k: int):
  """The jitted proposal: (params, pages, valid_gen, blocks, block_meta, inp) -> (drafts
  i32[R, k], ok bool[R], pages, valid_gen). `blocks` is group 0's BlockState and
  `block_meta` the prefix cache's (read only; None, and `valid_gen` None, without prefix
  caching: see `mark_whole`); `inp` a dict of
    tokens, positions, token_row: i32[T] (catch-up tokens, packed by row; -1 rows pad),
    row_slot: i32[R] (S or -1: no row), row_q_len: i32[R], row_start: i32[R] (the row's
    first position), drafting: bool[R] (the row's catch-up ends at its last token: it
    drafts; else it only writes K/V under the target's computed length).
  `pages` is donated."""

  def propose(params, pages, valid_gen, blocks, block_meta, inp):
    s_max = blocks.max_seqs
    row_slot, drafting = inp["row_slot"], inp["drafting"]
    rows = row_slot.shape[0]
    rs = jnp.clip(row_slot, 0, s_max - 1)
    live_row = row_slot >= 0

    # Scratch positions for the drafting rows' last token and their k - 1 drafts, all
    # appended once to the local copy of group 0's allocator (a row whose append fails
    # drafts nothing); attention reads each row's own length (`kv_lens`), not seq_lens.
    mask = jnp.any((lax.iota(_I32, s_max)[:, None] == rs[None, :])
                   & (drafting & live_row)[None, :], axis=1)             # [S], no scatter
    b, status, cow = bm.append(blocks, mask, k)
    ok = drafting & live_row & (status[rs] == OK)
    pages = kv_cache.copy_blocks(pages, jnp.where(ok[:, None], cow[rs], -1))

    # Catch-up over the rows' tokens since their last one.
    meta = forward_lib.build_metadata(b, row_slot, inp["row_q_len"], inp["token_row"],
                                      inp["positions"])
    kv_lens = jnp.where(live_row, inp["row_start"] + inp["row_q_len"], 0)
    meta = meta.replace(kv_lens=kv_lens)
    logits, pages = apply_fn(params, inp["tokens"], inp["positions"], pages, meta)
    tok = jnp.argmax(logits, axis=-1).astype(_I32)                     # [R]
    if block_meta is not None:
      valid_gen = mark_whole(valid_gen, block_meta, blocks, rs, kv_lens)

    # The k - 1 iterations run on the drafting rows packed into the first rows, one token
    # each (ragged layout: a row's tokens start at its cu_q_lens offset). A fixed trip
    # count with no allocator op inside, as found by compiling for an H200: unrolled in
    # Python the loop copied the whole pool around each forward (jax 0.10.2); an append
    # per iteration made jax 0.11.2's sm_90 compile fail on a register-spilling kernel.
    order = jnp.argsort(~ok, stable=True).astype(_I32)
    packed = ok[order]
    slot_p = jnp.where(packed, row_slot[order], -1)
    token_row = jnp.where(packed, lax.iota(_I32, rows), -1)
    col = lax.iota(_I32, k)[None, :]

    def body(i, carry):
      pages, tok_p, pos_p, drafts_p = carry
      meta = forward_lib.build_metadata(b, slot_p, packed.astype(_I32), token_row, pos_p)
      meta = meta.replace(kv_lens=jnp.where(packed, pos_p + 1, 0), decode_only=True)
      logits, pages = apply_fn(params, tok_p, pos_p, pages, meta)
      tok_p = jnp.argmax(logits, axis=-1).astype(_I32)
      drafts_p = jnp.where(col == i + 1, tok_p[:, None], drafts_p)
      return pages, tok_p, pos_p + 1, drafts_p

    tok_p = tok[order]
    drafts_p = jnp.where(col == 0, tok_p[:, None], 0)
    # pos: the first draft's position (the catch-up's last token is at kv_lens - 1).
    pages, _, _, drafts_p = lax.fori_loop(0, k - 1, body,
                                          (pages, tok_p, kv_lens[order], drafts_p))
    inverse = jnp.argsort(order)
    drafts = drafts_p[inverse]
    return drafts, ok, pages, valid_gen

  return jax.jit(propose, donate_argnums=(1,))


def for_engine(model_config, cache_config, options) -> Optional["DraftModel"]:
  """The engine's DraftModel under `{"method": "draft_model", ...}`, else None."""
  spec = options.speculative_config
  if spec is None or spec.method != "draft_model":
    return None
  return DraftModel(model_config, cache_config, options, spec)


def _draft_cache(draft_config, cache_config):
  """The draft model's page shapes on the target's group-0 geometry (same block ids)."""
  c = cache_config
  return draft_config.cache_config(
      hybrid_kv=False, block_size=c.block_size, num_blocks=c.num_blocks, max_seqs=c.max_seqs,
      max_blocks_per_seq=c.max_blocks_per_seq)


class DraftModel:
  """The draft model, its pages and the host's record of what they hold.

  Attributes:
    config, params: the draft model's ModelConfig and weights.
    k: num_speculative_tokens.
    pages: its KVPages on group 0's block ids.
    computed: seq_id -> (num_preemptions when recorded, positions whose draft K/V are in
      the pages).
    drafts: seq_id -> (its length then, k draft ids), from the last `prepare`
      (`for_seq` gives them to the planner).
    valid_gen: with prefix caching, i32[NB] (`mark_whole`), else None.
    reuse_prefix: a new sequence's catch-up skips its leading blocks whose draft K/V are
      whole (`reusable`: one small dispatch and sync a step that has such sequences).
    stats: "dispatches", "catchup_tokens", "drafting_rows", "reused_tokens".
    timing: wall seconds, "prepare_s" (all of `prepare`: host work, the dispatch, its
      sync) and "dispatch_s" (the jitted call until its drafts are on the host).

  Faults (tests/draft_model_faults_test.py): an exception in `prepare` changes no record
  but `drafts` (emptied) and `computed` (it may lag the pages: redone); if the failed
  dispatch took the donated pages, they, `computed` and `valid_gen` start empty.
  """

  def __init__(self, model_config, cache_config, options, spec):
    from paged_jax.engine.weights import check_params  # pylint: disable=g-import-not-at-top
    self.config, params = load_model(spec.model)
    check_supported(model_config, self.config, cache_config, options)
    self.params = check_params(self.config, params)
    self.k = spec.num_speculative_tokens
    self.cache_config = _draft_cache(self.config, cache_config)
    self.pages = kv_cache.init(self.cache_config)
    self.valid_gen = (jnp.full((cache_config.num_blocks,), -1, _I32)
                      if cache_config.enable_prefix_caching else None)
    self.reuse_prefix = True
    self.catchup_tokens = options.max_num_batched_tokens
    self._propose = _proposer(self.config, options.attention_backend, self.k)
    self.computed: Dict[int, Tuple[int, int]] = {}
    self.drafts: Dict[int, tuple] = {}
    self.stats = collections.Counter()
    self.timing = collections.Counter()

  def for_seq(self, seq, k: int) -> tuple:
    """Up to k drafts for `seq`, if the last `prepare` drafted at its current length."""
    length, drafts = self.drafts.get(seq.seq_id, (-1, ()))
    return drafts[:k] if length == len(seq.tokens) else ()

  def prepare(self, state, sched) -> None:
    """Drafts for every sequence that may draft in the next plan (one dispatch, one
    sync; none when no sequence may draft). `state`: the engine's EngineState (read)."""
    t0 = time.perf_counter()
    try:
      self._prepare(state, sched)
    finally:
      self.timing["prepare_s"] += time.perf_counter() - t0

  def _reuse(self, state, cand) -> None:
    """Records, for each candidate the draft holds nothing of, its reusable prefix."""
    new = [(g, q) for g, q in cand if self.computed.get(q.seq_id, (-1,))[0]
           != g.num_preemptions and q.num_computed >= self.cache_config.block_size]
    if not new or self.valid_gen is None or not self.reuse_prefix:
      return
    row_slot, limit = (np.full((self.cache_config.max_seqs,), v, np.int32) for v in (-1, 0))
    for r, (g, q) in enumerate(new):
      row_slot[r], limit[r] = q.slot, q.num_computed
    got = np.asarray(reusable(self.valid_gen, state.prefix.cache.block_meta,
                              state.blocks.block_tables, row_slot, limit,
                              block_size=self.cache_config.block_size))
    for r, (g, q) in enumerate(new):
      self.computed[q.seq_id] = (g.num_preemptions, int(got[r]))
      self.stats["reused_tokens"] += int(got[r])

  def _prepare(self, state, sched) -> None:
    from paged_jax.engine import planning  # pylint: disable=g-import-not-at-top
    from paged_jax.engine.sequence import SeqState  # pylint: disable=g-import-not-at-top
    self.drafts = {}
    cand = [(g, q) for g in sched.running for q in g.seqs
            if q.state is SeqState.RUNNING and q.slot >= 0
            and len(q.tokens) - q.num_computed == 1 and planning.may_draft(sched, g, q) > 0]
    if not cand:
      return
    live = {q.seq_id for g in sched.running for q in g.seqs}
    self.computed = {i: v for i, v in self.computed.items() if i in live}
    self._reuse(state, cand)
    blocks = state.blocks
    s_max = blocks.block_tables.shape[0]
    tokens: List[int] = []
    positions: List[int] = []
    token_row: List[int] = []
    row_slot = np.full((s_max,), -1, np.int32)
    row_q_len = np.zeros((s_max,), np.int32)
    row_start = np.zeros((s_max,), np.int32)
    drafting = np.zeros((s_max,), bool)
    rows: List[Tuple[Any, Any, int, bool]] = []
    room = self.catchup_tokens
    for g, q in cand:
      if room <= 0:
        break
      tag, done = self.computed.get(q.seq_id, (g.num_preemptions, 0))
      done = done if tag == g.num_preemptions else 0
      n = min(len(q.tokens) - done, room)
      full = done + n == len(q.tokens)
      r = len(rows)
      tokens += q.tokens[done:done + n]
      positions += range(done, done + n)
      token_row += [r] * n
      row_slot[r], row_q_len[r], row_start[r], drafting[r] = q.slot, n, done, full
      rows.append((g, q, done + n if not full else q.num_computed, full))
      room -= n
    t = max(16, next_pow2(len(tokens)))    # a power-of-two bucket of catch-up tokens
    pad = t - len(tokens)
    inp = dict(tokens=np.asarray(tokens + [0] * pad, np.int32),
               positions=np.asarray(positions + [0] * pad, np.int32),
               token_row=np.asarray(token_row + [-1] * pad, np.int32),
               row_slot=row_slot, row_q_len=row_q_len, row_start=row_start,
               drafting=drafting)
    t0 = time.perf_counter()
    with sigint_deferred():   # the donated pages and the new ones: never neither held
      try:
        drafts, ok, pages, valid = self._propose(
            self.params, self.pages, self.valid_gen, blocks,
            None if self.valid_gen is None else state.prefix.cache.block_meta, inp)
      except BaseException:   # e.g. KeyboardInterrupt: donated pages may be gone
        if consumed(self.pages):   # their records go too: every sequence catches up anew
          self.pages, self.computed = kv_cache.init(self.cache_config), {}
          self.valid_gen = None if self.valid_gen is None else jnp.full_like(self.valid_gen, -1)
        raise
      self.pages, self.valid_gen = pages, valid
    # The sync, interruptible: the pages above are whole, `computed` then lags them.
    drafts, ok = np.asarray(drafts), np.asarray(ok)
    self.timing["dispatch_s"] += time.perf_counter() - t0
    self.stats["dispatches"] += 1
    self.stats["catchup_tokens"] += len(tokens)
    for r, (g, q, done, full) in enumerate(rows):
      self.computed[q.seq_id] = (g.num_preemptions, done)
      if full and ok[r]:
        self.drafts[q.seq_id] = (len(q.tokens), tuple(int(x) for x in drafts[r]))
        self.stats["drafting_rows"] += 1


@functools.lru_cache(maxsize=16)
def _proposer(config, attention_backend: str, k: int):
  """One jitted proposal per (draft model, attention backend, k): engines of one draft
  model share its compiles."""
  from paged_jax.models.llama import LlamaForCausalLM  # pylint: disable=g-import-not-at-top
  return make_propose(LlamaForCausalLM(config, attention_backend=attention_backend).apply, k)


def propose_for_compile(draft_config, cache_config, *, k: int, num_tokens: int,
                        sharding=None, attention_backend: str = "auto"):
  """The jitted proposal and `jax.ShapeDtypeStruct` arguments for it (as
  `compile.step_for_compile` for the step): `fn.trace(*args).lower().compile()` compiles
  it for the device of `sharding` (which also decides "auto" attention) with nothing
  allocated. `cache_config` is the target's (group 0's geometry); T = `num_tokens`."""
  from paged_jax.engine import compile as engine_compile  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.weights import param_shapes  # pylint: disable=g-import-not-at-top
  from paged_jax.models.llama import LlamaForCausalLM  # pylint: disable=g-import-not-at-top
  c = cache_config
  draft_cache = _draft_cache(draft_config, c)
  if sharding is not None:
    attention_backend = engine_compile.step_backend(attention_backend, draft_config,
                                                    draft_cache, sharding)
  fn = make_propose(LlamaForCausalLM(draft_config, attention_backend=attention_backend).apply, k)
  i32 = lambda n, dtype=np.int32: jax.ShapeDtypeStruct((n,), dtype)
  s = c.max_seqs
  inp = dict(tokens=i32(num_tokens), positions=i32(num_tokens), token_row=i32(num_tokens),
             row_slot=i32(s), row_q_len=i32(s), row_start=i32(s), drafting=i32(s, np.bool_))
  from paged_jax import prefix_cache  # pylint: disable=g-import-not-at-top
  valid, meta = ((i32(c.num_blocks), jax.eval_shape(lambda: prefix_cache.init(c)).block_meta)
                 if c.enable_prefix_caching else (None, None))
  args = (param_shapes(draft_config), jax.eval_shape(lambda: kv_cache.init(draft_cache)),
          valid, jax.eval_shape(lambda: bm.init(c)), meta, inp)
  if sharding is not None:
    args = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
  return fn, args
