"""A real peer, side by side: paged_jax's Engine and Hugging Face transformers' continuous
batching (`model.generate_batch`, its paged KV cache) on one HF-format checkpoint.

    pj = hf_peer.PagedJaxRunner(ckpt, block_size=16, num_blocks=256, max_seqs=32,
                                max_batch_tokens=256, max_new_tokens=64, max_model_len=128)
    hf = hf_peer.TransformersRunner(ckpt, block_size=16, num_blocks=256, max_seqs=32,
                                    max_batch_tokens=256, max_new_tokens=64, threads=2)
    hf_peer.agreement(pj(prompts), hf(prompts))       # greedy outputs, token for token

Each runner's `__call__(prompts)` runs one whole batch end to end (a fresh Engine; one
`generate_batch` call, which builds and tears down its manager); `steady(prompts)` keeps one
Engine / one running transformers manager across calls. torch and transformers are
benchmark-only extras (requirements-bench.txt), imported only by `TransformersRunner`.
The helper of experiments/hf_peer_bench.py (no command line of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Dict, List, Sequence

import numpy as np

from paged_jax.config import cdiv, check_int


class PagedJaxRunner:
  """paged_jax Engine on the checkpoint; `__call__(prompts)` -> generated ids per prompt."""

  def __init__(self, checkpoint: str, *, block_size: int, num_blocks: int, max_seqs: int,
               max_batch_tokens: int, max_new_tokens: int, max_model_len: int,
               decode_steps_per_sync: int = 1):
    from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
    from paged_jax.models import load_hf_checkpoint  # pylint: disable=g-import-not-at-top
    from paged_jax.models.llama import num_params  # pylint: disable=g-import-not-at-top
    self.model_config, self.params = load_hf_checkpoint(checkpoint, dtype="float32")
    self.num_params = num_params(self.params)
    self.cache_config = self.model_config.cache_config(
        block_size=block_size, num_blocks=num_blocks, max_seqs=max_seqs,
        max_blocks_per_seq=cdiv(max_model_len, block_size), dtype="float32", hybrid_kv=False,
        enable_prefix_caching=False)   # as measured: the peer caches no prefix either
    self.sampling = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    self.max_batch_tokens = max_batch_tokens
    self.decode_steps_per_sync = decode_steps_per_sync
    self.last_engine = None
    self.steady_engine = None

  def _engine(self):
    from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
    return Engine(self.model_config, self.params, self.cache_config,
                  max_num_batched_tokens=self.max_batch_tokens,
                  decode_steps_per_sync=self.decode_steps_per_sync)

  def __call__(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
    """End to end: a fresh Engine (KV pool allocation included), then generate."""
    self.last_engine = self._engine()
    return [list(o.outputs[0]) for o in self.last_engine.generate(prompts, self.sampling)]

  def steady(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
    """Steady state: one Engine kept across calls (its pool drains between batches)."""
    if self.steady_engine is None:
      self.steady_engine = self._engine()
    return [list(o.outputs[0]) for o in self.steady_engine.generate(prompts, self.sampling)]

  def close(self):
    self.steady_engine = None


class TransformersRunner:
  """transformers' `generate_batch` (continuous batching, paged cache) on the same
  checkpoint; `__call__(prompts)` -> generated ids per prompt, in prompt order."""

  def __init__(self, checkpoint: str, *, block_size: int, num_blocks: int, max_seqs: int,
               max_batch_tokens: int, max_new_tokens: int, threads: int):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    from transformers.generation.configuration_utils import ContinuousBatchingConfig  # pylint: disable=g-import-not-at-top
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    # Two copies: generate_batch's manager and the long-lived one must not share a model
    # (generate_batch joins its thread with a hard-coded 5 s timeout; a late thread left
    # on a shared model breaks the next manager).
    self.model, self.steady_model = (
        transformers.LlamaForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
        for _ in range(2))
    # No eos_token_id: every request runs max_new_tokens, like the paged_jax side.
    self.gen_config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    self.cb_config = ContinuousBatchingConfig(
        page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_seqs)
    self.max_new_tokens = max_new_tokens
    self._stack = contextlib.ExitStack()
    self._manager = None

  def __call__(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
    """End to end: one `generate_batch` call (it builds, warms up and tears down its
    manager: thread start/join and two gc.collect() passes every call)."""
    import torch  # pylint: disable=g-import-not-at-top
    with torch.inference_mode():
      out = self.model.generate_batch([list(p) for p in prompts], generation_config=self.gen_config,
                                      continuous_batching_config=self.cb_config)
    results = list(out.values())   # generate_batch returns them in input order
    if len(results) != len(prompts) or any(r.error for r in results):
      raise RuntimeError(f"transformers generate_batch returned {len(results)} of "
                         f"{len(prompts)} requests; errors: "
                         f"{[r.error for r in results if r.error]}")
    return [list(r.generated_tokens) for r in results]

  def steady(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
    """Steady state: one running manager (`continuous_batching_context_manager`,
    opened on the first call) takes the batch via add_requests / get_result; only
    generation is timed, no manager setup or teardown."""
    import torch  # pylint: disable=g-import-not-at-top
    if self._manager is None:
      self._stack.enter_context(torch.inference_mode())
      self._manager = self._stack.enter_context(
          self.steady_model.continuous_batching_context_manager(
              generation_config=self.gen_config, continuous_batching_config=self.cb_config,
              block=True, timeout=5))
    ids = self._manager.add_requests(inputs=[list(p) for p in prompts],
                                     max_new_tokens=self.max_new_tokens)
    done = {}
    while len(done) < len(ids):
      r = self._manager.get_result(timeout=1)
      if r is None:
        if not self._manager.is_running():
          raise RuntimeError(f"transformers manager stopped with {len(done)} of {len(ids)} done")
        continue
      if r.is_finished():
        if r.error:
          raise RuntimeError(f"transformers request {r.request_id} failed: {r.error}")
        done[r.request_id] = list(r.generated_tokens)
    return [done[i] for i in ids]

  def close(self):
    self._stack.close()
    self._manager = None


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> Dict[str, float]:
  """Token-for-token agreement of two output lists: exact-match fraction, mean and
  min length of the common prefix."""
  prefixes = []
  for x, y in zip(a, b):
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
      n += 1
    prefixes.append(n)
  exact = [list(x) == list(y) for x, y in zip(a, b)]
  return {"exact_match_fraction": float(np.mean(exact)),
          "mean_common_prefix": float(np.mean(prefixes)),
          "min_common_prefix": int(min(prefixes)), "num_prompts": len(prefixes)}


def random_checkpoint(directory: str, hidden_size: int, num_layers: int, seed: int = 0) -> str:
  """Writes a seeded randomly initialised Llama (the shipped model's vocabulary and
  byte tokens; head_dim 64, 2 query heads per K/V head, SwiGLU width 3 x hidden) to
  `directory` in HF format and returns it. hidden 512 x 8 layers is ~25M params, the
  size where compute, not per-step overhead, starts to dominate on CPU."""
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax.models import DEFAULT_CHECKPOINT  # pylint: disable=g-import-not-at-top
  from paged_jax.models.hf_checkpoint import read_json, read_model_config, save_hf_checkpoint  # pylint: disable=g-import-not-at-top
  from paged_jax.models.llama import init_params  # pylint: disable=g-import-not-at-top
  check_int("random_hidden_size", hidden_size, 64)
  check_int("random_num_layers", num_layers, 1, 1024)
  if hidden_size % 128:
    raise ValueError(f"random_hidden_size must be a multiple of 128 (head_dim 64, GQA 2), "
                     f"got {hidden_size}")
  shipped = read_model_config(DEFAULT_CHECKPOINT)
  heads = hidden_size // 64
  config = dataclasses.replace(shipped, hidden_size=hidden_size, intermediate_size=3 * hidden_size,
                               num_layers=num_layers, num_heads=heads, num_kv_heads=heads // 2,
                               head_dim=64)
  params = init_params(config, jax.random.PRNGKey(seed))
  tokens = {k: v for k, v in read_json(os.path.join(DEFAULT_CHECKPOINT, "config.json")).items()
            if k in ("bos_token_id", "eos_token_id")}
  save_hf_checkpoint(directory, config, params, dtype="float32", extra_config=tokens)
  return directory
