"""THE engine step: one `jax.jit` doing block reservation, copy-on-write, KV
writes, attention and sampling, with the allocator state and the KV pages
donated. Multi-step decoding runs further decode steps in a fixed-trip
`lax.fori_loop` inside the same jit (block allocation included), so the host
syncs once per `num_decode_steps` tokens.

Order of device effects in one call: written here once; the scheduler plans with it,
and `sequence.Batch`, scheduler.py and docs/architecture.md point here.

  0. (host, before the call) swap-outs copy preempted groups' blocks to host memory,
     swap-ins restore swapped groups into fresh blocks (`swap.py`)
  1. free      `free_slots`                  (preempted / dropped / aborted sequences)
  2. fork      `fork_src -> fork_dst`        (beam search: new beams share a parent's blocks)
  2b. with prefix caching: attach the longest cached prefix of newly admitted
     prompts (`attach_*`; hits reported in `hit_tokens`), take the hit tokens out of
     their first chunks (planned from position 0: `prefix_cache.step.skip_hits`),
     then evict LRU cache-only blocks until the step's worst-case block need is free
     (with hybrid KV one hit length for both groups: `prefix_cache.sliding`)
  3. reserve   allocate first chunks, append later chunks (copy-on-write pairs)
     -> if any reservation fails, steps 3-9 are no-ops (frees, forks, attaches
        and evictions stand) and `ok` is False: the host commits those, preempts
        the newest group and plans the next step from the returned counts
  4. copy_blocks(cow), model forward (per layer: kv_cache.write, ragged attention)
  5. sample one token per slot from `sample_row` (n > 1 children sample from
     their leader's row), beam candidates (top-k log-probs)
  6. post-fork `post_fork_src -> slot`    (parallel sampling: children share the prompt)
  7. decode loop, iterations 1 .. num_decode_steps-1, for slots with
     `multi_step` set that have not finished (stop id / max_tokens): append one
     token each (if a block runs out the remaining iterations do nothing, state
     kept), forward, sample.
  8. with prefix caching: record the step's tokens, register newly full blocks;
     with hybrid KV: release the sliding pool's blocks out of every window
  9. free the `multi_step` slots that finished in 5-7 (stop id / max_tokens:
     `finished`), so the counts returned (and `Engine.metrics()`) are exact without
     another dispatch; beams finish by a host decision and are freed by step 1

Shapes: the state is full size (max_seqs S slots, max_blocks_per_seq P); per call
the work follows a shape bucket (T tokens, R rows, W block-table columns,
decode_only), chosen by the host from what is live (`buckets.StepBuckets`), so
attention and sampling cost what is live, not what S and P allow; so do forks,
allocations and copy-on-write copies, which run on R lanes (every reserving or forked
slot is a row). Frees, appends' planning and the outputs stay slot-wide. The step
traces once per bucket; `TRACE_COUNT` counts traces for the no-retracing tests.

KV groups: the step holds its pools as a list (`bs` BlockStates, `pgs` pages): the
full-attention group first (the one the prefix cache hashes), then, with hybrid KV
(`CacheConfig.sliding_layers`), the sliding-window layers' group (`state.groups`, each
a `KVGroup`: its BlockState, pages and keep rule, `window`). Every free, fork, reservation and decode-loop append runs on each
group alike (a reservation fails if any group's does, and then none changes), each with
its own copy-on-write pairs and metadata (`AttentionMetadata.sliding`); at the end of the
step a windowed group gives back the blocks that slid out of every window
(`block_window`), but for the companions of cached blocks (`prefix_cache.sliding`). The
host plans with the full-attention group's counts only: the sliding pool is sized so it
cannot run short. (vLLM v1's KVCacheCoordinator over per-type managers is the model.)
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp

from paged_jax import block_manager as bm
from paged_jax import block_window
from paged_jax import kv_cache
from paged_jax.config import INVALID, OK
from paged_jax.engine import decode
from paged_jax.engine import forward as forward_lib
from paged_jax.engine import sampling
from paged_jax.engine import speculative
from paged_jax.engine.params import MAX_LOGPROBS
from paged_jax.engine.state import (EngineState, StepInputs, StepOutputs, check_inputs,
                                    init_state)
from paged_jax.prefix_cache import state as prefix_state
from paged_jax.prefix_cache import step as prefix_step

_I32 = jnp.int32
TRACE_COUNT = collections.Counter()   # name -> traces of jitted engine functions
__all__ = ["EngineState", "StepInputs", "StepOutputs", "TRACE_COUNT", "init_state",
           "make_step", "sole_blocks"]


def sole_blocks(blocks: bm.BlockState, cached=None) -> jax.Array:
  """i32[S]: per slot, the blocks of its table that no other slot references (and,
  `cached` bool[num_blocks] given, counting the prefix cache's reference as none),
  i.e. the blocks a free of that slot alone returns to free + evictable."""
  table = blocks.block_tables
  held = table >= 0
  ids = jnp.where(held, table, 0)
  refs = blocks.ref_count[ids]
  if cached is not None:
    refs = refs - cached[ids].astype(refs.dtype)
  return jnp.sum((held & (refs == 1)).astype(_I32), axis=1)


def _first_failure(statuses):
  """i32[S]: per slot, the first group's status that is not OK (OK if none)."""
  out = statuses[-1]
  for st in statuses[-2::-1]:
    out = jnp.where(st == OK, out, st)
  return out


def _reserve(b: bm.BlockState, inp: StepInputs, alloc_lane, num_tokens: int):
  """One pool's reservations: allocations on the R lanes `alloc_lane` (slots, S = none),
  then appends. Returns (state, status i32[S] (OK where nothing was asked), cow i32[S, 2])."""
  s_max = b.max_seqs
  alloc, grow = inp.alloc_tokens > 0, inp.append_tokens > 0
  b, st_lane = bm.allocate(
      b, jnp.where(alloc_lane < s_max, alloc_lane, -1),
      jnp.maximum(inp.alloc_tokens[jnp.clip(alloc_lane, 0, s_max - 1)], 1),
      max_num_tokens=num_tokens)
  st_alloc = jnp.full((s_max,), INVALID, _I32).at[alloc_lane].set(st_lane, mode="drop")
  b, st_append, cow = bm.append(b, grow, inp.append_tokens, max_new_tokens=num_tokens)
  return b, jnp.where(alloc, st_alloc, jnp.where(grow, st_append, OK)), cow


def _select(pred, on_true, on_false):
  """Elementwise pytree select by a scalar predicate (for the small BlockState)."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _cow_lanes(cow, num_lanes: int):
  """i32[num_lanes, 2]: the copy-on-write pairs of `cow` (i32[S, 2], (-1, -1) = none)
  packed into `num_lanes` lanes, so the page copy gathers that many blocks per layer,
  not max_seqs. Only appending slots copy, and they are the step's rows (or the
  decode loop's live slots), at most R of them."""
  lane = _lanes(cow[:, 0] >= 0, num_lanes)
  return jnp.where((lane < cow.shape[0])[:, None], cow[jnp.clip(lane, 0, cow.shape[0] - 1)], -1)


def _lanes(mask, num_lanes: int):
  """i32[num_lanes]: the slots where `mask` (bool[S]) holds, in slot order, padded with
  S (out of range: gathers clamp, `.at[...].set(mode="drop")` drops). The host sizes
  the row bucket so that every sampled slot gets a lane."""
  return jnp.nonzero(mask, size=num_lanes, fill_value=mask.shape[0])[0].astype(_I32)


def make_step(apply_fn: Callable[..., Any], *, num_decode_steps: int, num_candidates: int,
              name: str = "engine_step", max_evict: int = 0, jit: bool = True,
              sliding_layers: tuple = (), num_spec_tokens: int = 0):
  """Builds the jitted step.

  Args:
    apply_fn: (params, tokens i32[T], positions i32[T], pages, meta) ->
      (logits f32[R, vocab], pages), e.g. `LlamaForCausalLM(...).apply`.
    num_decode_steps: K >= 1, decode iterations per call (the first included).
    num_candidates: C, beam candidates returned per slot (<= vocab).
    max_evict: static bound on blocks evicted per step (prefix caching;
      `prefix_cache.step.max_new_blocks`).
    jit: False returns the plain function (for `jax.eval_shape` / tracing).
    sliding_layers: hybrid KV's sliding-window layers (`CacheConfig.sliding_layers`;
      used iff `state.groups` has a windowed group, whose `window` the state carries).
    num_spec_tokens: k, speculative decoding's drafts per row (0: off); its `spec`
      variant verifies them (`speculative.first_iteration`) and rolls back the rejected.

  Returns:
    step(params, state: EngineState, inputs: StepInputs, *, width=None,
    decode_only=False, all_greedy=False, prefix_light=False, prefix_admit_only=False,
    logprobs=False, spec=False) ->
    (EngineState, StepOutputs), jitted with `state` donated and the keywords static
    (`all_greedy`: every running request is greedy, so sampling is an argmax;
    `prefix_light`: with prefix caching, the host planned no free, fork, post-fork or
    admission, so the step leaves out the first release, the forks and their history
    copies, the lookup and `skip_hits`, all no-ops then but for the clock; eviction,
    registration and the finished slots' release still run; `prefix_admit_only`: the
    same without admission left out: the lookup and `skip_hits` run; `logprobs`: the
    model computes every token's logits, and the step reports the best MAX_LOGPROBS
    alternatives of each sampled token and each `target_tokens` entry's log-probability
    (`StepOutputs`): what requests with `SamplingParams.logprobs` / `prompt_logprobs`
    need; without it those outputs are empty; `spec`: some row carries draft tokens,
    `inputs.spec_len` of them: each row's logits are read at k + 1 positions, the drafts
    verified and the outputs max(K, k + 1) deep). The shape bucket of a
    call is (T tokens, R rows: `inputs.row_slot.shape`, W = `width` block-table columns
    attention reads, default max_blocks_per_seq; `decode_only`: every row has one new
    token, so attention runs the decode kernel). Prefix caching runs iff `state.prefix`
    is set.
  """

  def step(params, state: EngineState, inp: StepInputs, width=None, decode_only=False,
           all_greedy=False, prefix_light=False, prefix_admit_only=False, logprobs=False,
           spec=False):
    TRACE_COUNT[name] += 1
    ps = state.prefix
    # The KV groups, as lists: [0] the full-attention pool (the prefix cache's), then, with
    # hybrid KV, the sliding-window one. Every block op below runs on each group alike;
    # only the prefix cache's ops (group 0) and the end-of-step release rule differ.
    bs, pgs = [g.blocks for g in state.groups], [g.pages for g in state.groups]
    windows = [g.window for g in state.groups]   # 0: keeps every block
    s_max = bs[0].max_seqs
    check_inputs(inp, s_max)
    rows = inp.row_slot.shape[0]          # R: row bucket (live rows and sampled slots)

    # 1-2. frees, beam forks (and prefix attach / eviction): these always stand.
    hits = jnp.zeros((s_max,), _I32)
    light = ps is not None and prefix_light   # no free, fork or admission: skip them
    # No free or fork (maybe an admission): skip the first release and the fork copies.
    quiet = light or (ps is not None and prefix_admit_only)
    free_fork = lambda b: bm.fork(bm.free(b, inp.free_slots)[0], inp.fork_src,
                                  inp.fork_dst)[0]
    hybrid = len(bs) > 1
    bs = [bs[0]] + [free_fork(x) for x in bs[1:]]   # every group's slots free for attach
    if ps is None:
      b = free_fork(bs[0])
    elif light:
      b = bs[0]
    else:
      b = bs[0]
      if not quiet:
        ps, b = prefix_step.free(ps, b, inp.free_slots)
        b = bm.fork(b, inp.fork_src, inp.fork_dst)[0]
      ps, b, hits, *bs[1:] = prefix_step.attach(ps, b, inp.attach_slot, inp.attach_len,
                                                inp.attach_start, inp.attach_tokens,
                                                inp.attach_root, inp.attach_tag, *bs[1:])
      inp = prefix_step.skip_hits(inp, hits)
    if ps is not None:
      ps, b, *bs[1:] = prefix_step.evict_for(ps, b, inp, *bs[1:], max_evict=max_evict,
                                             num_decode_steps=num_decode_steps)
    bs = [b] + bs[1:]
    before = bs
    # 3. reservations, the same in every group (a reservation fails if any group's
    # does, and then none changes). Every reserving slot is one of the step's rows, so
    # allocations run on R lanes and the copy-on-write pairs fit R lanes; a plan with
    # more reserving slots than R is refused whole (INVALID), never cut short. A chunk
    # has at most T tokens: that static bound narrows both ops' pop windows.
    num_tokens = inp.tokens.shape[0]
    alloc = inp.alloc_tokens > 0
    grow = inp.append_tokens > 0
    alloc_lane = _lanes(alloc, rows)
    bs, statuses, cows = zip(*[_reserve(x, inp, alloc_lane, num_tokens) for x in bs])
    status = _first_failure(statuses)
    status = jnp.where((alloc | grow) & (jnp.sum(alloc | grow) > rows), INVALID, status)
    ok = jnp.all(status == OK)

    # A failed reservation must leave the state unchanged. Rather than a lax.cond
    # around the model (XLA then copies the donated KV pages every step: measured
    # 3 -> 94 ms/step going from 144 to 4096 blocks on CPU), the step is masked:
    # the old (small) BlockStates are selected, no row attends, no K/V is written.
    bs = [_select(ok, x, y) for x, y in zip(bs, before)]
    cows = [jnp.where(ok, c, -1) for c in cows]
    pgs = [kv_cache.copy_blocks(p, _cow_lanes(c, rows)) for p, c in zip(pgs, cows)]
    row_slot = jnp.where(ok, inp.row_slot, -1)
    token_row = jnp.where(ok, inp.token_row, -1)
    k_steps = num_decode_steps

    meta = forward_lib.metadata(bs, row_slot, inp.row_q_len, token_row, inp.positions,
                                width, decode_only)
    num_top = MAX_LOGPROBS if logprobs else 0                            # L
    row_last = meta.logits_indices                                       # [R]
    spec = spec and num_spec_tokens > 0
    if spec:   # k + 1 positions per row: [R * (k + 1)]
      row_last = speculative.logits_indices(meta.cu_q_lens, jnp.where(
          row_slot >= 0, inp.spec_len[jnp.clip(row_slot, 0, s_max - 1)], 0), num_spec_tokens)
    if logprobs:   # every token's logits (scores); each row samples from its last's
      meta = meta.replace(logits_indices=lax.iota(_I32, num_tokens))
    elif spec:
      meta = meta.replace(logits_indices=row_last)
    logits, pgs = forward_lib.forward(apply_fn, params, inp.tokens, inp.positions, pgs,
                                      meta, sliding_layers)        # [R rows or T tokens, V]
    scores = decode.prompt_scores(logits, inp, token_row, row_slot, num_top)
    if logprobs:
      logits = logits[row_last]                                  # [R or R * (k + 1), V]
    if spec:
      spec_logits = logits.reshape(rows, num_spec_tokens + 1, -1)       # [R, k + 1, V]
      logits = spec_logits[:, 0]
    sampled = (inp.sample_row >= 0) & ok
    # Sampling runs on R lanes (the sampled slots), not on all S slots.
    lane_slot = _lanes(inp.sample_row >= 0, rows)
    lane_logits = logits[jnp.clip(inp.sample_row[jnp.clip(lane_slot, 0, s_max - 1)],
                                  0, rows - 1)]                          # [R lanes, V]
    # A speculating slot's decode-loop tokens follow its emitted ones: iteration i writes
    # row i + offset (offset = emitted - 1, 0 for other slots), so outputs are K + k deep.
    offset = jnp.zeros((s_max,), _I32)
    decoded = decode.Decoded.empty(k_steps + num_spec_tokens if spec else k_steps, s_max,
                                   num_top)
    if spec:   # drafts verified; rejected ones rolled back in every group
      tok, decoded, done, emitted = speculative.first_iteration(
          spec_logits[jnp.clip(inp.sample_row[jnp.clip(lane_slot, 0, s_max - 1)], 0, rows - 1)],
          lane_slot, sampled, inp, meta.cu_q_lens, decoded, all_greedy)
      cut = jnp.where(sampled & (inp.spec_len > 0), inp.spec_len + 1 - emitted, 0)
      bs = [speculative.rollback(x, x.seq_lens - cut) for x in bs]
      offset = jnp.maximum(emitted - 1, 0)
    else:
      tok, decoded = decode.sample_iteration(0, lane_logits, lane_slot, sampled,
                                             jnp.zeros_like(inp.sample_row), inp, decoded,
                                             all_greedy)
    # Beam candidates: the first iteration's C best per sampled slot.
    topv, topi = decode.scatter_lanes(sampling.top_logprobs(lane_logits, num_candidates),
                                      lane_slot, s_max)
    bs = [bm.fork(x, jnp.where(ok, inp.post_fork_src, -1), inp.post_fork_dst)[0] for x in bs]
    if not spec:
      done = sampled & inp.multi_step & decode.finished(tok, inp.remaining, inp.stop_ids)
      emitted = sampled.astype(_I32)
    cont = sampled & inp.multi_step & ~done
    oob = jnp.zeros((), jnp.bool_)
    copies = jnp.sum(cows[0][:, 0] >= 0).astype(_I32)    # the full-attention group's

    if k_steps > 1:
      # A fixed trip count (k - 1 iterations, finished / out-of-blocks slots masked):
      # a data-dependent while condition makes XLA:GPU read the predicate back to the
      # host every iteration (tests/gpu_compile_model_test.py). Iterations after every
      # slot finished run on no live row: nothing is written or sampled.
      def body(i, carry):
        bs_cur, pgs_cur, last, cont, decoded, oob_before, copies, done = carry
        cont = cont & ~oob_before        # out of blocks once: the loop is over
        bs_new, statuses, cows_i = zip(*[bm.append(x, cont, 1) for x in bs_cur])
        oob = jnp.any(cont & (_first_failure(statuses) != OK))
        live = cont & ~oob               # out of blocks: this iteration does nothing
        bs_new = [_select(oob, x, y) for x, y in zip(bs_cur, bs_new)]
        cows_i = [jnp.where(live[:, None], c, -1) for c in cows_i]
        pgs_new = [kv_cache.copy_blocks(p, _cow_lanes(c, rows)) for p, c in zip(pgs_cur, cows_i)]
        copies = copies + jnp.sum(cows_i[0][:, 0] >= 0).astype(_I32)
        # Pack the live slots into the first R rows, one token each (live slots are
        # sampled slots, at most R of them).
        order = jnp.argsort(~live, stable=True).astype(_I32)[:rows]
        row_live = live[order]
        row_slot = jnp.where(row_live, order, -1)
        rs = jnp.clip(row_slot, 0, s_max - 1)
        positions = jnp.where(row_live, bs_new[0].seq_lens[rs] - 1, 0)
        token_row = jnp.where(row_live, lax.iota(_I32, rows), -1)
        meta = forward_lib.metadata(bs_new, row_slot, row_live.astype(_I32), token_row,
                                    positions, width, True)
        logits, pgs_new = forward_lib.forward(apply_fn, params, last[rs], positions, pgs_new,
                                              meta, sliding_layers)      # [R, V]
        new, decoded = decode.sample_iteration(i, logits, jnp.where(row_live, order, s_max),
                                               live, last, inp, decoded, all_greedy, offset)
        fin = decode.finished(new, inp.remaining - i - offset, inp.stop_ids)
        return (bs_new, pgs_new, new, live & ~fin, decoded, oob_before | oob, copies,
                done | (live & fin))

      carry = (bs, pgs, tok, cont, decoded, oob, copies, done)
      bs, pgs, _, _, decoded, oob, copies, done = lax.fori_loop(1, k_steps, body, carry)

    out = StepOutputs(ok=ok, status=status, tokens=decoded.tokens, valid=decoded.valid,
                      logprobs=decoded.logprobs, topk_logprobs=topv, topk_ids=topi,
                      num_free=bs[0].num_free, loop_out_of_blocks=oob,
                      available=bs[0].num_free, hit_tokens=hits,
                      num_evictable=jnp.zeros((), _I32), prefix_hit_blocks=jnp.zeros((), _I32),
                      prefix_query_blocks=jnp.zeros((), _I32), sole_blocks=sole_blocks(bs[0]),
                      cow_copies=copies, finished=done, sliding_free=jnp.zeros((), _I32),
                      kv_log=jnp.zeros((0, prefix_state.EVENT_COLS), _I32),
                      kv_log_len=jnp.zeros((), _I32),
                      top_logprobs=decoded.top_logprobs, top_ids=decoded.top_ids,
                      emitted=emitted, **scores)
    # 8-9. registration of newly full blocks (masked when not ok), then the finished
    # sequences' frees: with caching their full blocks stay cached, evictable. Finished
    # slots are sampled slots, at most R: the free runs on R lanes (S pads them). A
    # windowed group first gives back the blocks that slid out of every window (with
    # caching, but for the companions of cached blocks: `prefix_step.adopt`).
    done_slots, b = _lanes(done, rows), bs[0]
    if ps is not None:
      ps, b, _ = prefix_step.after(ps, b, inp, out, max_items=max_evict, forks=not quiet)
      ps, *bs[1:] = prefix_step.adopt(ps, b, bs[1], inp, width or 0) if hybrid else (ps,)
    bs = [b] + [bm.free(block_window.release_out_of_window(x, w), done_slots)[0]
                for x, w in zip(bs[1:], windows[1:])]
    if ps is None:
      b, _ = bm.free(b, done_slots)
      out = out.replace(num_free=b.num_free, available=b.num_free, sole_blocks=sole_blocks(b))
    else:
      # The finished slots are rows: their blocks fit the step's width bucket.
      ps, b = prefix_step.free(ps, b, done_slots, num_cols=width or 0)
      ps, *bs[1:] = prefix_step.drop_stale(ps, *bs[1:]) if hybrid else (ps,)
      evictable = prefix_state.num_evictable(ps.cache, b)
      ps, log, log_len = prefix_step.take_events(ps)   # what the cache stored / removed
      out = out.replace(kv_log=log, kv_log_len=log_len,num_free=b.num_free, available=b.num_free + evictable,
                        num_evictable=evictable, prefix_hit_blocks=ps.cache.hit_blocks,
                        prefix_query_blocks=ps.cache.query_blocks,
                        sole_blocks=sole_blocks(b, ps.cache.cached))
    out = out.replace(sliding_free=bs[1].num_free) if hybrid else out
    bs[0] = b
    return EngineState(groups=tuple(g.replace(blocks=x, pages=p) for g, x, p in
                                    zip(state.groups, bs, pgs)), prefix=ps), out

  if not jit:
    return step
  return jax.jit(step, donate_argnums=(1,), static_argnames=(
      "width", "decode_only", "all_greedy", "prefix_light", "prefix_admit_only", "logprobs",
      "spec"))
