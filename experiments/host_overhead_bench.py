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
Writes OUT/host_overhead.json and prints a table.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax import kv_cache
from paged_jax.attention import AttentionMetadata
from paged_jax.config import OK
from paged_jax.config import ModelConfig
from paged_jax.config import cdiv
from paged_jax.engine import Engine
from paged_jax.engine import SamplingParams
from paged_jax.models.llama import LlamaForCausalLM
from paged_jax.models.llama import init_params
from paged_jax.testing import BlockModel


_FWD_CACHE = {}


def python_allocator_run(mc, params, cc, prompts, max_tokens):
  """Greedy generation of `max_tokens` per prompt with the plain-Python allocator
  (`testing.BlockModel`) doing the block bookkeeping each step and one jitted forward of
  the model; returns (outputs per prompt, {"device_s", "step_s", "steps"})."""
  if mc not in _FWD_CACHE:   # compiled once per model, like the engine's step
    model = LlamaForCausalLM(mc, attention_backend="auto")

    def _fwd(params, pages, tokens, positions, meta):
      logits, pages = model.apply(params, tokens, positions, pages, meta)
      return pages, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    _FWD_CACHE[mc] = jax.jit(_fwd, donate_argnums=(1,))
  fwd = _FWD_CACHE[mc]
  s, p = cc.max_seqs, cc.max_blocks_per_seq
  alloc = BlockModel.from_config(cc)   # the plain-Python allocator (the tests' oracle)
  pages = kv_cache.init(cc)
  seqs = [list(x) for x in prompts]
  computed = [0] * len(seqs)
  timing = {"device_s": 0.0, "step_s": 0.0, "steps": 0}
  outputs = [[] for _ in seqs]
  live = list(range(len(seqs)))
  budget = max(s, sum(len(x) for x in prompts))
  while live:
    t0 = time.perf_counter()
    # The engine's two token buckets: max_seqs (decode) or the full budget (prefill).
    t_max = s if sum(len(seqs[i]) - computed[i] for i in live) <= s else budget
    tokens = np.zeros((t_max,), np.int32)
    positions = np.zeros((t_max,), np.int32)
    slot_mapping = np.full((t_max,), -1, np.int32)
    tables = np.full((s, p), -1, np.int32)
    kv_lens = np.zeros((s,), np.int32)
    q_lens = np.zeros((s,), np.int32)
    # Bookkeeping for the whole batch: prompts allocate, running sequences grow.
    fresh = [i for i in live if not alloc.active[i]]
    status = alloc.allocate(fresh, [len(seqs[i]) for i in fresh])
    grow = [alloc.active[i] and i in live and i not in fresh for i in range(s)]
    counts = [len(seqs[i]) - computed[i] if i < len(seqs) else 0 for i in range(s)]
    grown, cow = alloc.append(grow, counts)
    assert set(status + grown) == {OK} and max(cow)[0] < 0, (status, grown)  # nothing shared
    t = 0
    for row, i in enumerate(live):
      new = seqs[i][computed[i]:]
      pos = list(range(computed[i], computed[i] + len(new)))
      tokens[t:t + len(new)], positions[t:t + len(new)] = new, pos
      slot_mapping[t:t + len(new)] = alloc.token_slots([i] * len(new), pos)
      t += len(new)
      tables[row, :len(alloc.tables[i])] = alloc.tables[i]
      kv_lens[row], q_lens[row] = alloc.lens[i], len(new)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=tables, kv_lens=kv_lens,
                             cu_q_lens=cu, num_seqs=np.int32(len(live)),
                             logits_indices=np.maximum(cu[1:] - 1, 0))
    t1 = time.perf_counter()
    pages, nxt = fwd(params, pages, tokens, positions, meta)
    nxt = np.asarray(jax.device_get(nxt))
    timing["device_s"] += time.perf_counter() - t1
    still = []
    for row, i in enumerate(live):
      computed[i] = len(seqs[i])
      seqs[i].append(int(nxt[row]))
      outputs[i].append(int(nxt[row]))
      if len(outputs[i]) >= max_tokens:
        alloc.free([i])
      else:
        still.append(i)
    live = still
    timing["steps"] += 1
    timing["step_s"] += time.perf_counter() - t0
  return outputs, timing


def engine_run(mc, params, cc, prompts, max_tokens, k, caching=False):
  """The same generation by `Engine` with `k` decode steps per host sync (prefix caching
  on with `caching`); returns (outputs, {"device_s", "step_s" (the whole call), "steps"
  (jitted calls)})."""
  cc = cc.replace(enable_prefix_caching=caching)
  budget = max(cc.max_seqs, sum(len(x) for x in prompts))
  engine = Engine(mc, params, cc, max_num_batched_tokens=budget, decode_steps_per_sync=k)
  t0 = time.perf_counter()
  outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
  # Wall time of the whole call, measured here: the engine's own timing["step_s"] counts
  # only step() calls, and generate() may drive the engine without them.
  timing = dict(engine.timing, step_s=time.perf_counter() - t0)
  timing["steps"] = engine.stats["device_steps"]
  return [o.outputs[0] for o in outs], timing


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
  runs = {"python_allocator": lambda: python_allocator_run(mc, params, cc,
                                                                        prompts, m)}
  for k in (1, 4, 16):
    runs[f"in_jit_k{k}"] = lambda k=k: engine_run(mc, params, cc, prompts, m, k)
  # Prefix caching on: attach, LRU eviction and registration run inside the same one
  # dispatch per step; these rows price that work (the prompts share nothing, so the
  # tokens and the device work of the model are the same as the rows above).
  for k in (1, 4):
    runs[f"in_jit_k{k}_prefix_cache"] = lambda k=k: engine_run(
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
