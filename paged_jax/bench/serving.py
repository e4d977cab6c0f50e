"""The serve loops: a batch served to completion, and arrivals into a running engine.

    requests = workloads.scaled_requests("sharegpt", 32, seed=0)   # lengths / 4, max 256
    engine = engines.make_engine(block_size=16, kv_budget_tokens=2048, max_seqs=64)
    result = serving.serve(engine, requests)                 # all arrive at t = 0, wall clock
    result["tokens_per_s"], result["mean_latency_s"], result["sharing_savings"]
    online = serving.serve_online(engine, timed_requests, gate_lib.OpenGate(),
                                  clock=clocks.StepClock(0.01))
    online["summary"]["normalized_latency_s_per_token"]

Both keep their books through one `recorder.LoopRecorder` (steps, clock, first tokens,
finishes, engine counters). The model runs to each request's `output_len` (no EOS stop),
so the lengths are the stream's.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from paged_jax.bench import latency
from paged_jax.bench import memory
from paged_jax.bench.clocks import Clock, WallClock
from paged_jax.bench.engines import greedy, warm_up
from paged_jax.bench.recorder import EngineLike, LoopRecorder


def _warm(engine, requests, params_fn, warmup) -> Optional[Dict]:
  if warmup == "replay":
    t0, twin = time.perf_counter(), engine.fresh_copy()
    twin.generate([list(map(int, r.prompt_token_ids)) for r in requests],
                  [params_fn(r) for r in requests])
    return {"replay": True, "seconds": time.perf_counter() - t0}
  if warmup in (True, "reachable"):
    return warm_up(engine, requests, params_fn)
  if warmup in (None, False):
    return None
  raise ValueError(f"warmup must be 'replay', 'reachable', True, False or None, got {warmup!r}")


def serve(engine, requests: Sequence, params_fn: Callable = greedy, *,
          track_sharing: bool = False, warmup="replay", keep_outputs: bool = False,
          progress=None) -> Dict:
  """Serves `requests` (all arriving at t = 0) to completion on `engine`; measures it.

  Args:
    engine: a fresh `paged_jax.engine.Engine`.
    requests: workloads.Request list.
    params_fn: request -> SamplingParams.
    track_sharing: read `memory.sharing_savings` of the block state after every
      step (one host read per step) and report its step-summed ratio.
    warmup: how the shapes the run meets are compiled before the timing. "replay"
      (default): the same requests run untimed on `engine.fresh_copy()`; arrivals at
      t = 0 make the schedule deterministic, so exactly the shapes of the timed run
      compile, usually far fewer than the reachable set. "reachable" (or True): every
      shape the run can reach, ahead of time (`engines.warm_up`). None / False: none.
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
  warm = _warm(engine, requests, params_fn, warmup)
  ids = [engine.add_request(list(map(int, r.prompt_token_ids)), params_fn(r)) for r in requests]
  rec = LoopRecorder(engine, WallClock(), progress)
  outputs: Dict = {}
  used = unshared = 0
  while engine.has_unfinished():
    for out in rec.step():
      if keep_outputs:
        outputs[out.request_id] = [list(map(int, o)) for o in out.outputs]
    if track_sharing:
      s = memory.sharing_savings(engine.state.blocks)
      used += s["used_blocks"]
      unshared += s["unshared_blocks"]
  t = rec.close()
  _, finish = rec.timestamps(ids)
  lat, seconds, generated = np.array(finish), t["seconds"], t["generated_tokens"]
  result = {
      "requests": len(requests),
      "seconds": seconds,
      "requests_per_s": len(requests) / seconds,
      "tokens_per_s": generated / seconds,
      "generated_tokens": generated,
      "mean_latency_s": float(lat.mean()),
      "p90_latency_s": float(np.percentile(lat, 90)),
      "steps": t["steps"],
      "tokens_per_step": generated / max(1, t["steps"]),
      "preemptions": t["preemptions"],
      "swaps": t["swaps"],
      "mean_running_seqs": t["mean_running_seqs"],
      "max_running_seqs": t["max_running_seqs"],
      "sharing_savings": (1.0 - used / unshared if unshared else 0.0) if track_sharing else None,
      # Where the time went: engine.step() in total, and its jitted call until the
      # outputs reached the host (the rest of the step is host work).
      "engine_step_s": t["engine_step_s"], "device_s": t["device_s"],
      "host_s": t["engine_step_s"] - t["device_s"],
      "step_traces_in_run": t["step_traces_in_run"],    # 0: nothing compiled in the timing
      # The device's work: jitted calls, tokens the schedule computed (recomputed ones
      # included), and tokens the calls' shape buckets computed (padding included).
      **{k: t[k] for k in ("device_steps", "computed_tokens", "bucket_tokens")},
      "warm_up": warm,
  }
  if keep_outputs:
    result["outputs"] = [outputs[i] for i in ids]
  return result


def _queued(engine, unaccounted: int) -> int:
  """Requests in `engine` that wait to run (queued, preempted or swapped out) after its
  last step, from `engine.metrics()` where it has one; else `unaccounted` (arrived,
  not returned, not running and not at the gate)."""
  metrics = getattr(engine, "metrics", None)
  if metrics is None:
    return max(0, unaccounted)
  m = metrics()
  return int(m["num_waiting"] + m.get("num_swapped", 0))


def serve_online(engine: EngineLike, requests: Sequence, gate, params_fn: Callable = greedy, *,
                 clock: Optional[Clock] = None, progress=None) -> Dict:
  """Feeds `requests` to a running `engine` at their arrival times, through `gate`.

  Loop: offer every request whose arrival time has passed to the gate; add what the gate
  admits to the engine; run one engine step (or wait for the next arrival when idle);
  release finished requests' reservations. Timestamps are taken on `clock` after the step
  that produced them; latency counts from the scheduled arrival, so time the loop was busy
  when a request arrived is queueing, as in a server.

  Args:
    engine: a warmed-up `EngineLike` (a `paged_jax.engine.Engine`) with nothing queued.
    requests: workloads.Request list sorted by `arrival_time` (s), unique `request_id`s.
    gate: `baselines.gate.OpenGate()` or `OrcaGate(...)` (what may enter the engine).
    params_fn: request -> SamplingParams.
    clock: a `clocks.Clock`: `WallClock()` (default), `StepClock(step_s)`, ...
    progress: optional tqdm-like object; `update(n)` per finished request.
  Returns:
    {"summary": latency.summarize(...), "arrival", "first_token", "finish" (f64[n], s),
    "output_len" (i32[n]), "steps", "mean_running", "max_running", "preemptions",
    "swaps" (preemptions by swap), "swapped_blocks" (blocks copied out and in),
    "running_per_step" / "waiting_per_step" (i32[steps]: requests running after each
    step; requests waiting then: queued at the gate, queued, preempted or swapped out in
    the engine (`Engine.metrics()`; an engine without it: arrived, not returned and not
    running)),
    "ttft_observed" (True: first tokens were read from the engine), "step_traces_in_run"
    (engine step traces while serving: 0 after a complete `warm_up`), "engine_step_s" /
    "device_s" (wall s in engine.step / in its jitted call)}.
  """
  reqs = {r.request_id: r for r in requests}
  if len(reqs) != len(requests):
    raise ValueError("request ids must be unique")
  arrivals = sorted(requests, key=lambda r: r.arrival_time)
  params = {r.request_id: params_fn(r) for r in requests}
  rec = LoopRecorder(engine, clock or WallClock(), progress)   # arrivals count from here
  nxt, running, waiting = 0, [], []
  while len(rec.finish) < len(reqs):
    now = rec.clock.now()
    while nxt < len(arrivals) and arrivals[nxt].arrival_time <= now:
      r = arrivals[nxt]
      gate.offer(r.request_id, r.total_len, params[r.request_id].num_seqs)
      nxt += 1
    for rid in gate.admit():
      engine.add_request(list(map(int, reqs[rid].prompt_token_ids)), params[rid], rid)
    if not engine.has_unfinished():
      if nxt == len(arrivals):
        raise RuntimeError(f"{len(reqs) - len(rec.finish)} requests never finished")
      rec.clock.wait_until(arrivals[nxt].arrival_time)
      continue
    for out in rec.step():
      gate.release(out.request_id)
    running.append(engine.last_step.num_running_groups)
    gated = gate.num_waiting
    waiting.append(gated + _queued(engine, nxt - gated - len(rec.finish) - running[-1]))
  t = rec.close()
  ids = [r.request_id for r in requests]
  first, finish = rec.timestamps(ids)
  arr = np.array([reqs[i].arrival_time for i in ids])
  t1, fin = np.array(first), np.array(finish)
  out_len = np.array([reqs[i].output_len for i in ids], np.int32)
  return {"summary": latency.summarize(arr, t1, fin, out_len), "arrival": arr,
          "first_token": t1, "finish": fin, "output_len": out_len, "steps": t["loop_steps"],
          "mean_running": t["mean_running"], "max_running": t["max_running"],
          "preemptions": t["preemptions"], "swaps": t["swaps"],
          "swapped_blocks": t["swapped_blocks"], "ttft_observed": True,
          "step_traces_in_run": t["step_traces_in_run"],
          "engine_step_s": t["engine_step_s"], "device_s": t["device_s"],
          "running_per_step": np.array(running, np.int32),
          "waiting_per_step": np.array(waiting, np.int32)}
