"""Serving harness: scaled streams, the tiny-model engine, batch and online (arrival-driven) serving.

    requests = serving.scaled_requests("sharegpt", 32, seed=0)     # lengths / 4, max 256
    engine = serving.make_engine(block_size=16, kv_budget_tokens=2048, max_seqs=64)
    result = serving.serve(engine, requests, lambda r: SamplingParams(max_tokens=r.output_len))
    result["tokens_per_s"], result["mean_latency_s"], result["sharing_savings"]

Scaling (what is synthetic): the streams are `paged_jax.bench.workloads`' seeded
ShareGPT-like / Alpaca-like lengths (Table 1 means) with every mean divided by
`STREAM_SCALE[dataset]` (ShareGPT 4, Alpaca 1) and clipped to `max_len` tokens,
so the shipped tiny byte-level model (4 layers, 1024 positions) serves a stream on
2 CPU cores in seconds. Token ids are seeded uniform bytes in [0, 256). The model
runs to `output_len` (no EOS stop), so the lengths are the stream's.

Everything here is flag-free (importable from tests and the notebook).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from paged_jax.bench import workloads
from paged_jax.bench.arrivals import StepClock, WallClock, arrival_times  # noqa: F401  (re-exported)

# Mean-length divisor per stream for engine runs (memory-only simulations use 1).
STREAM_SCALE = {"sharegpt": 4, "alpaca": 1}
ENGINE_MAX_LEN = 256          # context limit of the engine streams (tokens)
MAX_BEAM_WIDTH = 6            # one compiled step for every n / beam width up to 6


def scaled_requests(dataset: str, num_requests: int, *, seed: int = 0,
                    max_len: int = ENGINE_MAX_LEN, scale: Optional[float] = None
                    ) -> List[workloads.Request]:
  """A synthetic stream whose mean lengths are Table 1's divided by `scale`.

  Args:
    dataset: "sharegpt" or "alpaca".
    num_requests: requests (>= 1).
    seed: stream seed.
    max_len: context limit; prompt + output <= max_len.
    scale: mean divisor (default `STREAM_SCALE[dataset]`).
  Returns:
    workloads.Request list, all arriving at t = 0, ids in [0, 256).
  """
  if dataset not in workloads.DATASETS:
    raise ValueError(f"dataset must be one of {sorted(workloads.DATASETS)}, got {dataset!r}")
  scale = STREAM_SCALE[dataset] if scale is None else scale
  if not scale >= 1:
    raise ValueError(f"scale must be >= 1, got {scale}")
  base = workloads.DATASETS[dataset]
  spec = workloads.DatasetSpec(
      f"{dataset}/{scale:g}",
      workloads.LengthSpec(base.prompt.mean / scale, base.prompt.sigma),
      workloads.LengthSpec(base.output.mean / scale, base.output.sigma))
  prompts, outputs = workloads.sample_lengths(spec, num_requests, seed=seed, max_len=max_len)
  rng = np.random.default_rng([seed, 7])
  return [workloads.Request(i, rng.integers(0, 256, int(p), dtype=np.int32), int(o))
          for i, (p, o) in enumerate(zip(prompts, outputs))]


@functools.lru_cache(maxsize=2)
def tiny_model(checkpoint: Optional[str] = None):
  """(ModelConfig, params) of the shipped tiny byte-level Llama (or `checkpoint`)."""
  from paged_jax.models import DEFAULT_CHECKPOINT, load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  return load_hf_checkpoint(checkpoint or DEFAULT_CHECKPOINT)


def make_engine(*, block_size: int, kv_budget_tokens: int, max_seqs: int = 64,
                max_len: int = ENGINE_MAX_LEN, preemption_mode: str = "recompute",
                attention_backend: str = "auto", max_num_batched_tokens: int = 256,
                checkpoint: Optional[str] = None):
  """An Engine over the tiny model whose KV pool holds `kv_budget_tokens` token slots.

  `kv_budget_tokens` must be a multiple of `block_size`. With `block_size ==
  max_len` every sequence takes one max_len-token block at admission: a
  contiguous Orca(Max) reservation served by the same engine.
  """
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  if kv_budget_tokens % block_size:
    raise ValueError(f"kv_budget_tokens must be a multiple of block_size={block_size}, "
                     f"got {kv_budget_tokens}")
  if kv_budget_tokens < max_len:
    raise ValueError(f"kv_budget_tokens must be >= max_len={max_len}, got {kv_budget_tokens}")
  model_config, params = tiny_model(checkpoint)
  cache_config = model_config.cache_config(
      block_size=block_size, num_blocks=kv_budget_tokens // block_size, max_seqs=max_seqs,
      max_blocks_per_seq=-(-max_len // block_size))
  return Engine(model_config, params, cache_config, max_num_batched_tokens=max_num_batched_tokens,
                preemption_mode=preemption_mode, attention_backend=attention_backend,
                max_beam_width=MAX_BEAM_WIDTH)


def greedy(request) -> "SamplingParams":
  """Greedy decoding for `request.output_len` tokens (no stop id)."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  return SamplingParams(max_tokens=request.output_len, temperature=0.0)


def warm_up(engine, requests: Optional[Sequence] = None,
            params_fn: Optional[Callable] = None) -> Dict:
  """Compiles `engine`'s step, before anything is timed, for every shape bucket a run
  of `requests` can reach (`paged_jax.engine.reachable_buckets`), ahead of time:
  nothing runs on the device, the engine's state is untouched; logged at INFO.

  The reachable set: at most min(max_seqs, num_blocks) live sequences (each holds a
  block of its own; max_seqs when blocks can be shared: n > 1, beams, prefix caching),
  none longer than the longest request (prompt + output), n sampled lanes per row for
  parallel sampling; the all-greedy step variant if a request is greedy, the sampling
  one if a request samples. Without `requests`, any request the engine takes
  (max_model_len, n up to its max_beam_width, both variants).

  Args:
    engine: a `paged_jax.engine.Engine` (shape buckets on or off).
    requests: the workload.Request list to be served (lengths), or None.
    params_fn: request -> SamplingParams (default greedy).
  Returns:
    {"shapes": buckets in the set, "compiled", "already" (compiled before), "seconds"}.
  """
  from paged_jax.engine import reachable_buckets  # pylint: disable=g-import-not-at-top
  c = engine.cache_config
  if requests is None:
    max_len, lanes, shared = engine.max_model_len, engine.max_beam_width, True
    variants = (False, True)
  else:
    params = [(params_fn or greedy)(r) for r in requests]
    max_len = min(engine.max_model_len, max(r.total_len for r in requests))
    lanes = max(p.n if p.beam_width == 1 else 1 for p in params)
    shared = any(p.num_seqs > 1 for p in params)
    variants = tuple({p.temperature == 0 for p in params})
  shared = shared or engine.prefix_caching
  max_rows = c.max_seqs if shared else min(c.max_seqs, c.num_blocks)
  shapes = reachable_buckets(engine.buckets, max_rows=max_rows, max_len=max_len,
                             lanes_per_row=lanes)
  return dict(engine.compile_buckets(shapes, all_greedy=variants),
              shapes=len(shapes) * len(variants))


def serve(engine, requests: Sequence, params_fn: Callable = greedy, *,
          track_sharing: bool = False, warmup="replay", keep_outputs: bool = False,
          progress=None) -> Dict:
  """Serves `requests` (all arriving at t = 0) to completion on `engine`; measures it.

  Args:
    engine: a fresh `paged_jax.engine.Engine`.
    requests: workloads.Request list.
    params_fn: request -> SamplingParams.
    track_sharing: read `metrics.sharing_savings` of the block state after every
      step (one host read per step) and report its step-summed ratio.
    warmup: how the shapes the run meets are compiled before the timing. "replay"
      (default): the same requests run untimed on `engine.fresh_copy()`; arrivals at
      t = 0 make the schedule deterministic, so exactly the shapes of the timed run
      compile, usually far fewer than the reachable set. "reachable" (or True): every
      shape the run can reach, ahead of time (`warm_up`). None / False: no warm-up.
    keep_outputs: also return "outputs": per request (stream order), the generated ids
      of each sample / hypothesis.
    progress: optional object with `update(n)` (a tqdm bar), called per finished request.
  Returns:
    {"requests", "seconds", "requests_per_s", "tokens_per_s" (generated tokens, every
    sample or beam counted), "generated_tokens", "mean_latency_s", "p90_latency_s"
    (finish time of each request), "steps", "preemptions", "swaps",
    "tokens_per_step" (machine-independent), "mean_running_seqs", "max_running_seqs",
    "sharing_savings" (1 - sum of used blocks / sum of blocks without sharing, over
    steps; None unless tracked), "engine_step_s" / "device_s" / "host_s" (inside
    engine.step: all / jitted call to outputs on host / the rest), "step_traces_in_run"
    (step traces inside the timing: 0 after a complete warm-up), "device_steps" (jitted
    calls), "computed_tokens" (scheduled, recomputation included), "bucket_tokens"
    (computed by the calls' shape buckets, padding included), "warm_up" (its dict)}.
  """
  from paged_jax.bench import memory as metrics  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import step as step_lib  # pylint: disable=g-import-not-at-top
  if warmup == "replay":
    t0, twin = time.perf_counter(), engine.fresh_copy()
    twin.generate([list(map(int, r.prompt_token_ids)) for r in requests],
                  [params_fn(r) for r in requests])
    warm = {"replay": True, "seconds": time.perf_counter() - t0}
    del twin
  elif warmup in (True, "reachable"):
    warm = warm_up(engine, requests, params_fn)
  elif warmup in (None, False):
    warm = None
  else:
    raise ValueError(f"warmup must be 'replay', 'reachable', True, False or None, "
                     f"got {warmup!r}")
  traces_before = sum(step_lib.TRACE_COUNT.values())
  timing_before = dict(engine.timing)
  base_tokens = engine.stats["generated_tokens"]
  base_steps, base_pre, base_swaps = (engine.stats["steps"], engine.num_preemptions,
                                      engine.num_swaps)
  base_work = {k: engine.stats[k] for k in ("device_steps", "computed_tokens", "bucket_tokens")}
  ids = [engine.add_request(list(map(int, r.prompt_token_ids)), params_fn(r)) for r in requests]
  latency: Dict = {}
  outputs: Dict = {}
  running_sum = running_max = 0
  used = unshared = 0
  start = time.perf_counter()
  steps = 0
  while engine.has_unfinished():
    finished = engine.step()
    now = time.perf_counter() - start
    for out in finished:
      latency[out.request_id] = now
      if keep_outputs:
        outputs[out.request_id] = [list(map(int, o)) for o in out.outputs]
    if progress is not None and finished:
      progress.update(len(finished))
    running = sum(len(g.seqs) for g in engine.scheduler.running)
    running_sum += running
    running_max = max(running_max, running)
    steps += 1
    if track_sharing:
      s = metrics.sharing_savings(engine.state.blocks)
      used += s["used_blocks"]
      unshared += s["unshared_blocks"]
  seconds = time.perf_counter() - start
  traces = sum(step_lib.TRACE_COUNT.values()) - traces_before
  timing = {k: engine.timing[k] - timing_before.get(k, 0.0) for k in ("step_s", "device_s")}
  engine.flush()
  if set(latency) != set(ids):
    raise RuntimeError(f"{len(set(ids) - set(latency))} requests never finished")
  lat = np.array([latency[i] for i in ids])
  generated = engine.stats["generated_tokens"] - base_tokens
  result = {
      "requests": len(requests),
      "seconds": seconds,
      "requests_per_s": len(requests) / seconds,
      "tokens_per_s": generated / seconds,
      "generated_tokens": int(generated),
      "mean_latency_s": float(lat.mean()),
      "p90_latency_s": float(np.percentile(lat, 90)),
      "steps": int(engine.stats["steps"] - base_steps),
      "tokens_per_step": generated / max(1, engine.stats["steps"] - base_steps),
      "preemptions": int(engine.num_preemptions - base_pre),
      "swaps": int(engine.num_swaps - base_swaps),
      "mean_running_seqs": running_sum / max(steps, 1),
      "max_running_seqs": int(running_max),
      "sharing_savings": (1.0 - used / unshared if unshared else 0.0) if track_sharing else None,
      # Where the time went: engine.step() in total, and its jitted call until the
      # outputs reached the host (the rest of the step is host work).
      "engine_step_s": timing["step_s"], "device_s": timing["device_s"],
      "host_s": timing["step_s"] - timing["device_s"],
      "step_traces_in_run": int(traces),    # 0: nothing compiled inside the timing
      # The device's work: jitted calls, tokens the schedule computed (recomputed ones
      # included), and tokens the calls' shape buckets computed (padding included).
      **{k: int(engine.stats[k] - v) for k, v in base_work.items()},
      "warm_up": warm,
  }
  if keep_outputs:
    result["outputs"] = [outputs[i] for i in ids]
  return result


def generate_text(prompt: str, block_sizes: Sequence[int], *, max_tokens: int = 48,
                  kv_budget_tokens: int = 512) -> Dict[int, str]:
  """Greedy continuation of `prompt` by the shipped tiny model, once per block size.

  Returns {block_size: text}; PagedAttention is exact, so the texts must agree.
  """
  from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  ids = tokenizer.encode(prompt)
  texts = {}
  for bs in block_sizes:
    engine = make_engine(block_size=bs, kv_budget_tokens=kv_budget_tokens, max_seqs=4)
    out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                stop_token_ids=(tokenizer.EOS_ID,)))
    texts[bs] = tokenizer.decode(out[0].outputs[0])
  return texts


# ---- online serving: Poisson arrivals into a running engine ----------------------------

def _running_progress(engine) -> Optional[List[tuple]]:
  """[(request_id, has generated a token)] of the engine's running requests, or None.

  Stopgap for TTFT: reads the scheduler's running groups (public attributes) because
  `Engine.step()` returns finished requests only; None if the engine no longer has them.
  """
  try:
    return [(g.request_id, any(q.num_generated > 0 for q in g.seqs))
            for g in engine.scheduler.running]
  except AttributeError:
    return None


def serve_online(engine, requests: Sequence, gate, params_fn: Callable = greedy, *,
                 clock=None, progress=None) -> Dict:
  """Feeds `requests` to a running `engine` at their arrival times, through `gate`.

  Loop: offer every request whose arrival time has passed to the gate; add what the gate
  admits to the engine; run one engine step (or wait for the next arrival when idle);
  release finished requests' reservations. Timestamps are taken on `clock` after the step
  that produced them; latency counts from the scheduled arrival, so time the loop was busy
  when a request arrived is queueing, as in a server.

  Args:
    engine: a warmed-up `paged_jax.engine.Engine` with nothing queued.
    requests: workloads.Request list sorted by `arrival_time` (s), unique `request_id`s.
    gate: `baselines.gate.OpenGate()` or `OrcaGate(...)` (what may enter the engine).
    params_fn: request -> SamplingParams.
    clock: `WallClock()` (default) or `StepClock(step_s)`.
    progress: optional tqdm-like object; `update(n)` per finished request.
  Returns:
    {"summary": latency.summarize(...), "arrival", "first_token", "finish" (f64[n], s),
    "output_len" (i32[n]), "steps", "mean_running", "max_running", "preemptions",
    "swaps" (preemptions by swap), "swapped_blocks" (blocks copied out and in),
    "ttft_observed" (bool: first tokens were read from the engine), "step_traces_in_run"
    (engine step traces while serving: 0 after a complete `warm_up`), "engine_step_s" /
    "device_s" (wall s in engine.step / in its jitted call; nan for engines without
    `timing`)}.
  """
  from paged_jax.bench import latency  # pylint: disable=g-import-not-at-top
  clock = clock or WallClock()
  clock.start()   # arrivals count from here, not from when the clock was built
  reqs = {r.request_id: r for r in requests}
  if len(reqs) != len(requests):
    raise ValueError("request ids must be unique")
  arrivals = sorted(requests, key=lambda r: r.arrival_time)
  params = {r.request_id: params_fn(r) for r in requests}
  first: Dict = {}
  finish: Dict = {}
  from paged_jax.engine import step as step_lib  # pylint: disable=g-import-not-at-top
  base_pre = getattr(engine, "num_preemptions", 0)
  base_swaps = getattr(engine, "num_swaps", 0)
  stats = getattr(engine, "stats", {})
  swapped = base_swapped = stats.get("swapped_blocks", 0)
  block_size = engine.cache_config.block_size if hasattr(engine, "cache_config") else 0
  traces = sum(step_lib.TRACE_COUNT.values())
  timing = dict(getattr(engine, "timing", {}))
  nxt = steps = running_sum = running_max = 0
  observed = True
  while len(finish) < len(reqs):
    now = clock.now()
    while nxt < len(arrivals) and arrivals[nxt].arrival_time <= now:
      r = arrivals[nxt]
      gate.offer(r.request_id, r.total_len, params[r.request_id].num_seqs)
      nxt += 1
    for rid in gate.admit():
      engine.add_request(list(map(int, reqs[rid].prompt_token_ids)), params[rid], rid)
    if not engine.has_unfinished():
      if nxt == len(arrivals):
        raise RuntimeError(f"{len(reqs) - len(finish)} requests never finished")
      clock.wait_until(arrivals[nxt].arrival_time)
      continue
    done = engine.step()
    moved = stats.get("swapped_blocks", 0) - swapped   # out and in, whole blocks
    swapped += moved
    clock.stepped(moved * block_size)
    t = clock.now()
    steps += 1
    live = _running_progress(engine)
    if live is None:
      observed = False
    else:
      running_sum += len(live)
      running_max = max(running_max, len(live))
      for rid, started in live:
        if started and rid not in first:
          first[rid] = t
    for out in done:
      first.setdefault(out.request_id, t)   # finished in the step of its first token
      finish[out.request_id] = t
      gate.release(out.request_id)
    if progress is not None and done:
      progress.update(len(done))
  traces = sum(step_lib.TRACE_COUNT.values()) - traces
  spent = {k: v - timing.get(k, 0.0) for k, v in getattr(engine, "timing", {}).items()}
  if hasattr(engine, "flush"):
    engine.flush()
  ids = [r.request_id for r in requests]
  arr = np.array([reqs[i].arrival_time for i in ids])
  t1 = np.array([first[i] if observed else math.nan for i in ids])
  fin = np.array([finish[i] for i in ids])
  out_len = np.array([reqs[i].output_len for i in ids], np.int32)
  return {"summary": latency.summarize(arr, t1, fin, out_len), "arrival": arr,
          "first_token": t1, "finish": fin, "output_len": out_len, "steps": steps,
          "mean_running": running_sum / max(steps, 1), "max_running": running_max,
          "preemptions": int(getattr(engine, "num_preemptions", 0) - base_pre),
          "swaps": int(getattr(engine, "num_swaps", 0) - base_swaps),
          "swapped_blocks": int(swapped - base_swapped),
          "ttft_observed": observed, "step_traces_in_run": int(traces),
          "engine_step_s": spent.get("step_s", math.nan),
          "device_s": spent.get("device_s", math.nan)}
