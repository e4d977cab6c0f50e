"""Serving harness: scaled streams, the tiny-model engine, batch and online (arrival-driven) serving.

    requests = serving.scaled_requests("sharegpt", 32, seed=0)     # lengths / 4, max 256
    engine = serving.make_engine(block_size=16, kv_budget_tokens=2048, max_seqs=64)
    result = serving.serve(engine, requests, lambda r: SamplingParams(max_tokens=r.output_len))
    result["tokens_per_s"], result["mean_latency_s"], result["sharing_savings"]

Scaling (what is synthetic): the streams are `paged_jax.workloads`' seeded
ShareGPT-like / Alpaca-like lengths (Table 1 means) with every mean divided by
`STREAM_SCALE[dataset]` (ShareGPT 4, Alpaca 1) and clipped to `max_len` tokens,
so the shipped tiny byte-level model (4 layers, 1024 positions) serves a stream on
2 CPU cores in seconds. Token ids are seeded uniform bytes in [0, 256). The model
runs to `output_len` (no EOS stop), so the lengths are the stream's.

Everything here is flag-free (importable from tests and the notebook).
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from paged_jax import workloads

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


def warm_up(engine) -> None:
  """Compiles the engine's step for both token buckets (a long prefill, then decodes)."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  c = engine.cache_config
  prompt_len = min(engine.max_num_batched_tokens, engine.max_model_len - 2,
                   c.num_slots - 2 * c.block_size)
  engine.generate([[1] * max(1, prompt_len)], SamplingParams(max_tokens=2, temperature=0.0))


def serve(engine, requests: Sequence, params_fn: Callable = greedy, *,
          track_sharing: bool = False, warmup: bool = True, keep_outputs: bool = False,
          progress=None) -> Dict:
  """Serves `requests` (all arriving at t = 0) to completion on `engine`; measures it.

  Args:
    engine: a fresh `paged_jax.engine.Engine`.
    requests: workloads.Request list.
    params_fn: request -> SamplingParams.
    track_sharing: read `metrics.sharing_savings` of the block state after every
      step (one host read per step) and report its step-summed ratio.
    warmup: compile first (`warm_up`) so the timing excludes tracing.
    keep_outputs: also return "outputs": per request (stream order), the generated ids
      of each sample / hypothesis.
    progress: optional object with `update(n)` (a tqdm bar), called per finished request.
  Returns:
    {"requests", "seconds", "requests_per_s", "tokens_per_s" (generated tokens, every
    sample or beam counted), "generated_tokens", "mean_latency_s", "p90_latency_s"
    (finish time of each request), "steps", "preemptions", "swaps",
    "tokens_per_step" (machine-independent), "mean_running_seqs", "max_running_seqs", "sharing_savings" (1 - sum of used blocks
    / sum of blocks without sharing, over steps; None unless tracked)}.
  """
  from paged_jax import metrics  # pylint: disable=g-import-not-at-top
  if warmup:
    warm_up(engine)
  base_tokens = engine.stats["generated_tokens"]
  base_steps, base_pre, base_swaps = (engine.stats["steps"], engine.num_preemptions,
                                      engine.num_swaps)
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
