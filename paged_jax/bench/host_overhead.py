"""Host work per generated token: the engine's in-jit block bookkeeping against a host-side
Python allocator doing the same bookkeeping each step (vLLM-style), same model and requests.

    outputs, timing = host_overhead.python_allocator_run(mc, params, cc, prompts, 128)
    outputs, timing = host_overhead.engine_run(mc, params, cc, prompts, 128, k=4)
    timing["step_s"], timing["device_s"], timing["steps"]      # wall s, device s, jitted calls

Both greedy; "device" is the jitted call until its outputs are on the host, the rest of
the wall time is host work (scheduling, bookkeeping, building inputs, handling outputs).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import OK
from paged_jax.testing import BlockModel


_FWD_CACHE = {}


def python_allocator_run(mc, params, cc, prompts, max_tokens):
  """Greedy generation of `max_tokens` per prompt with the plain-Python allocator
  (`testing.BlockModel`) doing the block bookkeeping each step and one jitted forward of
  the model; returns (outputs per prompt, {"device_s", "step_s", "steps"})."""
  from paged_jax import kv_cache  # pylint: disable=g-import-not-at-top
  from paged_jax.attention import AttentionMetadata  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import sampling  # pylint: disable=g-import-not-at-top
  from paged_jax.models.llama import LlamaForCausalLM  # pylint: disable=g-import-not-at-top
  del sampling
  if mc not in _FWD_CACHE:   # compiled once per model, like the engine's step
    model = LlamaForCausalLM(mc, attention_backend="auto")

    def _fwd(params, pages, tokens, positions, meta):
      logits, pages = model.apply(params, tokens, positions, pages, meta)
      return pages, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    _FWD_CACHE[mc] = jax.jit(_fwd, donate_argnums=(1,))
  fwd = _FWD_CACHE[mc]
  s, p = cc.max_seqs, cc.max_blocks_per_seq
  alloc = BlockModel.from_config(cc)   # the plain-Python allocator (the tests' oracle)
  pages = kv_cache.init(cc)
  seqs = [list(x) for x in prompts]
  computed = [0] * len(seqs)
  timing = {"device_s": 0.0, "step_s": 0.0, "steps": 0}
  outputs = [[] for _ in seqs]
  live = list(range(len(seqs)))
  budget = max(s, sum(len(x) for x in prompts))
  while live:
    t0 = time.perf_counter()
    # The engine's two token buckets: max_seqs (decode) or the full budget (prefill).
    t_max = s if sum(len(seqs[i]) - computed[i] for i in live) <= s else budget
    tokens = np.zeros((t_max,), np.int32)
    positions = np.zeros((t_max,), np.int32)
    slot_mapping = np.full((t_max,), -1, np.int32)
    tables = np.full((s, p), -1, np.int32)
    kv_lens = np.zeros((s,), np.int32)
    q_lens = np.zeros((s,), np.int32)
    # Bookkeeping for the whole batch: prompts allocate, running sequences grow.
    fresh = [i for i in live if not alloc.active[i]]
    status = alloc.allocate(fresh, [len(seqs[i]) for i in fresh])
    grow = [alloc.active[i] and i in live and i not in fresh for i in range(s)]
    counts = [len(seqs[i]) - computed[i] if i < len(seqs) else 0 for i in range(s)]
    grown, cow = alloc.append(grow, counts)
    assert set(status + grown) == {OK} and max(cow)[0] < 0, (status, grown)  # nothing shared
    t = 0
    for row, i in enumerate(live):
      new = seqs[i][computed[i]:]
      pos = list(range(computed[i], computed[i] + len(new)))
      tokens[t:t + len(new)], positions[t:t + len(new)] = new, pos
      slot_mapping[t:t + len(new)] = alloc.token_slots([i] * len(new), pos)
      t += len(new)
      tables[row, :len(alloc.tables[i])] = alloc.tables[i]
      kv_lens[row], q_lens[row] = alloc.lens[i], len(new)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=tables, kv_lens=kv_lens,
                             cu_q_lens=cu, num_seqs=np.int32(len(live)),
                             logits_indices=np.maximum(cu[1:] - 1, 0))
    t1 = time.perf_counter()
    pages, nxt = fwd(params, pages, tokens, positions, meta)
    nxt = np.asarray(jax.device_get(nxt))
    timing["device_s"] += time.perf_counter() - t1
    still = []
    for row, i in enumerate(live):
      computed[i] = len(seqs[i])
      seqs[i].append(int(nxt[row]))
      outputs[i].append(int(nxt[row]))
      if len(outputs[i]) >= max_tokens:
        alloc.free([i])
      else:
        still.append(i)
    live = still
    timing["steps"] += 1
    timing["step_s"] += time.perf_counter() - t0
  return outputs, timing


def engine_run(mc, params, cc, prompts, max_tokens, k, caching=False):
  """The same generation by `Engine` with `k` decode steps per host sync (prefix caching
  on with `caching`); returns (outputs, {"device_s", "step_s" (the whole call), "steps"
  (jitted calls)})."""
  from paged_jax.engine import Engine, SamplingParams  # pylint: disable=g-import-not-at-top
  cc = cc.replace(enable_prefix_caching=caching)
  budget = max(cc.max_seqs, sum(len(x) for x in prompts))
  engine = Engine(mc, params, cc, max_num_batched_tokens=budget, decode_steps_per_sync=k)
  t0 = time.perf_counter()
  outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
  # Wall time of the whole call, measured here: the engine's own timing["step_s"] counts
  # only step() calls, and generate() may drive the engine without them.
  timing = dict(engine.timing, step_s=time.perf_counter() - t0)
  timing["steps"] = engine.stats["device_steps"]
  return [o.outputs[0] for o in outs], timing
