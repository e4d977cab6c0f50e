"""Prefix caching on and off on the same engine and requests: hit rate, prefill, memory, speed.

    prefix, requests = prefix_serving.few_shot_requests(64, shots=1, seed=0)
    row = prefix_serving.compare("1-shot", prefix, requests, block_size=16,
                                 kv_budget_tokens=4096, max_seqs=64, max_len=1024, budget=256)
    row["hit_rate"], row["throughput_ratio"], row["outputs_identical"]

The shipped tiny byte-level model (1024 positions) serves the requests twice, one after the
other in one process, greedy: `Engine` with `enable_prefix_caching` off, then on, same KV
budget. Each pass is timed after an untimed pass over the same requests has compiled the
step shapes it meets.
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


def serve_counting_blocks(engine, requests) -> Dict:
  """Serves all requests (arriving at t = 0), greedy; counts the KV blocks held each step.

  Returns {"seconds", "tokens_per_s", "generated_tokens", "steps", "peak_blocks",
  "mean_blocks" (blocks not free; with caching, evictable cached blocks count as free),
  "preemptions", "outputs" (sample 0 of each request, in order)}.
  """
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  prompts = [[int(t) for t in r.prompt_token_ids] for r in requests]
  params = [SamplingParams(max_tokens=r.output_len, temperature=0.0) for r in requests]
  # The step runs on shape buckets chosen from what is live, each compiled on first
  # use: an untimed pass over the same requests compiles the shapes the timed one meets.
  engine.generate(prompts, params)
  if engine.cache_config.enable_prefix_caching:
    engine.reset_prefix_cache()          # the warm-up prompts must not count
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


def compare(name: str, prefix: np.ndarray, requests, **engine_kw) -> Dict:
  """Caching off vs on for one request list (`caching_engine`'s keywords); one row:
  {"workload", "prefix_len", "requests", "prompt_tokens", "hit_rate", "hit_tokens",
  "prefill_tokens_off" / "_on", "prefill_reduction", "prefix_prefill_reduction",
  "prefix_copies_cached", "off" / "on" (`serve_counting_blocks`), "outputs_identical",
  "throughput_ratio"}. RuntimeError if caching changed a token."""
  off = serve_counting_blocks(caching_engine(False, **engine_kw), requests)
  eng = caching_engine(True, **engine_kw)
  on = serve_counting_blocks(eng, requests)
  s = eng.prefix_stats()
  prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
  same = off.pop("outputs") == on.pop("outputs")
  if not same:
    raise RuntimeError(f"{name}: outputs differ with prefix caching on and off")
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
      "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
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
