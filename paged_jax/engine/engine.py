"""The serving engine: requests in, tokens out, one jitted device step per step.

    engine = Engine(model_config, params, cache_config, max_num_batched_tokens=256)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16, temperature=0))
    outs[0].outputs[0]          # generated ids of the first prompt

Host side: `Scheduler` (FCFS, chunked prefill, preemption) decides what runs;
`_build_inputs` turns its plan into fixed-shape arrays; `step.make_step` runs
it on device (allocation, copy-on-write, KV writes, attention, sampling, and
`decode_steps_per_sync - 1` more decode steps); the results update the host's
sequences. Parallel sampling forks the prompt's blocks; beam search forks
beams and relies on copy-on-write. See ARCHITECTURE.md "Data flow of one engine step".
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence as Seq, Union

import jax
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import kv_cache
from paged_jax.config import CacheConfig, ModelConfig, OK
from paged_jax.engine import beam as beam_lib
from paged_jax.engine import swap
from paged_jax.engine.params import MAX_STOP_IDS, RequestOutput, SamplingParams
from paged_jax.engine.scheduler import Batch, Group, Scheduler, Sequence, cdiv
from paged_jax.engine.step import EngineState, StepInputs, make_step

log = logging.getLogger("paged_jax.engine")
_STEP_CACHE: Dict[Any, Any] = {}   # (model_config, backend, K, C) -> jitted step


class Engine:
  """Continuous-batching PagedAttention engine over `LlamaForCausalLM`.

  Args:
    model_config: the model's ModelConfig.
    params: its parameters ({"params": ...} or the bare tree).
    cache_config: CacheConfig whose layer/head shapes match the model.
    max_num_batched_tokens: per-step token budget (prefill chunks + decodes).
    decode_steps_per_sync: decode steps per device call (multi-step decoding).
    preemption_mode: "recompute" (default) or "swap" (to host memory).
    attention_backend: "auto", "reference", "pallas", "pallas_interpret".
    max_beam_width: largest beam_width accepted (sets the candidate count).
    model_apply: replaces `LlamaForCausalLM(...).apply` in the jitted step (same
      signature); `paged_jax.distributed` passes its tensor-parallel forward.
    init_state: `cache_config -> EngineState`, e.g. pages created already sharded.
  With `cache_config.enable_prefix_caching`, `Engine(...)` builds a
  `prefix_admission.PrefixCachingEngine` (automatic prefix caching).
  """

  def __new__(cls, model_config=None, params=None, cache_config=None, *args, **kwargs):
    del model_config, params, args, kwargs
    if cls is Engine and getattr(cache_config, "enable_prefix_caching", False):
      from paged_jax.engine.prefix_admission import PrefixCachingEngine  # pylint: disable=g-import-not-at-top
      return super().__new__(PrefixCachingEngine)
    return super().__new__(cls)

  def __init__(self, model_config: ModelConfig, params, cache_config: CacheConfig, *,
               max_num_batched_tokens: int = 256, decode_steps_per_sync: int = 1,
               preemption_mode: str = "recompute", attention_backend: str = "auto",
               max_beam_width: int = 4, model_apply: Optional[Callable[..., Any]] = None,
               init_state: Optional[Callable[[CacheConfig], EngineState]] = None):
    from paged_jax.attention import resolve_backend  # pylint: disable=g-import-not-at-top
    from paged_jax.models.llama import LlamaForCausalLM  # pylint: disable=g-import-not-at-top
    if not isinstance(model_config, ModelConfig):
      raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
    for name in ("num_layers", "num_kv_heads", "head_dim"):
      if getattr(cache_config, name) != getattr(model_config, name):
        raise ValueError(f"cache_config.{name}={getattr(cache_config, name)} does not match "
                         f"the model's {name}={getattr(model_config, name)}")
    for name, value, lo in (("max_num_batched_tokens", max_num_batched_tokens, 1),
                            ("decode_steps_per_sync", decode_steps_per_sync, 1),
                            ("max_beam_width", max_beam_width, 1)):
      if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    if preemption_mode not in ("recompute", "swap"):
      raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
    resolve_backend(attention_backend)
    self.model_config = model_config
    self.cache_config = cache_config
    self.params = params if "params" in params else {"params": params}
    self.decode_steps_per_sync = decode_steps_per_sync
    self.max_beam_width = max_beam_width
    self.max_num_batched_tokens = max_num_batched_tokens
    self.max_model_len = min(cache_config.max_seq_len, model_config.max_position_embeddings)
    self._num_candidates = min(model_config.vocab_size, 2 * max_beam_width)
    key = (model_config, attention_backend, decode_steps_per_sync, self._num_candidates)
    if model_apply is not None:  # e.g. the tensor-parallel forward (paged_jax.distributed)
      self._step = make_step(model_apply, num_decode_steps=decode_steps_per_sync,
                             num_candidates=self._num_candidates,
                             name=getattr(model_apply, "__qualname__", "custom").replace(".", "_"))
    else:
      if key not in _STEP_CACHE:  # engines of one model share compiled steps
        model = LlamaForCausalLM(model_config, attention_backend=attention_backend)
        _STEP_CACHE[key] = make_step(model.apply, num_decode_steps=decode_steps_per_sync,
                                     num_candidates=self._num_candidates)
      self._step = _STEP_CACHE[key]
    # Two token buckets: decode-sized (max_seqs) and the full budget -> at most 2 traces.
    s = cache_config.max_seqs
    self._buckets = sorted({min(s, max_num_batched_tokens), max_num_batched_tokens})
    self.state = (init_state(cache_config) if init_state is not None else
                  EngineState(blocks=bm.init(cache_config), pages=kv_cache.init(cache_config)))
    self.num_free = cache_config.num_blocks
    self.scheduler = Scheduler(block_size=cache_config.block_size, max_seqs=s,
                               max_num_batched_tokens=max_num_batched_tokens,
                               preemption_mode=preemption_mode)
    self._ids = itertools.count()
    self._seq_ids = itertools.count()
    self._groups: Dict[Any, Group] = {}
    self.stats = collections.Counter()
    self.timing = collections.Counter()
    log.info("paged_jax engine: block_size=%d num_blocks=%d KV capacity=%d tokens "
             "(%.1f MiB %s), max_seqs=%d, max_model_len=%d, budget=%d tokens/step, "
             "decode_steps_per_sync=%d, preemption=%s",
             cache_config.block_size, cache_config.num_blocks, cache_config.num_slots,
             cache_config.kv_cache_bytes / 2**20, cache_config.dtype, s, self.max_model_len,
             max_num_batched_tokens, decode_steps_per_sync, preemption_mode)

  # ---- requests ------------------------------------------------------------------------
  def add_request(self, prompt: Seq[int], params: Optional[SamplingParams] = None,
                  request_id: Any = None) -> Any:
    """Queues a request; validates everything before any device work."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
      raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    vocab = self.model_config.vocab_size
    prompt = [t for t in prompt] if prompt is not None else []
    if not prompt:
      raise ValueError("prompt must hold at least one token id")
    for i, t in enumerate(prompt):
      if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
        raise ValueError(f"prompt[{i}]={t!r} is not a token id in [0, {vocab})")
    for t in params.stop_token_ids:
      if t >= vocab:
        raise ValueError(f"stop_token_ids holds {t}, outside [0, {vocab})")
    if params.beam_width > self.max_beam_width:
      raise ValueError(f"beam_width must be <= max_beam_width={self.max_beam_width}, "
                       f"got {params.beam_width}")
    p, m = len(prompt), params.max_tokens
    if p + m - 1 > self.max_model_len:
      raise ValueError(f"prompt of {p} tokens + max_tokens={m} needs {p + m - 1} cached tokens; "
                       f"the context holds {self.max_model_len}")
    c = self.cache_config
    if params.num_seqs > c.max_seqs:
      raise ValueError(f"n / beam_width ({params.num_seqs}) exceeds max_seqs={c.max_seqs}")
    # Worst case with only the prompt's full blocks shared.
    shared = p // c.block_size
    worst = shared + params.num_seqs * (cdiv(p + m - 1, c.block_size) - shared)
    if worst > c.num_blocks:
      raise ValueError(f"request can never fit: it may need {worst} blocks of {c.block_size} "
                       f"tokens, the cache has num_blocks={c.num_blocks}")
    rid = next(self._ids) if request_id is None else request_id
    if rid in self._groups:
      raise ValueError(f"request_id {rid!r} is already in use")
    count = 1 if params.beam_width > 1 else params.n
    seqs = [Sequence(seq_id=next(self._seq_ids), index=j, sample_seed=params.seed + j,
                     tokens=list(int(t) for t in prompt), prompt_len=p, pending_fork=j > 0)
            for j in range(count)]
    group = Group(request_id=rid, arrival=next(self._ids), params=params,
                  prompt=list(prompt), seqs=seqs, slots_needed=params.num_seqs)
    self._groups[rid] = group
    self.scheduler.add(group)
    return rid

  def has_unfinished(self) -> bool:
    return self.scheduler.has_unfinished()

  def generate(self, prompts: Seq[Seq[int]],
               params: Union[SamplingParams, Seq[SamplingParams], None] = None
               ) -> List[RequestOutput]:
    """Runs prompts to completion; outputs in prompt order."""
    if params is None or isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"params must be one SamplingParams or {len(prompts)}, got {len(params)}")
    ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: Dict[Any, RequestOutput] = {}
    while self.has_unfinished():
      for out in self.step():
        done[out.request_id] = out
    self.flush()
    return [done[i] for i in ids]

  # ---- the step ------------------------------------------------------------------------
  def step(self) -> List[RequestOutput]:
    """Schedules and runs one device step; returns requests finished by it.

    `timing` accumulates wall seconds: "step_s" (all of it) and "device_s" (the
    jitted call until its outputs reach the host); the rest is host overhead.
    """
    t0 = time.perf_counter()
    try:
      return self._step_once()
    finally:
      self.timing["step_s"] += time.perf_counter() - t0

  def _step_once(self) -> List[RequestOutput]:
    sched = self.scheduler
    for _ in range(self.cache_config.max_seqs + 2):
      batch = sched.schedule(self.num_free)
      self._swap_outs()
      self._swap_ins(batch)
      if not (batch.chunks or batch.frees or batch.forks):
        if sched.has_unfinished() and not batch.swap_in:
          raise RuntimeError("the scheduler cannot make progress: no running request fits "
                             f"the cache ({self.num_free} free blocks)")
        return []
      inputs = self._build_inputs(batch)
      t0 = time.perf_counter()
      self.state, out = self._step(self.params, self.state, inputs)
      out = jax.device_get(out)
      self.timing["device_s"] += time.perf_counter() - t0
      self.stats["device_steps"] += 1
      self.num_free = int(out.num_free)
      if out.ok:
        break
      self.stats["out_of_blocks_retries"] += 1
      sched.preempt_newest()
      self._swap_outs()
    else:
      raise RuntimeError("step failed OUT_OF_BLOCKS after preempting every request")
    sched.commit(batch)
    self.stats["steps"] += 1
    self.stats["loop_out_of_blocks"] += int(out.loop_out_of_blocks)
    return self._process(batch, out)

  def flush(self) -> None:
    """Applies pending frees (runs an empty step) so the device state is clean."""
    if self.scheduler.pending_frees:
      batch = Batch(frees=list(self.scheduler.pending_frees))
      self.state, out = self._step(self.params, self.state, self._build_inputs(batch))
      self.num_free = int(jax.device_get(out.num_free))
      self.scheduler.commit(batch)

  @property
  def num_preemptions(self) -> int:
    return self.scheduler.num_preemptions

  @property
  def num_swaps(self) -> int:
    return self.scheduler.num_swaps

  def _swap_outs(self) -> None:
    for seq, slot in self.scheduler.pending_swap_outs:
      seq.swapped_kv = swap.swap_out(self.state, slot, seq.num_computed)
      self.stats["swap_out_bytes"] += seq.swapped_kv.nbytes
    self.scheduler.pending_swap_outs = []

  def _swap_ins(self, batch: Batch) -> None:
    for seq in batch.swap_in:
      if seq.swapped_kv is None:   # already restored by an earlier attempt of this step
        continue
      self.state, status = swap.swap_in(self.state, seq.slot, seq.swapped_kv)
      if int(status) != OK:
        raise RuntimeError(f"swap-in of slot {seq.slot} failed with status {int(status)}")
      seq.swapped_kv = None
      self.num_free -= cdiv(seq.num_computed, self.cache_config.block_size)

  def _build_inputs(self, batch: Batch) -> StepInputs:
    s = self.cache_config.max_seqs
    t_max = next(b for b in self._buckets if b >= batch.num_tokens)
    i32 = lambda n, v=0: np.full((n,), v, np.int32)
    a = dict(tokens=i32(t_max), positions=i32(t_max), token_row=i32(t_max, -1),
             row_slot=i32(s, -1), row_q_len=i32(s), free_slots=i32(s, -1), fork_src=i32(s, -1),
             fork_dst=i32(s, -1), alloc_tokens=i32(s), append_tokens=i32(s),
             sample_row=i32(s, -1), post_fork_src=i32(s, -1),
             temperature=np.zeros((s,), np.float32), top_k=i32(s), top_p=np.ones((s,), np.float32),
             seed=i32(s), sample_index=i32(s), remaining=i32(s, 1),
             stop_ids=np.full((s, MAX_STOP_IDS), -1, np.int32), multi_step=np.zeros((s,), bool))

    def sampling_row(seq: Sequence, group: Group, row: int):
      sp, slot = group.params, seq.slot
      a["sample_row"][slot] = row
      a["temperature"][slot] = sp.temperature
      a["top_k"][slot] = sp.top_k
      a["top_p"][slot] = sp.top_p
      a["seed"][slot] = seq.sample_seed
      a["sample_index"][slot] = seq.num_generated
      a["remaining"][slot] = sp.max_tokens - seq.num_generated
      a["stop_ids"][slot, :len(sp.stop_token_ids)] = sp.stop_token_ids
      a["multi_step"][slot] = sp.beam_width == 1

    owner = {id(q): g for g in self.scheduler.running for q in g.seqs}
    t, leader_row = 0, {}
    for r, ch in enumerate(batch.chunks):
      seq, n, nc = ch.seq, ch.num_tokens, ch.seq.num_computed
      a["tokens"][t:t + n] = seq.tokens[nc:nc + n]
      a["positions"][t:t + n] = np.arange(nc, nc + n)
      a["token_row"][t:t + n] = r
      a["row_slot"][r], a["row_q_len"][r] = seq.slot, n
      (a["alloc_tokens"] if ch.allocate else a["append_tokens"])[seq.slot] = n
      leader_row[id(seq)] = r
      if ch.samples:
        sampling_row(seq, owner[id(seq)], r)
      t += n
    for leader, child in batch.post_forks:
      a["post_fork_src"][child.slot] = leader.slot
      if len(child.tokens) == child.prompt_len:
        sampling_row(child, owner[id(child)], leader_row[id(leader)])
    a["free_slots"][:len(batch.frees)] = batch.frees
    for i, (parent, child) in enumerate(batch.forks):
      a["fork_src"][i], a["fork_dst"][i] = parent.slot, child.slot
    return StepInputs(**a)

  # ---- results -------------------------------------------------------------------------
  def _process(self, batch: Batch, out) -> List[RequestOutput]:
    finished = []
    owner = {id(q): g for g in self.scheduler.running for q in g.seqs}
    sampled = [ch.seq for ch in batch.chunks if ch.samples]
    for ch in batch.chunks:
      ch.seq.num_computed += ch.num_tokens
    sampled += [c for _, c in batch.post_forks if len(c.tokens) == c.prompt_len]
    beam_groups = []
    for seq in sampled:
      group, slot = owner[id(seq)], seq.slot
      if group.is_beam:
        seq.topk = (out.topk_logprobs[slot], out.topk_ids[slot])
        if group not in beam_groups:
          beam_groups.append(group)
        continue
      for k in range(out.tokens.shape[0]):
        if not out.valid[k, slot]:
          break
        if k > 0:
          seq.num_computed += 1
        tok = int(out.tokens[k, slot])
        seq.tokens.append(tok)
        self.stats["generated_tokens"] += 1
        if tok in group.params.stop_token_ids:
          self._finish_seq(group, seq, "stop", finished)
          break
        if seq.num_generated >= group.params.max_tokens:
          self._finish_seq(group, seq, "length", finished)
          break
    for group in beam_groups:
      if all(q.topk is not None for q in group.seqs):
        self._beam_step(group, finished)
    return finished

  def _finish_seq(self, group: Group, seq: Sequence, reason: str, finished: list) -> None:
    seq.finish_reason = reason
    group.seqs.remove(seq)
    group.finished.append(seq)
    self.scheduler.free_seq(seq)
    if not group.seqs:
      self._finish_group(group, finished)

  def _finish_group(self, group: Group, finished: list) -> None:
    self.scheduler.finish_group(group)
    del self._groups[group.request_id]
    if group.is_beam:
      best = sorted(group.finished, key=lambda q: -q.cum_logprob)[:group.params.n]
    else:
      best = sorted(group.finished, key=lambda q: q.index)
    finished.append(RequestOutput(
        request_id=group.request_id, prompt_token_ids=group.prompt,
        outputs=[q.tokens[q.prompt_len:] for q in best],
        finish_reasons=[q.finish_reason for q in best],
        cumulative_logprobs=[q.cum_logprob for q in best] if group.is_beam else None,
        num_preemptions=group.num_preemptions))

  def _beam_step(self, group: Group, finished: list) -> None:
    """Selects the next beams; forks parents chosen more than once, frees dropped ones."""
    sp, live = group.params, list(group.seqs)
    topv = np.stack([q.topk[0] for q in live])
    topi = np.stack([q.topk[1] for q in live])
    chosen, ended = beam_lib.select([q.cum_logprob for q in live], topv, topi,
                                    sp.beam_width, sp.stop_token_ids)
    for b, tok, score in ended:
      group.finished.append(Sequence(seq_id=next(self._seq_ids), index=0, sample_seed=0,
                                     tokens=live[b].tokens + [tok], prompt_len=live[b].prompt_len,
                                     cum_logprob=score, finish_reason="stop"))
    kids = collections.defaultdict(list)
    for b, tok, score in chosen:
      kids[b].append((tok, score))
    kept = {live[b].slot for b in kids}
    spare = [s for s in group.slots if s not in kept]
    bs = self.cache_config.block_size
    new_live = []
    for b, parent in enumerate(live):
      parent.topk = None
      if not kids[b]:
        self.scheduler.free_seq(parent)
        continue
      base = list(parent.tokens)
      for i, (tok, score) in enumerate(kids[b]):
        if i == 0:
          target = parent
        else:
          target = Sequence(seq_id=next(self._seq_ids), index=0, sample_seed=0,
                            tokens=list(base), prompt_len=parent.prompt_len,
                            num_computed=parent.num_computed, slot=spare.pop(0))
          shared = parent.num_computed % bs != 0
          target.last_block_shared = parent.last_block_shared = shared
          self.scheduler.pending_forks.append((parent, target))
        target.tokens.append(tok)
        target.cum_logprob = score
        new_live.append(target)
    group.seqs = new_live
    self.stats["generated_tokens"] += len(new_live)
    done = (new_live and new_live[0].num_generated >= sp.max_tokens) or (
        len(group.finished) >= sp.beam_width)
    if done or not new_live:
      for q in list(group.seqs):
        if q.num_generated >= sp.max_tokens:
          q.finish_reason = "length"
          group.finished.append(q)
      self._finish_group(group, finished)
