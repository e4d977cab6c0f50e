"""The host KV tier's transfers around the engine step (`CacheConfig.num_host_blocks`).

Blocks the device's prefix cache evicts are copied to host memory
(`prefix_cache.host_tier.HostTier`); a prompt whose next blocks the device misses but the
host holds gets them back in fresh device blocks before the step that admits it, so the
step's own lookup hits them. Both directions run in ONE donated call, `exchange`, made
only on the steps that need it, right before the step (and after its swap-ins):

  - a step that admits a prompt with host-held blocks (the host finds them by chained
    hash: `plan`), or
  - a step that may evict: its worst-case block need (`need_bound`, an upper bound on
    `prefix_step.step_block_need` computed from the plan alone) exceeds the free blocks
    the last step reported.

Inside the call (`_exchange`): attach each such prompt's device hit to its admitted slot
(holding it), count the host blocks that continue it (`promote`), evict what the step
and the promotion need, plus `HEADROOM` of the pool when it evicts at all (so the next
steps need no call; `evict.pick_victims`, the cache's policy order), read the
victims' K/V and metadata out BEFORE anything is written, allocate the promoted blocks
as appends to the slots, write their K/V in (`kv_cache.write_blocks`), register them
(`core.register`: the slot's chain continues, so the chain, generations and event log
are the device's own), and free the slots again (`evict.free`: the blocks stay cached,
evictable, fresh in LRU order). The prefix counters are put back: the step's attach is
the one that counts the hit. The step then evicts nothing more (its need is at most the
bound the call freed), so every eviction of a step planned this way reaches the host.
Evictions the call does not see (a ring overflow in `evict.release`, a swap-in's room)
leave without a host copy; the event log reports them all the same.

Transfers (where the host pool lives: `host_tier.host_memory_kind`): on a GPU / TPU the
pool is in pinned host memory and both copies are jitted calls of their own, one for all
of a step's blocks: `plan` dispatches `host_tier._fetch` (host -> device, the promoted
blocks), `finish` dispatches `host_tier._stash` (device -> host, the victims) after
downloading only the victims' metadata. On a CPU the pool is numpy: host -> device is the
call's K/V argument (`jax.device_put`), device -> host `finish`'s `jax.device_get` of the
victims. `finish` runs after the step is dispatched, so its host work (and, on a CPU, the
download) overlaps the step. The device copies do not: a device runs the programs
dispatched to it in order, so `_stash` runs after the step and `_fetch` before the
exchange (whose writes need its blocks). Overlapping them with the step would need the
copies on a stream of their own beside the step's (vLLM's connector runs its DMA on its
own CUDA stream), or folded into the step's program, where XLA can schedule host copies
asynchronously beside its compute. The extra calls and the metadata sync happen only on
the steps listed above (`Engine.stats`: "host_tier_calls"); every other step keeps one
dispatch and one sync.

Interrupts: the call's arguments are built before it, and the engine keeps its returned
state before anything else can raise, so an interrupt before or during the upload
leaves both tiers as they were; one during the download leaves the device as the call
left it and the host tier without those victims (they were evicted, and are reported
removed by the next step's log): both tiers stay consistent, and the next plan starts
from the counts the call reported.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import kv_cache
from paged_jax.config import OK, cdiv
from paged_jax.engine.sequence import DeviceCounts
from paged_jax.engine.step import EngineState, TRACE_COUNT
from paged_jax.prefix_cache import core as pc
from paged_jax.prefix_cache import evict
from paged_jax.prefix_cache import state as st
from paged_jax.prefix_cache import step as prefix_step
from paged_jax.prefix_cache.events import hash_int
from paged_jax.prefix_cache.host_tier import HostTier

_I32 = jnp.int32


# The two transfers (module names, so a fault test can interrupt either).
_upload, _download = jax.device_put, jax.device_get


# An exchange that evicts frees this fraction of the pool beyond what its step needs (the
# extra victims go to the host too), so the next steps find free blocks and make no call:
# one call per ~pool/8 blocks evicted instead of one per evicting step. Measured with
# experiments/host_tier (docstring there).
HEADROOM = 1 / 8


def headroom(num_blocks: int) -> int:
  return max(1, int(num_blocks * HEADROOM))


def _bucket(n: int, cap: int) -> int:
  return max(1, min(cap, 1 << max(0, (n - 1).bit_length())))


class NeedInputs(NamedTuple):
  """The StepInputs fields `prefix_step.step_block_need` reads ([S] each)."""
  alloc_tokens: Any
  append_tokens: Any
  multi_step: Any
  sample_row: Any


def make_tier(cache_config, pages: kv_cache.KVPages) -> Optional[HostTier]:
  """The engine's host tier for `cache_config` (None when `num_host_blocks` is 0): one
  block of each K/V field of `pages` per host block."""
  n = cache_config.num_host_blocks
  if not n:
    return None
  shapes = jax.eval_shape(lambda p: kv_cache.read_blocks(p, jnp.zeros((1,), _I32)), pages)
  fields = {f: (s.shape[:2] + s.shape[3:], s.dtype) for f, s in shapes.items()}
  devices = {d for x in jax.tree_util.tree_leaves(pages) if isinstance(x, jax.Array)
             for d in x.sharding.device_set}
  return HostTier(n, cache_config.block_size, fields,
                  device=next(iter(devices)) if len(devices) == 1 else None)


def need_bound(inputs, block_size: int, num_decode_steps: int, starts=None,
               may_share: bool = True) -> int:
  """An upper bound, from the plan alone, on the blocks the step pops
  (`prefix_step.step_block_need`): `starts` i32[S] each appending slot's length before
  the step (the host's records; -1 or None: unknown, then its chunk's blocks plus one);
  `may_share`: a slot's partial last block may be shared (beams, parallel samples), so
  an append may copy it first."""
  bs = block_size
  cd = lambda a: -(-a // bs)
  alloc, app = np.asarray(inputs.alloc_tokens), np.asarray(inputs.append_tokens)
  n = int(np.sum(cd(alloc[alloc > 0])))
  s = np.full(app.shape, -1) if starts is None else np.asarray(starts)
  known, grow = (app > 0) & (s >= 0), app > 0
  n += int(np.sum(cd(s[known] + app[known]) - cd(s[known])
                  + (may_share & (s[known] % bs != 0))))
  n += int(np.sum(cd(app[grow & ~known]) + 1))
  if num_decode_steps > 1:
    looping = np.asarray(inputs.multi_step) & (np.asarray(inputs.sample_row) >= 0)
    n += int(np.sum(looping)) * (cdiv(num_decode_steps - 1, bs) + 1)
  return n


@dataclasses.dataclass
class Plan:
  """One exchange: the call's host arguments and what `finish` needs to apply it.

  Attributes:
    args: the `_exchange` arguments after the state (numpy).
    max_evict: static size of the victims' buffers.
    entries: host entries uploaded, in upload order (index = the `cand` value).
    lanes: per candidate lane, {depth: index in `entries`} of its prompt's host blocks.
  """
  args: tuple
  max_evict: int
  entries: list
  lanes: list


def plan(tier: HostTier, inputs, counts: DeviceCounts, *, swapped_in: bool,
         block_size: int, num_blocks: int, num_decode_steps: int, starts=None,
         may_share: bool = True) -> Optional[Plan]:
  """The exchange a step planned as `inputs` (numpy StepInputs) needs, or None
  (`starts`, `may_share`: as for `need_bound`).

  Host work only: the chained hashes of each admitted prompt's full blocks
  (`core.host_chain_hashes`, the salt's root first) looked up in the host tier, and the
  step's `need_bound` against the free blocks the device last reported."""
  s_max = inputs.attach_slot.shape[0]
  freed = set(int(x) for x in inputs.free_slots if x >= 0)
  lanes, entries = [], []
  cols = dict(slot=[], len=[], start=[], root=[], tag=[])
  for i in np.nonzero(inputs.attach_slot >= 0)[0]:
    slot, n = int(inputs.attach_slot[i]), int(inputs.attach_len[i])
    if slot in freed:     # freed and re-admitted in one step: active until the step runs
      continue
    start = int(inputs.attach_start[i])
    tok = inputs.attach_tokens[start:start + n]
    limit = max((n - 1) // block_size, 0)       # a lookup never hits the last token's block
    hashes = pc.host_chain_hashes(tok, limit, block_size, inputs.attach_root[i])
    found = {}                                  # depth -> index of its uploaded block
    for d in range(limit):
      e = tier.find(hash_int(hashes[d]), d, tok[d * block_size:(d + 1) * block_size])
      if e >= 0:
        found[d] = len(entries)
        entries.append(e)
    if not found:
      continue
    lanes.append(found)
    for k, v in (("slot", slot), ("len", n), ("start", start),
                 ("root", inputs.attach_root[i]), ("tag", inputs.attach_tag[i])):
      cols[k].append(v)
  need = need_bound(inputs, block_size, num_decode_steps, starts, may_share)
  if not entries and not swapped_in and need <= counts.num_free:
    return None
  a = len(lanes)
  lane_n = _bucket(max(a, 1), s_max)
  max_blocks = _max_blocks(inputs, block_size)
  cand = np.full((lane_n, max_blocks), -1, np.int32)
  for i, found in enumerate(lanes):
    for d, e in found.items():
      if d < max_blocks:
        cand[i, d] = e
  pad = lane_n - a
  slot = np.asarray(cols["slot"] + [-1] * pad, np.int32)
  length = np.asarray(cols["len"] + [0] * pad, np.int32)
  start = np.asarray(cols["start"] + [0] * pad, np.int32)
  root = np.asarray(cols["root"] + [pc.ROOT_HASH] * pad, np.uint32).reshape(lane_n, 2)
  tag = np.asarray(cols["tag"] + [0] * pad, np.int32)
  data = tier.gather(entries, _bucket(max(len(entries), 1), 1 << 30))
  need_in = NeedInputs(inputs.alloc_tokens, inputs.append_tokens, inputs.multi_step,
                       inputs.sample_row)
  room = headroom(num_blocks) if need > counts.num_free else 0
  max_evict = _bucket(need + len(entries) + room, num_blocks)
  return Plan(args=(need_in, slot, length, start, inputs.attach_tokens, root, tag, cand, data,
                    np.asarray(room, np.int32)),
              max_evict=max_evict, entries=entries, lanes=lanes)


def _max_blocks(inputs, block_size: int) -> int:
  """Block-table columns a lookup can cover (the lookup buffer's length in blocks)."""
  return max(inputs.attach_tokens.shape[0] // block_size, 1)


@functools.partial(jax.jit, donate_argnums=(0,),
                   static_argnames=("num_decode_steps", "max_evict"))
def _exchange(state: EngineState, need_in, slot, length, start, tokens, root, tag, cand,
              data, room, *, num_decode_steps: int, max_evict: int):
  """The donated call (see the module docstring). Shapes: slot / length / start / tag
  i32[A], root u32[A, 2], tokens i32[LK] (the step's packed prompts), cand i32[A, P']
  (the uploaded block holding each lane's depth, -1 none), data: field -> [num_layers,
  Hkv, n, bs(, D)], room i32[]: free blocks to leave beyond the need (`HEADROOM`). Returns (state, outputs): victims' meta rows i32[E, 11 + bs] and
  `ok` bool[E], their K/V (`read_blocks`' form, E blocks), per lane its device hit and
  promoted blocks i32[A], and the counts the next plan needs."""
  TRACE_COUNT["host_tier"] += 1
  ps, b = state.prefix, state.blocks
  s_max, nb, bs = b.max_seqs, b.num_blocks, b.block_size
  a, pw = cand.shape
  need = prefix_step.step_block_need(b, need_in, num_decode_steps)
  hit0, query0 = ps.cache.hit_blocks, ps.cache.query_blocks
  sc = jnp.clip(slot, 0, s_max - 1)
  ok = (slot >= 0) & ~b.active[sc]
  # 1. Hold each prompt's device hit in its admitted slot (so no eviction takes it).
  ps, b, hits = prefix_step.attach(ps, b, slot, length, start, tokens, root, tag)
  n_dev = jnp.where(ok, hits[sc] // bs, 0)
  # 2. The host blocks that continue each hit: depths n_dev .. before the first gap.
  d = lax.iota(_I32, pw)[None, :]
  limit = jnp.clip((length - 1) // bs, 0, min(pw, b.max_blocks_per_seq))[:, None]
  gap = ((cand < 0) | (d >= limit)) & (d >= n_dev[:, None])
  end = jnp.where(jnp.any(gap, axis=1), jnp.argmax(gap, axis=1), pw)
  k = jnp.where(ok, jnp.maximum(end - n_dev, 0), 0)
  # 3. Room for the step and the promotion; the victims' K/V read before any write.
  cache, victims = evict.pick_victims(ps.cache, b, need + jnp.sum(k) + room,
                                      max_evict=max_evict)
  vc = jnp.clip(victims, 0, nb - 1)
  v_ok = (victims >= 0) & cache.cached[vc]
  v_meta = cache.block_meta[vc]
  v_pages = kv_cache.read_blocks(state.pages, vc)
  cache, b, _ = evict.uncache(cache, b, victims)
  # 4. The promoted blocks as appends to the slots (all or none).
  grow = jnp.zeros((s_max,), _I32).at[jnp.where(k > 0, slot, s_max)].set(k * bs, mode="drop")
  b_new, status, _ = bm.append(b, grow > 0, grow)
  fine = jnp.all(status == OK)
  b = jax.tree_util.tree_map(lambda x, y: jnp.where(fine, x, y), b_new, b)
  k = jnp.where(fine, k, 0)
  promote = (d >= n_dev[:, None]) & (d < (n_dev + k)[:, None])           # [A, P']
  ids = b.block_tables[sc[:, None], jnp.clip(d, 0, b.max_blocks_per_seq - 1)]
  n_data = next(iter(data.values())).shape[2]
  dest = jnp.full((n_data,), -1, _I32).at[jnp.where(promote, cand, n_data)].set(
      ids, mode="drop")
  pages = kv_cache.write_blocks(state.pages, dest, data)
  # 5. Register them: the slots' chains continue after their device hits.
  flat = promote.reshape(-1)
  at = jnp.where(flat, jnp.cumsum(flat.astype(_I32)) - 1, a * pw)
  lane_slot = jnp.broadcast_to(slot[:, None], (a, pw)).reshape(-1)
  depth = jnp.broadcast_to(d, (a, pw)).reshape(-1)
  item_slot = jnp.full((a * pw,), -1, _I32).at[at].set(lane_slot, mode="drop")
  item_block = jnp.full((a * pw,), -1, _I32).at[at].set(depth, mode="drop")
  tok_at = (jnp.broadcast_to(start[:, None], (a, pw)).reshape(-1)[:, None]
            + depth[:, None] * bs + lax.iota(_I32, bs)[None, :])
  tok = tokens[jnp.clip(tok_at, 0, tokens.shape[0] - 1)]
  item_tokens = jnp.zeros((a * pw, bs), _I32).at[at].set(tok, mode="drop")
  cache, b = pc.register(cache, b, item_slot, item_block, item_tokens, jnp.sum(k))
  # 6. The slots go back (the step attaches them again); its attach counts the hit.
  cache, b, _ = evict.free(cache, b, jnp.where(ok, slot, -1))
  cache = cache.replace(hit_blocks=hit0, query_blocks=query0)
  evictable = st.num_evictable(cache, b)
  out = dict(victim_meta=v_meta, victim_ok=v_ok, victim_pages=v_pages, promoted=k,
             device_hit=n_dev,
             num_free=b.num_free, num_evictable=evictable)
  return state.with_full(blocks=b, pages=pages, prefix=ps.replace(cache=cache)), out


def exchange(state: EngineState, p: Plan, num_decode_steps: int):
  """Uploads the plan's host blocks and runs the donated call: (state, device outputs)."""
  args = _upload(p.args)              # host -> device (the K/V upload)
  return _exchange(state, *args, num_decode_steps=num_decode_steps, max_evict=p.max_evict)


def finish(tier: HostTier, p: Plan, out, counts: DeviceCounts):
  """Downloads the victims' metadata (and K/V, to a numpy pool), stores them in `tier`
  (a pinned pool copies them in itself), marks the promoted entries used. Returns
  (blocks brought back, the DeviceCounts after the call, the store's exception or None).

  A store that raises leaves the tier consistent (`HostTier.store`) and costs only host
  hits later; what the device did (its counts, the blocks it brought back) stands either
  way, so the caller records it before re-raising."""
  on_host = tier.memory_kind is None   # numpy pool: download the victims' K/V too
  host = _download(out if on_host else
                   {k: v for k, v in out.items() if k != "victim_pages"})
  meta, rows = host["victim_meta"], np.nonzero(host["victim_ok"])[0]
  lanes = lambda c: meta[rows, c:c + 2]
  error = None
  try:
    tier.store(dict(hash=[hash_int(x) for x in lanes(st.HASH)],
                    parent=[hash_int(x) for x in lanes(st.PARENT_HASH)],
                    depth=meta[rows, st.DEPTH], tokens=meta[rows, st.TOKENS:]),
               (host if on_host else out)["victim_pages"], index=rows)
  except BaseException as e:  # pylint: disable=broad-except  (re-raised by the engine)
    error = e
  # Lane i brought back its depths [device hit, device hit + promoted).
  used = [p.entries[found[d]] for found, lo, n in zip(p.lanes, host["device_hit"],
                                                      host["promoted"])
          for d in range(int(lo), int(lo) + int(n))]
  tier.touch(used)
  free, evictable = int(host["num_free"]), int(host["num_evictable"])
  return len(used), dataclasses.replace(counts, num_free=free, num_evictable=evictable,
                                        available=free + evictable), error
