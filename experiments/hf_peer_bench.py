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
model of ~25M parameters instead (`random_checkpoint`; the runners, `agreement` and the
random model live in `experiments.hf_peer`), where the matmuls, not
per-step overhead, dominate. Every run also measures the compute floor
(`experiments/compute_floor.py`): the workload's FLOPs at this CPU's best measured
GEMM rate, i.e. the most any engine could beat transformers by on this machine.

Writes DIR/hf_peer.json: tokens/s of each, the ratio, per-round seconds,
token-for-token agreement of the greedy outputs (fraction of prompts whose
outputs match exactly, mean matching-prefix length), versions and flags.
torch and transformers are benchmark-only extras (requirements-bench.txt).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np

from experiments import common
from experiments import compute_floor
from experiments import configs
from experiments import provenance
from experiments.hf_peer import (PagedJaxRunner, TransformersRunner, agreement,
                                 random_checkpoint)

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


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.hf_peer_bench."""
  checkpoint: Optional[str] = configs.flag(None, "HF Llama checkpoint dir (default: shipped "
                                           "tiny model)")
  num_prompts: int = configs.flag(32, "prompts (all submitted at once)", lower=1)
  min_prompt_len: int = configs.flag(24, "shortest prompt, bytes", lower=1)
  max_prompt_len: int = configs.flag(64, "longest prompt, bytes", lower=1)
  max_new_tokens: int = configs.flag(64, "tokens generated per prompt (no stop token)", lower=1)
  block_size: int = configs.flag(16, "tokens per KV block (transformers: page_size)", lower=4)
  num_blocks: int = configs.flag(256, "KV blocks, the same on both sides", lower=1)
  max_batch_tokens: int = configs.flag(256, "per-step token budget, the same on both sides",
                                       lower=1)
  repeats: int = configs.flag(5, "timed rounds (alternating the two engines)", lower=1)
  torch_threads: Optional[int] = configs.flag(None, "torch threads (default: os.cpu_count())",
                                              lower=1)
  decode_steps_per_sync: int = configs.flag(1, "paged_jax multi-step decoding", lower=1)
  seed: int = configs.flag(0, "prompt selection seed (and the random model's)")
  random_hidden_size: int = configs.flag(
      0, "with random_num_layers: run a seeded random model of this width instead of "
      "--checkpoint (512 x 8 layers: ~25M params; a multiple of 128)", lower=0)
  random_num_layers: int = configs.flag(0, "layers of the random model", lower=0, upper=1024)
  out: str = configs.flag("experiments/results/hf_peer", "output directory")

  def check(self) -> None:
    if bool(self.random_hidden_size) != bool(self.random_num_layers):
      raise ValueError("--random_hidden_size and --random_num_layers go together, got "
                       f"{self.random_hidden_size} and {self.random_num_layers}")
    if self.random_hidden_size and self.checkpoint:
      raise ValueError("give --checkpoint or --random_hidden_size/--random_num_layers, not both")
    if self.random_hidden_size % 128:
      raise ValueError(f"--random_hidden_size must be a multiple of 128 (head_dim 64, GQA 2), "
                       f"got {self.random_hidden_size}")
    if self.min_prompt_len > self.max_prompt_len:
      raise ValueError(f"need --min_prompt_len <= --max_prompt_len, got {self.min_prompt_len}, "
                       f"{self.max_prompt_len}")


def run(f: Optional[Config] = None) -> Dict:
  """Runs both engines side by side for settings `f`; returns the result dict (see module
  doc). With `random_hidden_size` and `random_num_layers` set, both run a seeded random
  model of that size (`hf_peer.random_checkpoint`, in a temporary directory)."""
  from paged_jax.models import DEFAULT_CHECKPOINT  # pylint: disable=g-import-not-at-top
  f = f or Config()
  if f.random_hidden_size:
    with tempfile.TemporaryDirectory(prefix="hf_peer_random_") as tmp:
      path = random_checkpoint(tmp, f.random_hidden_size, f.random_num_layers, f.seed)
      result = _run(f, path)
    result["workload"]["checkpoint"] = (f"random (seed {f.seed}): hidden "
                                        f"{f.random_hidden_size}, {f.random_num_layers} layers")
    return result
  return _run(f, f.checkpoint or DEFAULT_CHECKPOINT)


def _run(f: Config, checkpoint: str) -> Dict:
  num_prompts, max_new_tokens, block_size = f.num_prompts, f.max_new_tokens, f.block_size
  num_blocks, max_batch_tokens, seed = f.num_blocks, f.max_batch_tokens, f.seed
  decode_steps_per_sync = f.decode_steps_per_sync
  threads = f.torch_threads or os.cpu_count()
  prompts = story_prompts(num_prompts, f.min_prompt_len, f.max_prompt_len, seed)
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
    for _ in range(f.repeats):   # interleaved rounds: load hits every method alike
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


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  names = [n for n in f.flags() if n != "out"]
  result = run(f)
  result.update(provenance.run_metadata(f, names, packages=("torch", "transformers")))
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
  common.run_app(main, Config)
