"""The serving engine: requests in, tokens out, one jitted device step per step.

    engine = Engine(model_config, params, cache_config, max_num_batched_tokens=256)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16, temperature=0))
    outs[0].outputs[0]          # generated ids of the first prompt

Host side: `Scheduler` (FCFS, chunked prefill, preemption) plans from the counts
the previous step returned; `inputs.build_inputs` turns the plan into
fixed-shape arrays; `step.make_step` runs it on device in ONE jit (frees,
forks, prefix-cache attach and LRU eviction, reservation with copy-on-write,
the model, registration of newly full blocks, sampling, `decode_steps_per_sync
- 1` more decode steps); one host sync brings the outputs back and
`results.ResultApplier` updates the sequences. See ARCHITECTURE.md.

Failure safety: a step changes host bookkeeping only once its outputs are on
the host. An exception (KeyboardInterrupt included) before the dispatch undoes
the plan (`scheduler.Snapshot`); one after it leaves the dispatched step
pending, and the next call applies its outputs; one while applying undoes the
partial application and keeps the step pending. SIGINT is deferred only across
the few lines that hand the donated state to the device and back.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence as Seq, Union

import jax
import numpy as np

from paged_jax.config import CacheConfig, ModelConfig, OK
from paged_jax.engine import report as report_lib
from paged_jax.engine import swap
from paged_jax.engine.inputs import build_inputs
from paged_jax.engine.params import RequestOutput, SamplingParams
from paged_jax.engine.results import ResultApplier, request_output
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.sequence import Batch, Group, GroupStatus
from paged_jax.engine.requests import prepare_group
from paged_jax.engine.snapshot import Snapshot, sigint_deferred
from paged_jax.engine.step import EngineState, init_state as default_init_state
from paged_jax.prefix_cache import step as prefix_step
from paged_jax.engine.compiled import check_params, engine_step, lookup_len, note_bucket

log = logging.getLogger("paged_jax.engine")


_prefix_counters = jax.jit(lambda state: prefix_step.counters(state.prefix, state.blocks))


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_prefix(state: EngineState) -> EngineState:
  prefix, blocks = prefix_step.reset(state.prefix, state.blocks)
  return state.replace(blocks=blocks, prefix=prefix)


class Engine:
  """Continuous-batching PagedAttention engine over `LlamaForCausalLM`.

  Args:
    model_config: the model's ModelConfig.
    params: its parameters ({"params": ...} or the bare tree), checked against
      the model's shapes here.
    cache_config: CacheConfig whose layer/head shapes match the model;
      `enable_prefix_caching=True` turns on automatic prefix caching.
    max_num_batched_tokens: per-step token budget (prefill chunks + decodes).
    decode_steps_per_sync: decode steps per device call (multi-step decoding).
    preemption_mode: "recompute" (default), "swap" (to host memory, a group's shared
      blocks once) or "auto" (swap groups of several sequences, recompute single
      ones: vLLM V0's rule).
    attention_backend: one of `attention.BACKENDS`: "auto", "reference", "xla", "cpu",
      "pallas", "pallas_interpret", or with the GPU kernel family forced ("pallas:triton",
      "pallas:mosaic_gpu", "pallas_interpret:triton", "pallas_interpret:mosaic_gpu").
    max_beam_width: largest beam_width accepted (sets the candidate count).
    model_apply: replaces `LlamaForCausalLM(...).apply` in the jitted step (same
      signature); `paged_jax.distributed` passes its tensor-parallel forward.
    init_state: `cache_config -> EngineState`, e.g. pages created already sharded.
    max_probe, hash_mode: prefix-cache table options (`prefix_cache.init`).
    shape_buckets: True (default): each step runs on the smallest shape bucket
      (tokens, rows, block-table width) that holds what is live, so a step costs
      what is live; False: every step at the largest shape (for comparisons).
  """

  def __init__(self, model_config: ModelConfig, params, cache_config: CacheConfig, *,
               max_num_batched_tokens: int = 256, decode_steps_per_sync: int = 1,
               preemption_mode: str = "recompute", attention_backend: str = "auto",
               max_beam_width: int = 4, model_apply: Optional[Callable[..., Any]] = None,
               init_state: Optional[Callable[[CacheConfig], EngineState]] = None,
               max_probe: int = 16, hash_mode: str = "chained", shape_buckets: bool = True):
    # Everything needed to build a fresh engine of the same shapes (`fresh_copy`).
    self._options = dict(max_num_batched_tokens=max_num_batched_tokens,
                         decode_steps_per_sync=decode_steps_per_sync,
                         preemption_mode=preemption_mode, attention_backend=attention_backend,
                         max_beam_width=max_beam_width, model_apply=model_apply,
                         init_state=init_state, max_probe=max_probe, hash_mode=hash_mode,
                         shape_buckets=shape_buckets)
    self._step, self._buckets = engine_step(
        model_config, cache_config, max_num_batched_tokens=max_num_batched_tokens,
        decode_steps_per_sync=decode_steps_per_sync, preemption_mode=preemption_mode,
        attention_backend=attention_backend, max_beam_width=max_beam_width,
        model_apply=model_apply, shape_buckets=shape_buckets)
    self.params = check_params(model_config, params)
    self.model_config = model_config
    self.cache_config = cache_config
    self.decode_steps_per_sync = decode_steps_per_sync
    self.max_beam_width = max_beam_width
    self.max_num_batched_tokens = max_num_batched_tokens
    self.max_model_len = min(cache_config.max_seq_len, model_config.max_position_embeddings)
    self.prefix_caching = cache_config.enable_prefix_caching
    self._lookup_len = lookup_len(cache_config, max_num_batched_tokens)
    self.state = (init_state(cache_config) if init_state is not None else
                  default_init_state(cache_config, max_probe=max_probe, hash_mode=hash_mode))
    self.scheduler = Scheduler(block_size=cache_config.block_size, max_seqs=cache_config.max_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               preemption_mode=preemption_mode,
                               prefix_caching=self.prefix_caching,
                               lookup_budget=self._lookup_len,
                               lookahead=decode_steps_per_sync - 1)
    self._groups: Dict[Any, Group] = {}
    self._outbox: Dict[Any, RequestOutput] = {}    # finished, not yet returned
    self._pending = None     # (batch, outputs, snapshot): dispatched, outputs not applied
    self._last_all_greedy = True   # sampling variant of the last step (for idle steps)
    self._next_id = 0
    self._arrivals = 0
    self._seq_ids = 0
    self.stats = collections.Counter()
    self.timing = collections.Counter()
    self._results = ResultApplier(self.scheduler, self._groups, self.stats,
                                  cache_config.block_size)
    nb = cache_config.num_blocks
    self._counts = dict(num_free=nb, available=nb, num_evictable=0, prefix_hit_blocks=0,
                        prefix_query_blocks=0)
    # Blocks each slot alone references, as the last step reported (StepOutputs.sole_blocks).
    self._sole_blocks = np.zeros((cache_config.max_seqs,), np.int32)
    self._last_step = report_lib.StepReport()
    self._report_base = (0, 0, 0)   # stats the last report was made at
    log.info("paged_jax engine: block_size=%d num_blocks=%d KV capacity=%d tokens "
             "(%.1f MiB %s), max_seqs=%d, max_model_len=%d, budget=%d tokens/step, "
             "decode_steps_per_sync=%d, preemption=%s, prefix_caching=%s",
             cache_config.block_size, nb, cache_config.num_slots,
             cache_config.kv_cache_bytes / 2**20, cache_config.dtype, cache_config.max_seqs,
             self.max_model_len, max_num_batched_tokens, decode_steps_per_sync,
             preemption_mode, self.prefix_caching)

  # ---- requests ------------------------------------------------------------------------
  def _prepare(self, prompt, params, request_id) -> Group:
    """Validates one request (no state changes) and builds its Group."""
    try:
      hash(request_id)
    except TypeError:
      raise ValueError(f"request_id must be hashable, got {type(request_id).__name__}") from None
    if request_id is not None and (request_id in self._groups or request_id in self._outbox):
      raise ValueError(f"request_id {request_id!r} is already in use")
    return prepare_group(prompt, params, request_id, vocab_size=self.model_config.vocab_size,
                         cache_config=self.cache_config, max_beam_width=self.max_beam_width,
                         max_model_len=self.max_model_len)

  def _queue(self, group: Group) -> Any:
    """Gives the group its id (automatic ids skip any id in use) and queues it."""
    if group.request_id is None:
      while self._next_id in self._groups or self._next_id in self._outbox:
        self._next_id += 1
      group.request_id = self._next_id
      self._next_id += 1
    group.arrival = self._arrivals
    self._arrivals += 1
    for q in group.seqs:
      q.seq_id = self._seq_ids
      self._seq_ids += 1
    self._groups[group.request_id] = group
    self.scheduler.add(group)
    return group.request_id

  def add_request(self, prompt: Seq[int], params: Optional[SamplingParams] = None,
                  request_id: Any = None) -> Any:
    """Queues a request (validated in full before anything changes); returns its id.

    `prompt`: token ids (list, numpy or jax array, 1-D). A request that could never
    fit the cache is rejected here with the numbers.
    """
    return self._queue(self._prepare(prompt, params, request_id))

  def has_unfinished(self) -> bool:
    """Requests queued or running, or finished outputs not yet returned by `step`."""
    return bool(self._outbox) or self._pending is not None or self.scheduler.has_unfinished()

  def generate(self, prompts: Seq[Seq[int]],
               params: Union[SamplingParams, Seq[SamplingParams], None] = None
               ) -> List[RequestOutput]:
    """Runs prompts to completion; their outputs in prompt order. All or nothing:
    the whole batch is validated before any request is queued. Outputs of other
    requests finishing meanwhile stay for the next `step()`."""
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"params must be one SamplingParams or {len(prompts)}, got {len(params)}")
    groups = [self._prepare(p, sp, None) for p, sp in zip(prompts, params)]
    ids = [self._queue(g) for g in groups]
    while any(i not in self._outbox for i in ids):
      if not self._advance():
        raise RuntimeError("the engine made no progress with requests left")
    self.flush()
    return [self._outbox.pop(i) for i in ids]

  def abort(self, request_id: Any) -> Optional[RequestOutput]:
    """Stops a request and frees its blocks now; returns its output so far
    (finish reason "abort"), or its full output if it had finished but was not
    yet returned, or None for an unknown id."""
    self._finish_pending()
    if request_id in self._outbox:
      return self._outbox.pop(request_id)
    group = self._groups.get(request_id)
    if group is None:
      return None
    sched = self.scheduler
    for q in group.seqs:
      q.finish_reason = "abort"
      q.swapped_kv = None
    if group.status == GroupStatus.WAITING:
      sched.waiting.remove(group)
    elif group.status == GroupStatus.SWAPPED:
      sched.swapped.remove(group)
    out = request_output(group, sorted(group.finished + group.seqs, key=lambda q: q.index))
    sched.finish_group(group)
    del self._groups[request_id]
    self.flush()
    return out

  # ---- the step ------------------------------------------------------------------------
  def step(self) -> List[RequestOutput]:
    """Runs one device step (or finishes an interrupted one); returns every output
    finished since the last call, each once.

    `timing` accumulates wall seconds: "step_s" (all of it) and "device_s" (the
    jitted call until its outputs reach the host); the rest is host overhead.
    """
    t0 = time.perf_counter()
    try:
      if not self._advance():
        self._report(None)
    finally:
      self.timing["step_s"] += time.perf_counter() - t0
    outs = list(self._outbox.values())
    self._outbox.clear()
    return outs

  def _advance(self) -> bool:
    """One step into the outbox; False when there was nothing to run."""
    if self._pending is not None:
      self._finish_pending()
      return True
    if not self.scheduler.has_unfinished():
      return False
    snap = Snapshot(self.scheduler, self._groups)
    try:
      batch = self.scheduler.schedule(self._counts["available"], self._sole_blocks)
      self._swap_outs()
      inputs = build_inputs(batch, self.scheduler.running, buckets=self._buckets,
                            max_seqs=self.cache_config.max_seqs, lookup_len=self._lookup_len,
                            vocab_size=self.model_config.vocab_size,
                            idle_all_greedy=self._last_all_greedy)
      if not (batch.chunks or batch.frees or batch.forks or batch.attaches or batch.swap_in):
        raise RuntimeError(
            f"the scheduler found nothing to run with {len(self.scheduler.running)} running, "
            f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.swapped)} swapped "
            f"requests and {self._counts['available']} available blocks")
    except BaseException:
      snap.restore(self._groups)
      raise
    self._dispatch(batch, inputs, snap)
    self._finish_pending()
    return True

  def _dispatch(self, batch: Batch, inputs, snap: Snapshot) -> None:
    """Swap-ins and the jitted step; the new state is kept before anything can raise.
    `inputs`: (StepInputs, bucket (T, R, W, decode_only, all_greedy)) from build_inputs."""
    inputs, bucket = inputs
    with sigint_deferred():
      try:
        self._swap_ins(batch)
        note_bucket(self._step, bucket, self._buckets)   # logs a shape's first (compiling) call
        t0 = time.perf_counter()
        self.state, out = self._step(self.params, self.state, inputs, width=bucket.width,
                                     decode_only=bucket.decode_only,
                                     all_greedy=bucket.all_greedy)
      except BaseException:
        if any(getattr(x, "is_deleted", lambda: False)()
               for x in jax.tree_util.tree_leaves(self.state)):
          raise RuntimeError("the engine's device state was consumed by a step that failed; "
                             "the engine cannot continue") from None
        snap.restore(self._groups)
        raise
      self._pending = (batch, out, t0, bucket)
      self._last_all_greedy = bucket.all_greedy
      self.stats["device_steps"] += 1
      self.stats["bucket_tokens"] += bucket.tokens   # tokens the step's shape computes (padded)

  def _finish_pending(self, report: bool = True) -> None:
    """Waits for the pending step's outputs (the one host sync) and applies them;
    `report`: make `last_step` from them (not for a frees-only flush)."""
    if self._pending is None:
      return
    batch, out, t0, bucket = self._pending
    out = jax.device_get(out)
    self.timing["device_s"] += time.perf_counter() - t0
    snap = Snapshot(self.scheduler, self._groups)
    try:
      fresh = report_lib.not_started(self.scheduler.running)
      prefill, decode = report_lib.chunk_work(batch)
      running_before = list(self.scheduler.running)
      finished = self._apply(batch, out)
      victims = [g for g in running_before if g.status == GroupStatus.WAITING
                 or g.status == GroupStatus.SWAPPED]
      done = {o.request_id for o in finished}
      started = [g.request_id for g in running_before if g.request_id in fresh and (
          g.request_id in done or report_lib.has_started(g))]
      parts = dict(bucket=bucket, first_token_ids=tuple(started),
                   finished_ids=tuple(o.request_id for o in finished),
                   preempted_ids=tuple(g.request_id for g in batch.preempted + victims),
                   prefill_chunks=prefill, decode_rows=decode,
                   prefix_hit_tokens=sum(q.num_computed for q in batch.attaches),
                   **report_lib.device_work(out))
    except BaseException:
      snap.restore(self._groups)
      raise
    with sigint_deferred():
      self._pending = None
      for o in finished:
        self._outbox[o.request_id] = o
      if report:
        self._report(parts)

  def _apply(self, batch: Batch, out) -> List[RequestOutput]:
    ok = bool(out.ok)
    self.scheduler.commit(batch, ok, out.hit_tokens)
    self._counts = {k: int(getattr(out, k)) for k in self._counts}
    self._sole_blocks = np.asarray(out.sole_blocks)
    if not ok:   # a reservation failed on device: nothing ran; make room, re-plan
      self.stats["out_of_blocks_retries"] += 1
      self.scheduler.preempt_newest()
      return []
    self.stats["steps"] += 1
    self.stats["loop_out_of_blocks"] += int(out.loop_out_of_blocks)
    for ch in batch.chunks:
      seq, nc = ch.seq, ch.seq.num_computed
      self.stats["prefill_tokens"] += max(0, min(nc + ch.num_tokens, seq.prompt_len) - nc)
      self.stats["computed_tokens"] += ch.num_tokens
    for seq in batch.attaches:
      self.stats["prefix_hit_tokens"] += seq.num_computed
    return self._results.apply(batch, out)

  def _report(self, parts: Optional[Dict[str, Any]]) -> None:
    """Makes `last_step` from a step's parts (None: nothing ran since the last one)."""
    sched, base = self.scheduler, self._report_base
    now = tuple(self.stats[k] for k in ("device_steps", "swapped_blocks", "generated_tokens"))
    self._last_step = report_lib.StepReport(
        dispatches=now[0] - base[0], swapped_blocks=now[1] - base[1],
        generated_tokens=now[2] - base[2],
        num_running_groups=len(sched.running),
        num_running_seqs=sum(len(g.seqs) for g in sched.running), **(parts or {}))
    self._report_base = now

  @property
  def last_step(self) -> report_lib.StepReport:
    """What the last `step()` did (a frozen StepReport; see `report.py`)."""
    return self._last_step

  def flush(self) -> None:
    """Applies pending frees now (one step that only frees)."""
    self._finish_pending()
    if self.scheduler.pending_frees:
      batch = Batch(frees=list(self.scheduler.pending_frees))
      inputs = build_inputs(batch, [], buckets=self._buckets, max_seqs=self.cache_config.max_seqs,
                            lookup_len=self._lookup_len, vocab_size=self.model_config.vocab_size,
                            idle_all_greedy=self._last_all_greedy)
      self._dispatch(batch, inputs, Snapshot(self.scheduler, self._groups))
      self._finish_pending(report=False)

  def fresh_copy(self) -> "Engine":
    """A new engine with this one's model, params and options and a fresh state; it
    shares the jitted step (and so every shape compiled for it)."""
    return Engine(self.model_config, self.params, self.cache_config, **self._options)

  # ---- observability -------------------------------------------------------------------
  @property
  def num_free(self) -> int:
    """Blocks the next plan may use: free plus evictable (as of the last step)."""
    return self._counts["available"]

  @property
  def num_preemptions(self) -> int:
    return self.scheduler.num_preemptions

  @property
  def num_swaps(self) -> int:
    return self.scheduler.num_swaps

  def metrics(self) -> Dict[str, Any]:
    """KV usage, queues and prefix-cache hits as of the last step (no device work)."""
    s, c = self.scheduler, self._counts
    return {"num_blocks": self.cache_config.num_blocks, "num_free_blocks": c["num_free"],
            "num_evictable_blocks": c["num_evictable"], "num_running": len(s.running),
            "num_waiting": len(s.waiting), "num_swapped": len(s.swapped),
            "num_preemptions": s.num_preemptions, "num_swaps": s.num_swaps,
            "prefix_hit_blocks": c["prefix_hit_blocks"],
            "prefix_query_blocks": c["prefix_query_blocks"],
            "prefix_hit_rate": (c["prefix_hit_blocks"] / c["prefix_query_blocks"]
                                if c["prefix_query_blocks"] else 0.0),
            "prefix_hit_tokens": self.stats["prefix_hit_tokens"],
            "prefill_tokens": self.stats["prefill_tokens"],
            "steps": self.stats["steps"], "generated_tokens": self.stats["generated_tokens"]}

  def prefix_stats(self) -> Dict[str, float]:
    """Prefix-cache counters read from the device (one sync): hit / query blocks,
    evictions, cached and evictable blocks; host counts of hit and prefill tokens."""
    if self.state.prefix is None:
      raise ValueError("prefix_stats needs cache_config.enable_prefix_caching=True")
    self._finish_pending()
    d = {k: int(v) for k, v in jax.device_get(_prefix_counters(self.state)).items()}
    d.update(hit_tokens=self.stats["prefix_hit_tokens"],
             prefill_tokens=self.stats["prefill_tokens"],
             computed_tokens=self.stats["computed_tokens"])
    d["hit_rate"] = d["hit_blocks"] / d["query_blocks"] if d["query_blocks"] else 0.0
    return d

  def reset_prefix_cache(self) -> None:
    """Drops every cached block (running sequences keep theirs) and zeroes the
    prefix counters."""
    if self.state.prefix is None:
      raise ValueError("reset_prefix_cache needs cache_config.enable_prefix_caching=True")
    self.flush()
    self.state = _reset_prefix(self.state)
    c = jax.device_get(_prefix_counters(self.state))
    self._counts.update(num_free=int(c["num_free"]), num_evictable=int(c["evictable_blocks"]),
                        available=int(c["num_free"]) + int(c["evictable_blocks"]),
                        prefix_hit_blocks=0, prefix_query_blocks=0)
    for k in ("prefix_hit_tokens", "prefill_tokens", "computed_tokens"):
      self.stats[k] = 0

  # ---- swap preemption -----------------------------------------------------------------
  # A swapped group's host copy hangs on its leader (`Sequence.swapped_kv`).
  def _swap_outs(self) -> None:
    for group, slots in self.scheduler.pending_swap_outs:
      lead = group.leader
      lead.swapped_kv = swap.swap_out(self.state, slots, [q.num_computed for q in group.seqs])
      self.stats["swap_out_bytes"] += lead.swapped_kv.nbytes
      self.stats["swapped_blocks"] += lead.swapped_kv.num_blocks
    self.scheduler.pending_swap_outs = []

  def _swap_ins(self, batch: Batch) -> None:
    for group in batch.swap_in:
      lead = group.leader   # the scheduler plans a swap-in only once its copy exists
      slots = [q.slot for q in group.seqs]
      self.state, status = swap.swap_in(self.state, slots, lead.swapped_kv)
      if int(status) != OK:
        raise RuntimeError(f"swap-in of slots {slots} failed with status {int(status)}")
      self.stats["swapped_blocks"] += lead.swapped_kv.num_blocks
      lead.swapped_kv = None
