r"""A real peer, side by side: paged_jax's Engine vs Hugging Face transformers'
continuous batching with its paged KV cache (`model.generate_batch`), on CPU.

    python -m experiments.hf_peer_bench --num_prompts=32 --max_new_tokens=64 \
        --block_size=16 --num_blocks=256 --max_batch_tokens=256 --repeats=5 \
        --out=experiments/results/hf_peer

Both sides run the same HF-format checkpoint (default: the shipped
`paged_jax/assets/tiny_byte_llama`, fp32), the same prompts (byte-tokenized
openings of the stories in `experiments/data/stories.txt`), greedy decoding,
the same max_new_tokens (no stop token on either side, so every request
generates exactly max_new_tokens), the same number of KV blocks of the same
block size and the same per-step token budget:

  paged_jax     Engine(...).generate(prompts, SamplingParams(temperature=0))
  transformers  LlamaForCausalLM.generate_batch(prompts, GenerationConfig(do_sample=False),
                    continuous_batching_config=ContinuousBatchingConfig(
                        page_size=block_size, num_blocks=..., max_batch_tokens=...))

Two timing modes, each timing one whole batch of all prompts:
  end_to_end  a fresh Engine / one `generate_batch` call (which builds, starts,
              stops and tears down its manager each call, as that API does);
  steady      one Engine / one running transformers manager kept across calls
              (`continuous_batching_context_manager` + add_requests/get_result):
              generation only. The headline ratio is this one (the fairer one:
              transformers' per-call teardown runs gc.collect() over the whole
              process heap, JAX's included).
Everything is warmed up (JAX compiles its step buckets), then --repeats
rounds alternate all four (mode, engine) pairs; medians. torch runs on `torch.set_num_threads(--torch_threads)` (default: the
CPU count XLA's CPU client uses, os.cpu_count()).

`--random_hidden_size=512 --random_num_layers=8` runs both on a seeded random
model of ~25M parameters instead (`random_checkpoint`), where the matmuls, not
per-step overhead, dominate. Every run also measures the compute floor
(`experiments/compute_floor.py`): the workload's FLOPs at this CPU's best measured
GEMM rate, i.e. the most any engine could beat transformers by on this machine.

Writes DIR/hf_peer.json: tokens/s of each, the ratio, per-round seconds,
token-for-token agreement of the greedy outputs (fraction of prompts whose
outputs match exactly, mean matching-prefix length), versions and flags.
torch and transformers are benchmark-only extras (requirements-bench.txt).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from typing import Dict, List, Sequence

import numpy as np

from experiments import common, compute_floor
from paged_jax.config import cdiv, check_int

STORIES = os.path.join(os.path.dirname(__file__), "data", "stories.txt")


def story_prompts(num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> List[List[int]]:
  """Byte-token prompts: the first L bytes (L uniform in [min_len, max_len]) of
  `num_prompts` stories from stories.txt, BOS first."""
  from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top
  if not 1 <= min_len <= max_len:
    raise ValueError(f"need 1 <= min_prompt_len <= max_prompt_len, got {min_len}, {max_len}")
  with open(STORIES, encoding="utf-8") as f:
    stories = [s.strip() for s in f.read().split("\n\n") if len(s.strip()) >= max_len]
  if num_prompts < 1 or num_prompts > len(stories):
    raise ValueError(f"num_prompts must be in [1, {len(stories)}], got {num_prompts}")
  rng = np.random.default_rng(seed)
  picks = rng.choice(len(stories), num_prompts, replace=False)
  lens = rng.integers(min_len, max_len + 1, num_prompts)
  return [tokenizer.encode(stories[i].encode("utf-8")[:n].decode("utf-8", "ignore"))
          for i, n in zip(picks, lens)]


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
        max_blocks_per_seq=cdiv(max_model_len, block_size), dtype="float32")
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
                         f"{len(prompts)} requests; errors: {[r.error for r in results if r.error]}")
    return [list(r.generated_tokens) for r in results]

  def steady(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
    """Steady state: one running manager (`continuous_batching_context_manager`,
    opened on the first call) takes the batch via add_requests / get_result; only
    generation is timed, no manager setup or teardown."""
    import torch  # pylint: disable=g-import-not-at-top
    if self._manager is None:
      self._stack.enter_context(torch.inference_mode())
      self._manager = self._stack.enter_context(self.steady_model.continuous_batching_context_manager(
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


def run(checkpoint: str = None, *, num_prompts: int = 32, min_prompt_len: int = 24,
        max_prompt_len: int = 64, max_new_tokens: int = 64, block_size: int = 16,
        num_blocks: int = 256, max_batch_tokens: int = 256, repeats: int = 5,
        torch_threads: int = None, decode_steps_per_sync: int = 1, seed: int = 0,
        random_hidden_size: int = 0, random_num_layers: int = 0) -> Dict:
  """Runs both engines side by side; returns the result dict (see module doc).

  With `random_hidden_size` and `random_num_layers` both set, both engines run a
  seeded random model of that size (`random_checkpoint`, in a temporary directory)
  instead of `checkpoint`."""
  from paged_jax.models import DEFAULT_CHECKPOINT  # pylint: disable=g-import-not-at-top
  if bool(random_hidden_size) != bool(random_num_layers):
    raise ValueError("random_hidden_size and random_num_layers go together, got "
                     f"{random_hidden_size} and {random_num_layers}")
  if random_hidden_size and checkpoint:
    raise ValueError("give checkpoint or random_hidden_size/random_num_layers, not both")
  if random_hidden_size:
    with tempfile.TemporaryDirectory(prefix="hf_peer_random_") as tmp:
      result = run(random_checkpoint(tmp, random_hidden_size, random_num_layers, seed),
                   num_prompts=num_prompts, min_prompt_len=min_prompt_len,
                   max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
                   block_size=block_size, num_blocks=num_blocks,
                   max_batch_tokens=max_batch_tokens, repeats=repeats,
                   torch_threads=torch_threads, decode_steps_per_sync=decode_steps_per_sync,
                   seed=seed)
    result["workload"]["checkpoint"] = (f"random (seed {seed}): hidden {random_hidden_size}, "
                                        f"{random_num_layers} layers")
    return result
  checkpoint = checkpoint or DEFAULT_CHECKPOINT
  for name, v, lo in (("max_new_tokens", max_new_tokens, 1), ("block_size", block_size, 4),
                      ("num_blocks", num_blocks, 1), ("max_batch_tokens", max_batch_tokens, 1),
                      ("repeats", repeats, 1)):
    check_int(name, v, lo)
  threads = torch_threads or os.cpu_count()
  prompts = story_prompts(num_prompts, min_prompt_len, max_prompt_len, seed)
  max_model_len = max(len(p) for p in prompts) + max_new_tokens
  kw = dict(block_size=block_size, num_blocks=num_blocks, max_seqs=num_prompts,
            max_batch_tokens=max_batch_tokens, max_new_tokens=max_new_tokens)
  runners = {"paged_jax": PagedJaxRunner(checkpoint, max_model_len=max_model_len,
                                         decode_steps_per_sync=decode_steps_per_sync, **kw),
             "transformers": TransformersRunner(checkpoint, threads=threads, **kw)}
  calls = {(mode, name): getattr(r, method) for mode, method in MODES.items()
           for name, r in runners.items()}
  outputs = {}
  try:
    for (mode, name), fn in calls.items():   # warm-up: JAX compiles; torch allocates
      fn(prompts)
      outputs[(mode, name)] = fn(prompts)
      lens = {len(o) for o in outputs[(mode, name)]}
      if lens != {max_new_tokens}:
        raise RuntimeError(f"{name} ({mode}) produced output lengths {sorted(lens)}, "
                           f"wanted {max_new_tokens}")
    seconds = {key: [] for key in calls}
    for _ in range(repeats):   # interleaved rounds: load hits every method alike
      for key, fn in calls.items():
        t0 = time.perf_counter()
        fn(prompts)
        seconds[key].append(time.perf_counter() - t0)
  finally:
    for r in runners.values():
      r.close()
  out_tokens = num_prompts * max_new_tokens
  result = {"modes": {}}
  for mode in MODES:
    engines = {}
    for name in runners:
      xs = seconds[(mode, name)]
      med = statistics.median(xs)
      engines[name] = {"median_s": med, "min_s": min(xs), "seconds": xs,
                       "output_tokens_per_s": out_tokens / med,
                       "requests_per_s": num_prompts / med}
    result["modes"][mode] = {
        "engines": engines,
        "ratio_tokens_per_s": (engines["paged_jax"]["output_tokens_per_s"]
                               / engines["transformers"]["output_tokens_per_s"])}
  result["ratio_tokens_per_s"] = result["modes"]["steady"]["ratio_tokens_per_s"]
  # What any engine could do here: the workload's FLOPs at this CPU's GEMM rate.
  model_config = runners["paged_jax"].model_config
  prompt_lens = [len(p) for p in prompts]
  mean_prompt = float(np.mean(prompt_lens))
  floor = compute_floor.compute_floor(model_config, prompt_lens, max_new_tokens,
                                      torch_threads=threads)
  for m in result["modes"].values():
    for e in m["engines"].values():
      e["achieved_gflops"] = floor["workload_gflop"] / e["median_s"]
  floor["attention"] = compute_floor.attention_cost(
      model_config, rows=num_prompts, block_size=block_size,
      kv_len=int(mean_prompt + max_new_tokens / 2), num_tokens=max_batch_tokens)
  floor["kernels"] = compute_floor.kernel_floor(floor["attention"], model_config.num_layers,
                                                prompt_lens, max_new_tokens)
  peer_s = result["modes"]["steady"]["engines"]["transformers"]["median_s"]
  floor["max_ratio_over_transformers"] = peer_s / floor["floor_s"]
  floor["max_ratio_at_kernels"] = peer_s / floor["kernels"]["kernel_floor_s"]
  result["compute_floor"] = floor
  result["paged_jax_preemptions"] = runners["paged_jax"].last_engine.num_preemptions
  result["agreement"] = agreement(outputs[("steady", "paged_jax")],
                                  outputs[("steady", "transformers")])
  result["self_consistent"] = {name: outputs[("steady", name)] == outputs[("end_to_end", name)]
                               for name in runners}
  result["workload"] = {"num_prompts": num_prompts, "prompt_lens": prompt_lens,
                        "mean_prompt_len": mean_prompt,
                        "max_new_tokens": max_new_tokens, "output_tokens": out_tokens,
                        "kv_blocks": num_blocks, "block_size": block_size,
                        "kv_slots": num_blocks * block_size, "max_batch_tokens": max_batch_tokens,
                        "max_seqs": num_prompts, "decode_steps_per_sync": decode_steps_per_sync,
                        "torch_threads": threads, "checkpoint": os.path.relpath(checkpoint),
                        "num_params": runners["paged_jax"].num_params,
                        "seed": seed}
  result["sample_outputs"] = {name: outputs[("steady", name)][:2] for name in runners}
  return result


MODES = {"end_to_end": "__call__", "steady": "steady"}
HEADERS = ["mode", "engine", "median s / batch", "output tok/s", "requests/s"]


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("checkpoint", None, "HF Llama checkpoint dir (default: shipped tiny model)")
  flags.DEFINE_integer("num_prompts", 32, "prompts (all submitted at once)")
  flags.DEFINE_integer("min_prompt_len", 24, "shortest prompt, bytes")
  flags.DEFINE_integer("max_prompt_len", 64, "longest prompt, bytes")
  flags.DEFINE_integer("max_new_tokens", 64, "tokens generated per prompt (no stop token)")
  flags.DEFINE_integer("block_size", 16, "tokens per KV block (transformers: page_size)")
  flags.DEFINE_integer("num_blocks", 256, "KV blocks, the same on both sides")
  flags.DEFINE_integer("max_batch_tokens", 256, "per-step token budget, the same on both sides")
  flags.DEFINE_integer("repeats", 5, "timed rounds (alternating the two engines)")
  flags.DEFINE_integer("torch_threads", None, "torch threads (default: os.cpu_count())")
  flags.DEFINE_integer("decode_steps_per_sync", 1, "paged_jax multi-step decoding")
  flags.DEFINE_integer("seed", 0, "prompt selection seed (and the random model's)")
  flags.DEFINE_integer("random_hidden_size", 0, "with random_num_layers: run a seeded random "
                       "model of this width instead of --checkpoint (512 x 8 layers: ~25M params)")
  flags.DEFINE_integer("random_num_layers", 0, "layers of the random model")
  flags.DEFINE_string("out", "experiments/results/hf_peer", "output directory")


def main(f, out):
  """Runs with the parsed flags `f` into directory `out` (the `common.run_app` main)."""
  names = ("checkpoint", "num_prompts", "min_prompt_len", "max_prompt_len", "max_new_tokens",
           "block_size", "num_blocks", "max_batch_tokens", "repeats", "torch_threads",
           "decode_steps_per_sync", "seed", "random_hidden_size", "random_num_layers")
  result = run(**{n: f[n].value for n in names})
  result.update(common.run_metadata(f, names, packages=("torch", "transformers")))
  result["date_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
  path = common.write_json(out / "hf_peer.json", result)
  rows = [[mode, name, e["median_s"], e["output_tokens_per_s"], e["requests_per_s"]]
          for mode, m in result["modes"].items() for name, e in m["engines"].items()]
  print(common.table(rows, HEADERS))
  a = result["agreement"]
  for mode, m in result["modes"].items():
    print(f"{mode}: paged_jax / transformers tokens/s = {m['ratio_tokens_per_s']:.2f}x")
  fl = result["compute_floor"]
  print(f"compute floor: {fl['workload_gflop']:.0f} GFLOP at the best measured GEMM rate "
        f"{fl['best_gemm_gflops']:.0f} GFLOP/s = {fl['floor_s']:.2f} s; no engine can beat "
        f"transformers (steady) by more than {fl['max_ratio_over_transformers']:.2f}x here")
  at, kf = fl["attention"], fl["kernels"]
  print(f"at its own kernels' measured per-layer cost, perfectly batched, paged_jax needs "
        f"{kf['kernel_floor_s']:.2f} s (prefill {kf['prefill_s']:.2f}, decode "
        f"{kf['decode_s']:.2f}): at most {fl['max_ratio_at_kernels']:.2f}x transformers")
  print(f"per layer, {at['backend']} attention vs the projection GEMMs: decode step "
        f"({at['rows']} rows x {at['kv_len']} tokens) {at['decode_ms_per_layer']:.2f} vs "
        f"{at['decode_gemm_ms_per_layer']:.2f} ms; mixed step ({at['num_tokens']} tokens) "
        f"{at['mixed_ms_per_layer']:.2f} vs {at['mixed_gemm_ms_per_layer']:.2f} ms")
  print(f"greedy outputs "
        f"identical for {a['exact_match_fraction']:.0%} of {a['num_prompts']} prompts (mean common "
        f"prefix {a['mean_common_prefix']:.1f} of {result['workload']['max_new_tokens']} tokens)")
  print(f"wrote {path}")


if __name__ == "__main__":
  common.run_app(main, _define_flags)
