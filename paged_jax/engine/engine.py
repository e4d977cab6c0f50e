"""The serving engine: requests in, tokens out, one jitted device step per step.

    engine = Engine(model_config, params, cache_config, max_num_batched_tokens=256)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16, temperature=0))
    outs[0].outputs[0]          # generated ids of the first prompt

One step (`_advance`) reads: `Scheduler.schedule()` -> `inputs.build_inputs` -> the jitted
step (`step.make_step`; its docstring gives the order of its device effects) ->
`packing.fetch` (the one host sync, one buffer) -> `Scheduler.update(batch, outputs)`, the
one place outputs are applied. `last_step` reports what the step did (`report.StepReport`).

Failure safety: a step changes host bookkeeping only once its outputs are on the host.
`schedule()` changes nothing, so an exception (KeyboardInterrupt included) before the
dispatch drops the plan and nothing else; one after it leaves the dispatched step in
flight, and the next call applies its outputs; `update` works out every change before it
writes any (`commit.Changes`), so one inside it keeps the step in flight with nothing
applied. SIGINT is deferred only across the lines that hand the donated state to the
device and back, and across applying one step's outputs.

Metrics are exact at every moment: a sequence the device finishes (stop id, max_tokens)
is freed by the step that finished it; frees decided on the host (beam search, abort)
run in a frees-only dispatch at the end of the `step()` that finished their request.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Dict, List, Optional, Sequence as Seq, Union

from paged_jax import kv_cache
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.engine import draft_model
from paged_jax.engine import report as report_lib
from paged_jax.engine import swap
from paged_jax.engine import tier as tier_lib
from paged_jax.engine import kv_tiers
from paged_jax.engine.kv_tiers import KVTiers
from paged_jax.engine.buckets import Bucket, StepBuckets
from paged_jax.engine.compile import arg_signature, engine_step
from paged_jax.engine.inputs import build_inputs, lookup_len
from paged_jax.engine.options import EngineOptions
from paged_jax.engine.params import RequestOutput, SamplingParams
from paged_jax.engine.requests import Intake
from paged_jax.checks import consumed
from paged_jax.engine.commit import sigint_deferred
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.update import partial_output
from paged_jax.engine.sequence import Batch, DeviceCounts, Group
from paged_jax.engine.packing import fetch
from paged_jax.engine.step import init_state as default_init_state
from paged_jax.engine.weights import check_params
from paged_jax.prefix_cache import events as events_lib

log = logging.getLogger("paged_jax.engine")


class Engine:
  """Continuous-batching PagedAttention engine over `LlamaForCausalLM`.

  Args:
    model_config: the model's ModelConfig.
    params: its parameters ({"params": ...} or the bare tree), checked against
      the model's shapes here.
    cache_config: CacheConfig whose layer/head shapes match the model;
      automatic prefix caching is on unless `enable_prefix_caching=False`.
    options: an `EngineOptions` (token budget, decode steps per sync, preemption mode,
      attention backend, beam width, ...); its fields are also accepted as keywords
      (`Engine(..., max_num_batched_tokens=512)`), which override `options`.
  """

  def __init__(self, model_config: ModelConfig, params, cache_config: CacheConfig, *,
               options: Optional[EngineOptions] = None, **engine_options):
    self.options = options = EngineOptions.of(options, **engine_options)
    self._compiled, self._buckets = engine_step(model_config, cache_config, options)
    self.params = check_params(model_config, params)
    self._drafter = draft_model.for_engine(model_config, cache_config, options)
    self.model_config = model_config
    self.cache_config = cache_config
    self.decode_steps_per_sync = options.decode_steps_per_sync
    self.max_beam_width = options.max_beam_width
    self.max_num_batched_tokens = budget = options.max_num_batched_tokens
    self.max_model_len = min(cache_config.max_seq_len, model_config.max_position_embeddings)
    self.prefix_caching = cache_config.enable_prefix_caching
    self._lookup_len = lookup_len(cache_config, budget)
    # On the TPU kernels int8 / fp8 scales are held as scale rows (kv_cache.py).
    self.state = (options.init_state(cache_config) if options.init_state is not None else
                  default_init_state(cache_config, max_probe=options.max_probe,
                                     hash_mode=options.hash_mode,
                                     scale_rows=kv_cache.scale_rows_for(
                                         options.attention_backend)))
    # The call every step dispatches: each shape bucket's own jit, from the process's
    # executable budget (bounded by its memory-map headroom; compile.CompiledStep).
    self._step = self._compiled.caller(arg_signature(self.params, self.state, self._lookup_len))
    # The host KV tier (None without one) and the KV events of both tiers.
    self._tiers = KVTiers(cache_config, options, self.state.pages)
    nb, max_seqs = cache_config.num_blocks, cache_config.max_seqs
    self.scheduler = Scheduler(
        block_size=cache_config.block_size, max_seqs=max_seqs, max_num_batched_tokens=budget,
        preemption_mode=options.preemption_mode, prefix_caching=self.prefix_caching,
        lookup_budget=self._lookup_len, lookahead=options.decode_steps_per_sync - 1,
        token_bucket=self._buckets.mixed_tokens, policy=options.scheduling_policy,
        speculative=options.speculative_config, drafter=self._drafter,
        counts=DeviceCounts.empty_pool(nb, max_seqs, cache_config.num_sliding_blocks))
    self._outbox: Dict[Any, RequestOutput] = {}    # finished, not yet returned
    # (batch, outputs, t0, report?): dispatched, outputs not yet applied
    self._in_flight = None
    self._last_all_greedy = True   # sampling variant of the last step (for frees-only ones)
    self._intake = Intake(self._in_use, vocab_size=model_config.vocab_size,
                          cache_config=cache_config, max_beam_width=self.max_beam_width,
                          max_model_len=self.max_model_len, max_n=1 if self._drafter else 0)
    self.timing = collections.Counter()
    self._last_step = report_lib.StepReport()
    self._applied = None             # the report parts of the last step applied
    self._report_base = (0, 0, 0)    # the counters the last report was made at
    log.info("paged_jax engine: %s", report_lib.describe(cache_config, options,
                                                         self.max_model_len))

  @property
  def host_stats(self) -> collections.Counter:
    """Host-tier counters: exchange "calls", "promoted_blocks", "prefix_host_hit_tokens"."""
    return self._tiers.stats

  @property
  def stats(self) -> collections.Counter:
    """The scheduler's counters (steps, tokens by kind, swaps, retries; its `update`)."""
    return self.scheduler.stats

  # ---- requests ------------------------------------------------------------------------
  def _in_use(self, request_id) -> bool:
    return request_id in self.scheduler.groups or request_id in self._outbox

  def _queue(self, group: Group) -> Any:
    """Numbers the group (`requests.Intake`), queues it, returns its id."""
    self.scheduler.add(self._intake.number(group))
    return group.request_id

  def add_request(self, prompt: Seq[int], params: Optional[SamplingParams] = None,
                  request_id: Any = None, priority: int = 0) -> Any:
    """Queues a request (validated in full before anything changes); returns its id.

    `prompt`: token ids (list, numpy or jax array, 1-D). A request that could never
    fit the cache is rejected here with the numbers. `priority`: its place under the
    "priority" scheduling policy (lower first, ties by arrival; `policy.py`).
    """
    return self._queue(self._intake.prepare(prompt, params, request_id, priority))

  def has_unfinished(self) -> bool:
    """Requests queued or running, or finished outputs not yet returned by `step`."""
    return (bool(self._outbox) or self._in_flight is not None
            or self.scheduler.has_unfinished())

  def generate(self, prompts: Seq[Seq[int]],
               params: Union[SamplingParams, Seq[SamplingParams], None] = None
               ) -> List[RequestOutput]:
    """Runs prompts to completion; their outputs in prompt order. All or nothing: the whole
    batch is validated first. Other requests' outputs stay for the next `step()`."""
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"params must be one SamplingParams or {len(prompts)}, got {len(params)}")
    groups = [self._intake.prepare(p, sp, None) for p, sp in zip(prompts, params)]
    ids = [self._queue(g) for g in groups]
    while any(i not in self._outbox for i in ids):
      if not self._step_once():
        raise RuntimeError("the engine made no progress with requests left")
    return [self._outbox.pop(i) for i in ids]

  def abort(self, request_id: Any) -> Optional[RequestOutput]:
    """Stops a request and frees its blocks now; returns its output so far (finish reason
    "abort"), its full output if finished but not yet returned, None for an unknown id."""
    self._finish_in_flight()
    if request_id in self._outbox:
      return self._outbox.pop(request_id)
    batch = self.scheduler.plan_abort(request_id)
    if batch is None:
      return None
    self._run(batch, report=False)
    return self._outbox.pop(request_id)

  def partial_outputs(self, request_id: Any) -> Optional[RequestOutput]:
    """For streaming, with no device work: a queued or running request's output so far
    as of the last step applied (samples in index order, a running one's finish reason
    None; beams: empty until the end); None once finished or for an unknown id."""
    group = self.scheduler.groups.get(request_id)
    return None if group is None else partial_output(group)

  # ---- the step ------------------------------------------------------------------------
  def step(self) -> List[RequestOutput]:
    """Runs one device step (or finishes an interrupted one); returns every output
    finished since the last call, each once. `last_step` then says what it did.

    `timing` accumulates wall seconds: "step_s" (all of it) and "device_s" (the
    jitted call until its outputs reach the host); the rest is host overhead.
    """
    t0 = time.perf_counter()
    try:
      self._step_once()
    finally:
      self.timing["step_s"] += time.perf_counter() - t0
    outs = list(self._outbox.values())
    self._outbox.clear()
    return outs

  def _step_once(self) -> bool:
    """One step, its owed frees, and its report; False when there was nothing to run."""
    ran = self._advance()
    if self.scheduler.frees_owed():
      self.flush()
    self._last_step, self._report_base = report_lib.step_report(
        self.scheduler, self._report_base, self._applied)
    self._applied = None
    return ran

  def _advance(self) -> bool:
    """schedule -> build_inputs -> step -> device_get -> update; False: nothing to run."""
    if self._in_flight is not None:
      self._finish_in_flight()
      return True
    sched = self.scheduler
    if not sched.has_unfinished():
      return False
    if self._drafter is not None:   # the draft model's dispatch: the plan takes its drafts
      self._drafter.prepare(self.state, sched)
    batch = sched.schedule()
    if batch.runs_nothing:
      raise RuntimeError(
          f"the scheduler found nothing to run with {len(sched.running)} running, "
          f"{len(sched.waiting)} waiting, {len(sched.swapped)} swapped requests and "
          f"{sched.counts.available} available blocks")
    self._run(batch, report=True)
    return True

  def _run(self, batch: Batch, report: bool) -> None:
    """Runs a plan: swap-outs, inputs, the jitted step, the update (no work: no dispatch)."""
    if batch.runs_nothing and not batch.swap_out:
      with sigint_deferred():
        self._apply(batch, None, None)
      return
    before = report_lib.Before.of(batch, self.scheduler)
    batch.swapped_out = swap.copy_out(self.state, batch)   # before the step frees them
    inputs, batch.bucket = build_inputs(
        batch, before.running, buckets=self._buckets, max_seqs=self.cache_config.max_seqs,
        lookup_len=self._lookup_len, vocab_size=self.model_config.vocab_size,
        idle_all_greedy=self._last_all_greedy)
    self._dispatch(batch, inputs, before if report else None)
    self._finish_in_flight()

  def _dispatch(self, batch: Batch, inputs, before) -> None:
    """Swap-ins and the jitted step; the new state is kept before anything can raise."""
    bucket = batch.bucket
    with sigint_deferred():
      restored, exchanged = [], None
      try:
        for group in batch.swapped_in:   # each its own donated call: keep every new state
          self.state = swap.copy_in(self.state, group, [batch.slot(q) for q in group.seqs])
          restored.append(group)
        # The host tier's one extra call, where needed (kv_tiers.py, tier.py).
        tier_plan = self._tiers.plan(batch, inputs, self.scheduler, bool(restored))
        if tier_plan is not None:
          self.state, tier_out = tier_lib.exchange(self.state, tier_plan,
                                                   self.decode_steps_per_sync)
          exchanged = (tier_plan, tier_out)
        self._compiled.note(bucket, self._buckets)   # logs a shape's first (compiling) call
        t0 = time.perf_counter()
        self.state, out = self._step(self.params, self.state, inputs, **bucket.step_kw)
      except BaseException:
        if consumed(self.state):
          raise RuntimeError("the engine's device state was consumed by a step that failed; "
                             "the engine cannot continue") from None
        if restored:   # those rows are on device now: the records must say so
          self._apply(Batch(swapped_in=restored, slot_of=batch.slot_of, group_slots={
              g: batch.group_slots[g] for g in restored}), None, None)
        if exchanged:   # the device did it: the host tier and counts must say so
          self._finish_exchange(*exchanged)
        raise
      self._in_flight = (batch, out, t0, before)
      self._last_all_greedy = bucket.all_greedy
      if exchanged:      # downloads the victims while the step runs
        self._finish_exchange(*exchanged)

  def _finish_exchange(self, tier_plan, tier_out) -> None:
    """The host side of a host-tier exchange (call with SIGINT held)."""
    counts, error = self._tiers.finish(tier_plan, tier_out, self.scheduler.counts)
    self.scheduler.update(Batch(), counts)
    if error is not None:   # the host tier dropped what it could not store; all else stands
      raise error

  def _finish_in_flight(self) -> None:
    """Waits for the step in flight (the one host sync) and updates from its outputs."""
    if self._in_flight is None:
      return
    batch, out, t0, before = self._in_flight
    out = fetch(out)   # one transfer: the outputs come packed in one buffer
    self.timing["device_s"] += time.perf_counter() - t0
    with sigint_deferred():   # the update and the end of the flight together
      self._apply(batch, out, before)

  def _apply(self, batch: Batch, out, before) -> None:
    """`Scheduler.update` and the engine's own records of it (call with SIGINT held)."""
    finished = self.scheduler.update(batch, out)
    self._in_flight = None
    self._tiers.read_step_log(out, self.state)
    for o in finished:
      self._outbox[o.request_id] = o
    if before:
      self._applied = before.parts(batch, out, finished, batch.bucket)

  def kv_events(self) -> List[events_lib.KVEvent]:
    """Drains the KV cache events since the last call, oldest first (vLLM's KV events:
    `prefix_cache.events.KVEvent`, `.kind` "stored" / "removed" / "cleared",
    `.block_hashes`, `.parent_block_hash`, `.medium` "device" / "host"): exactly what
    both tiers stored and removed. A step still in flight is finished first (its sync).
    """
    self._finish_in_flight()
    return self._tiers.drain()

  def flush(self) -> None:
    """Runs what the last update left (frees, beam forks, a swap-out) in a dispatch that
    computes nothing; a no-op when nothing is left."""
    self._finish_in_flight()
    batch = self.scheduler.carried()
    if batch.runs_nothing and not batch.swap_out:
      return
    self._run(batch, report=False)

  def fresh_copy(self) -> "Engine":
    """A fresh-state engine of the same model, params and options, sharing its jitted step."""
    return Engine(self.model_config, self.params, self.cache_config, options=self.options)

  # ---- compiled shapes -----------------------------------------------------------------
  @property
  def buckets(self) -> StepBuckets:
    """The step's shape buckets (see `buckets.reachable_buckets` for a run's set)."""
    return self._buckets

  @property
  def buckets_seen(self) -> frozenset:
    """Buckets this engine's step (shared by engines of the same step) was compiled for."""
    return frozenset(self._compiled.seen)

  def compile_buckets(self, shapes: Seq[Bucket], *, all_greedy: Seq[bool] = (False, True),
                      max_shapes: Optional[int] = None) -> Dict[str, Any]:
    """Compiles the step ahead of time, with no device work, for each shape bucket in
    `shapes` ((T, R, W, decode_only) tuples, e.g. `buckets.reachable_buckets`) and each
    sampling variant in `all_greedy` (True: every running request greedy), unless done
    already for this engine's argument shapes; no step of those shapes compiles later.
    At most `max_shapes` (default `buckets.max_variants`), else ValueError. Returns
    {"compiled", "already", "seconds"}."""
    bound = self._buckets.max_variants if max_shapes is None else max_shapes
    return self._compiled.compile_ahead(self.params, self.state, shapes,
                                        lookup_tokens=self._lookup_len,
                                        max_seqs=self.cache_config.max_seqs,
                                        all_greedy=all_greedy, max_shapes=bound)

  # ---- observability -------------------------------------------------------------------
  @property
  def last_step(self) -> report_lib.StepReport:
    """What the last `step()` did (a frozen StepReport; see `report.py`)."""
    return self._last_step

  @property
  def num_free(self) -> int:
    """Blocks the next plan may use: free plus evictable (as of the last step)."""
    return self.scheduler.counts.available

  num_preemptions = property(lambda self: self.scheduler.num_preemptions)
  num_swaps = property(lambda self: self.scheduler.num_swaps)

  def metrics(self) -> Dict[str, Any]:
    """KV usage, queues and prefix-cache hits as of the last step (no device work);
    exact: a returned request's blocks count as free or evictable (`report.metrics`)."""
    out = report_lib.metrics(self.scheduler, self.cache_config, self.stats)
    out.update(self._tiers.metrics())
    return out

  def prefix_stats(self) -> Dict[str, float]:
    """Prefix-cache counters read from the device (one sync): hit / query blocks,
    evictions, cached and evictable blocks; host counts of hit and prefill tokens."""
    if self.state.prefix is None:
      raise ValueError("prefix_stats needs cache_config.enable_prefix_caching=True")
    self._finish_in_flight()
    return kv_tiers.prefix_stats(self.state, self.stats)

  def reset_prefix_cache(self) -> None:
    """Drops every cached block (running sequences keep theirs) and zeroes the
    prefix counters and the recent hit fraction the planner reads."""
    if self.state.prefix is None:
      raise ValueError("reset_prefix_cache needs cache_config.enable_prefix_caching=True")
    self.flush()
    self.state = kv_tiers.reset_device_cache(self.state)
    with sigint_deferred():     # both tiers are empty now: one "cleared" event each
      self._tiers.cleared()
    counts = kv_tiers.counts_after_reset(self.state, self.scheduler.counts)
    with sigint_deferred():
      self.scheduler.update(Batch(reset_prefix=True), counts)
