r"""Host overhead per generated token: in-jit allocation with multi-step decoding
(k = 1, 4, 16 decode steps per host sync), and with prefix caching on (k = 1, 4),
against a host-side Python block allocator doing the same bookkeeping per step
(vLLM-style), side by side.

    python -m experiments.host_overhead_bench --num_seqs=16 --prompt_len=16 \
        --max_tokens=128 --out=results/host_overhead

Both paths run the same model, cache shapes, greedy sampling and requests.
Per path: wall time per token of the generation loop, and its split into
"device" (the jitted call until its outputs are on the host) and "host" (all
the rest: scheduling, bookkeeping, building inputs, handling outputs). A tiny
model keeps device compute small so the host part is visible.
The two paths are `paged_jax.bench.host_overhead`'s. Writes OUT/host_overhead.json and
prints a table.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import jax
import numpy as np

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import host_overhead
from paged_jax.config import cdiv


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.host_overhead_bench."""
  num_seqs: int = configs.flag(16, "concurrent sequences", lower=1)
  prompt_len: int = configs.flag(16, "prompt tokens per sequence", lower=1)
  max_tokens: int = configs.flag(128, "generated tokens per sequence", lower=1)
  block_size: int = configs.flag(16, "tokens per block", lower=1)
  hidden_size: int = configs.flag(64, "model width (tiny: host overhead dominates)", lower=4)
  repeats: int = configs.flag(7, "timed repetitions (medians reported)", lower=1)
  out: str = configs.flag("results/host_overhead", "output directory")


def run(f: Optional[Config] = None) -> Dict:
  """{"meta", "results": {path: per-token wall / host / device us, ratios to the Python
  allocator, same tokens}} for settings `f` (default `Config()`)."""
  f = f or Config()
  from paged_jax.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from paged_jax.models.llama import init_params  # pylint: disable=g-import-not-at-top
  mc = ModelConfig(vocab_size=256, hidden_size=f.hidden_size,
                   intermediate_size=2 * f.hidden_size, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position_embeddings=4096)
  params = init_params(mc, jax.random.key(0))
  n, plen, m, bs = f.num_seqs, f.prompt_len, f.max_tokens, f.block_size
  blocks_per_seq = cdiv(plen + m, bs)
  cc = mc.cache_config(block_size=bs, num_blocks=n * blocks_per_seq, max_seqs=n,
                       max_blocks_per_seq=blocks_per_seq, enable_prefix_caching=False)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(0, 256, size=plen)] for _ in range(n)]
  runs = {"python_allocator": lambda: host_overhead.python_allocator_run(mc, params, cc,
                                                                        prompts, m)}
  for k in (1, 4, 16):
    runs[f"in_jit_k{k}"] = lambda k=k: host_overhead.engine_run(mc, params, cc, prompts, m, k)
  # Prefix caching on: attach, LRU eviction and registration run inside the same one
  # dispatch per step; these rows price that work (the prompts share nothing, so the
  # tokens and the device work of the model are the same as the rows above).
  for k in (1, 4):
    runs[f"in_jit_k{k}_prefix_cache"] = lambda k=k: host_overhead.engine_run(
        mc, params, cc, prompts, m, k, caching=True)
  names = list(runs)
  outputs = {name: runs[name]()[0] for name in names}   # compile + warm up
  reference = outputs["python_allocator"]
  # Interleaved, rotating order, so the shared machine's load hits every path alike.
  all_timings = {name: [] for name in names}
  for r in range(f.repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      outputs[name], timing = runs[name]()
      all_timings[name].append(timing)
  results = {}
  for name in names:
    outs, timings = outputs[name], all_timings[name]
    tokens = n * m
    # Medians over repeats, each component separately (the machine is shared).
    med = lambda part: float(np.median([part(t) for t in timings])) * 1e6 / tokens
    results[name] = {
        "tokens": tokens, "device_calls": int(timings[0]["steps"]),
        "wall_us_per_token": med(lambda t: t["step_s"]),
        "device_us_per_token": med(lambda t: t["device_s"]),
        "host_us_per_token": med(lambda t: t["step_s"] - t["device_s"]),
        "same_tokens_as_python_allocator": outs == reference}
  base = results["python_allocator"]
  for r in results.values():
    r["host_overhead_ratio_vs_python"] = r["host_us_per_token"] / base["host_us_per_token"]
    r["wall_ratio_vs_python"] = r["wall_us_per_token"] / base["wall_us_per_token"]
  meta = {"jax": jax.__version__, "backend": jax.default_backend(),
          "device": str(jax.devices()[0]), "num_seqs": n, "prompt_len": plen, "max_tokens": m,
          "block_size": bs, "hidden_size": f.hidden_size, **provenance.run_metadata(f)}
  return {"meta": meta, "results": results}


def main(f: Config, out):
  """Runs with settings `f` into `out` (the `common.run_app` main)."""
  result = run(f)
  results = result["results"]
  common.write_json(out / "host_overhead.json", result)
  print(f"{'path':18s} {'calls':>6s} {'wall us/tok':>12s} {'host us/tok':>12s} "
        f"{'device us/tok':>14s} {'host x py':>10s} {'wall x py':>10s} same")
  for name, r in results.items():
    print(f"{name:18s} {r['device_calls']:6d} {r['wall_us_per_token']:12.1f} "
          f"{r['host_us_per_token']:12.1f} {r['device_us_per_token']:14.1f} "
          f"{r['host_overhead_ratio_vs_python']:10.2f} {r['wall_ratio_vs_python']:10.2f} "
          f"{r['same_tokens_as_python_allocator']}")


if __name__ == "__main__":
  common.run_app(main, Config)
