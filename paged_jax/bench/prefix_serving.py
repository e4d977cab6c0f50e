"""Prefix caching on and off on the same engine and requests: hit rate, prefill, memory, speed.

    prefix, requests = prefix_serving.few_shot_requests(64, shots=1, seed=0)
    row = prefix_serving.compare("1-shot", prefix, requests, block_size=16,
                                 kv_budget_tokens=4096, max_seqs=64, max_len=1024, budget=256)
    row["hit_rate"], row["throughput_ratio"], row["outputs_identical"]

The shipped tiny byte-level model (1024 positions) serves the requests on two engines in
one process, greedy: `Engine` with `enable_prefix_caching` off and on, same KV budget.
After an untimed pass on each (it compiles the step shapes the timed ones meet), timed
passes alternate between the engines; the ratio is the median over rounds.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from paged_jax.bench import engines
from paged_jax.bench import workloads
from paged_jax.bench.clocks import WallClock
from paged_jax.bench.recorder import LoopRecorder


def caching_engine(caching: bool, *, block_size: int, kv_budget_tokens: int, max_seqs: int,
                   max_len: int, budget: int):
  """The tiny model's Engine with prefix caching on or off (`budget`: tokens per step)."""
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  mc, params = engines.tiny_model()
  cc = mc.cache_config(block_size=block_size, num_blocks=kv_budget_tokens // block_size,
                       max_seqs=max_seqs, max_blocks_per_seq=-(-max_len // block_size),
                       enable_prefix_caching=caching)
  return Engine(mc, params, cc, max_num_batched_tokens=budget)


def _prompts_params(requests):
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  return ([[int(t) for t in r.prompt_token_ids] for r in requests],
          [SamplingParams(max_tokens=r.output_len, temperature=0.0) for r in requests])


def serve_counting_blocks(engine, requests, warm_up: bool = True) -> Dict:
  """Serves all requests (arriving at t = 0), greedy; counts the KV blocks held each step.

  The step runs on shape buckets chosen from what is live, each compiled on first use:
  with `warm_up` an untimed pass over the same requests first compiles the shapes the
  timed one meets. With caching the cache is emptied before the timed pass (earlier
  passes' prompts must not count).

  Returns {"seconds", "tokens_per_s", "generated_tokens", "steps", "peak_blocks",
  "mean_blocks" (blocks not free; with caching, evictable cached blocks count as free),
  "preemptions", "outputs" (sample 0 of each request, in order)}.
  """
  prompts, params = _prompts_params(requests)
  if warm_up:
    engine.generate(prompts, params)
  if engine.cache_config.enable_prefix_caching:
    engine.reset_prefix_cache()
  nb = engine.cache_config.num_blocks
  ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
  rec = LoopRecorder(engine, WallClock())
  used, outs = [], {}
  while engine.has_unfinished():
    for o in rec.step():
      outs[o.request_id] = o.outputs[0]
    used.append(nb - engine.num_free)
  t = rec.close()
  return {"seconds": t["seconds"], "tokens_per_s": t["generated_tokens"] / t["seconds"],
          "generated_tokens": t["generated_tokens"], "steps": len(used),
          "peak_blocks": int(max(used)), "mean_blocks": float(np.mean(used)),
          "preemptions": t["preemptions"], "outputs": [outs[i] for i in ids]}


def prefix_copies(engine, prefix: np.ndarray) -> int:
  """Cached blocks holding the shared prefix's first block (1 = stored once)."""
  import jax  # pylint: disable=g-import-not-at-top
  c = jax.device_get(engine.state.prefix.cache)
  bs = engine.cache_config.block_size
  first = np.asarray(prefix[:bs])
  hold = np.asarray(c.cached) & (np.asarray(c.block_depth) == 0) & np.all(
      np.asarray(c.block_tokens) == first[None, :], axis=1)
  return int(hold.sum())


def compare(name: str, prefix: np.ndarray, requests, rounds: int = 3, **engine_kw) -> Dict:
  """Caching off vs on for one request list (`caching_engine`'s keywords); one row:
  {"workload", "prefix_len", "requests", "prompt_tokens", "hit_rate", "hit_tokens",
  "prefill_tokens_off" / "_on", "prefill_reduction", "prefix_prefill_reduction",
  "prefix_copies_cached", "off" / "on" (`serve_counting_blocks`, the round of median
  seconds), "seconds_off" / "seconds_on" (every round), "outputs_identical",
  "round_ratios" (on / off tokens/s of each round), "throughput_ratio" (their median)}.

  After an untimed pass on each engine, `rounds` timed passes each, the two engines in
  turns (who goes first alternates), so load on a shared machine hits both alike.
  RuntimeError if caching changed a token."""
  engines = {"off": caching_engine(False, **engine_kw), "on": caching_engine(True, **engine_kw)}
  prompts, params = _prompts_params(requests)
  for e in engines.values():
    e.generate(prompts, params)
  runs = {"off": [], "on": []}
  for r in range(rounds):
    for k in (("off", "on") if r % 2 == 0 else ("on", "off")):
      runs[k].append(serve_counting_blocks(engines[k], requests, warm_up=False))
  eng = engines["on"]
  s = eng.prefix_stats()                 # the last pass (each pass starts empty)
  prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
  same = all(a["outputs"] == b["outputs"] for a, b in zip(runs["off"], runs["on"]))
  if not same:
    raise RuntimeError(f"{name}: outputs differ with prefix caching on and off")
  ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(runs["off"], runs["on"])]
  med = {k: sorted(v, key=lambda x: x["seconds"])[len(v) // 2] for k, v in runs.items()}
  off, on = ({k: v for k, v in med[n].items() if k != "outputs"} for n in ("off", "on"))
  shared = len(prefix) * len(requests)
  return {
      "workload": name, "prefix_len": int(len(prefix)), "requests": len(requests),
      "prompt_tokens": prompt_tokens, "hit_rate": s["hit_rate"],
      "hit_tokens": s["hit_tokens"], "prefill_tokens_off": prompt_tokens,
      "prefill_tokens_on": s["prefill_tokens"],
      "prefill_reduction": 1.0 - s["prefill_tokens"] / prompt_tokens,
      "prefix_prefill_reduction": 1.0 - max(
          0, s["prefill_tokens"] - (prompt_tokens - shared)) / shared,
      "prefix_copies_cached": prefix_copies(eng, prefix),
      "off": off, "on": on, "outputs_identical": same,
      "seconds_off": [x["seconds"] for x in runs["off"]],
      "seconds_on": [x["seconds"] for x in runs["on"]],
      "round_ratios": ratios, "throughput_ratio": float(np.median(ratios)),
  }


def system_prompt_requests(num_requests: int, prefix_len: int, seed: int
                           ) -> Tuple[np.ndarray, list]:
  """(prefix, requests): one random `prefix_len`-token system prompt before each prompt."""
  return workloads.shared_prefix(num_requests, prefix_len=prefix_len, seed=seed, max_len=1024,
                                 vocab_size=256)


def few_shot_requests(num_requests: int, shots: int, seed: int) -> Tuple[np.ndarray, list]:
  """(prefix, requests): the paper's few-shot translation prefix (1-shot 80, 5-shot 341)."""
  return workloads.shared_prefix(num_requests, num_shots=shots, seed=seed, max_len=1024,
                                 vocab_size=256)
