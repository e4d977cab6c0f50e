r"""Automatic prefix caching: hit rates, prefill saved, memory, throughput (paper Sec. 6.4).

    python -m experiments.prefix_caching --system_prompt_lens=256,512 --num_requests=100 \
        --few_shot_requests=64 --block_size=16 --kv_budget_tokens=4096 --out=results/prefix_caching

(a) `num_requests` requests arrive at once, all starting with one random system
    prompt of each length in `system_prompt_lens` (256..896: the shipped tiny
    byte-level model has 1024 positions), followed by a ~30-token question and
    ~30 generated tokens; (b) the paper's few-shot translation prompts: a shared
    80-token (1-shot) and 341-token (5-shot) prefix (`workloads.shared_prefix`).
    For each, the same requests are served by `Engine` (caching off) and
    `Engine` with `enable_prefix_caching=True` (on), one after the other in one run, same KV budget,
    same model, greedy; outputs must be identical. Reported: block hit rate,
    prefill tokens computed, peak / mean KV blocks held by running sequences,
    copies of the shared prefix cached, throughput (generated tokens/s) and its
    on/off ratio beside the paper's 1.67x (1-shot) and 3.58x (5-shot).
(c) hit rate against block size 1..256 (block-level, no model): pairs of
    prompts share a random-length common prefix and then differ; the second
    reuses only whole blocks of the first, so large blocks lose up to
    block_size - 1 shared tokens (`lost_tokens`).
(d) cost of one lookup (per looked-up block) and of one eviction batch at
    num_blocks 1K..1M.

Writes DIR/prefix_caching.json and DIR/prefix_caching.png.
"""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Sequence

import numpy as np

from experiments import common
from paged_jax.bench import engines
from paged_jax.bench import workloads

PAPER_SPEEDUP = {"1-shot": 1.67, "5-shot": 3.58}   # vLLM paper Fig. 16 (LLaMA-13B, translation)


def _engine(caching: bool, *, block_size: int, kv_budget_tokens: int, max_seqs: int,
            max_len: int, budget: int):
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  mc, params = engines.tiny_model()
  cc = mc.cache_config(block_size=block_size, num_blocks=kv_budget_tokens // block_size,
                       max_seqs=max_seqs, max_blocks_per_seq=-(-max_len // block_size),
                       enable_prefix_caching=caching)
  return Engine(mc, params, cc, max_num_batched_tokens=budget)


def _serve(engine, requests) -> Dict:
  """Serves all requests (arriving at t=0); per-step KV blocks held by running sequences."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  # The step runs on shape buckets chosen from what is live, each compiled on first
  # use: an untimed pass over the same requests compiles the shapes the timed one meets.
  engine.generate([[int(t) for t in r.prompt_token_ids] for r in requests],
                  [SamplingParams(max_tokens=r.output_len, temperature=0.0) for r in requests])
  if engine.cache_config.enable_prefix_caching:
    engine.reset_prefix_cache()          # the warm-up prompts must not count
  nb = engine.cache_config.num_blocks
  base_tokens, base_preempt = engine.stats["generated_tokens"], engine.num_preemptions
  ids = [engine.add_request([int(t) for t in r.prompt_token_ids],
                            SamplingParams(max_tokens=r.output_len, temperature=0.0))
         for r in requests]
  used, outs = [], {}
  start = time.perf_counter()
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o.outputs[0]
    used.append(nb - engine.num_free)   # caching on: num_free counts evictable blocks
  seconds = time.perf_counter() - start
  engine.flush()
  gen = engine.stats["generated_tokens"] - base_tokens
  return {"seconds": seconds, "tokens_per_s": gen / seconds, "generated_tokens": int(gen),
          "steps": len(used), "peak_blocks": int(max(used)), "mean_blocks": float(np.mean(used)),
          "preemptions": int(engine.num_preemptions - base_preempt), "outputs": [outs[i] for i in ids]}


def _prefix_copies(engine, prefix: np.ndarray) -> int:
  """Cached blocks holding the shared prefix's first block (1 = stored once)."""
  import jax  # pylint: disable=g-import-not-at-top
  c = jax.device_get(engine.state.prefix.cache)
  bs = engine.cache_config.block_size
  first = np.asarray(prefix[:bs])
  hold = np.asarray(c.cached) & (np.asarray(c.block_depth) == 0) & np.all(
      np.asarray(c.block_tokens) == first[None, :], axis=1)
  return int(hold.sum())


def compare(name: str, prefix: np.ndarray, requests, **engine_kw) -> Dict:
  """Caching off vs on for one request list; one row."""
  off = _serve(_engine(False, **engine_kw), requests)
  eng = _engine(True, **engine_kw)
  on = _serve(eng, requests)
  s = eng.prefix_stats()
  prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
  same = off.pop("outputs") == on.pop("outputs")
  if not same:
    raise RuntimeError(f"{name}: outputs differ with prefix caching on and off")
  return {
      "workload": name, "prefix_len": int(len(prefix)), "requests": len(requests),
      "prompt_tokens": prompt_tokens, "hit_rate": s["hit_rate"],
      "hit_tokens": s["hit_tokens"], "prefill_tokens_off": prompt_tokens,
      "prefill_tokens_on": s["prefill_tokens"],
      "prefill_reduction": 1.0 - s["prefill_tokens"] / prompt_tokens,
      "prefix_prefill_reduction": 1.0 - max(0, s["prefill_tokens"] - (prompt_tokens - len(
          prefix) * len(requests))) / (len(prefix) * len(requests)),
      "prefix_copies_cached": _prefix_copies(eng, prefix),
      "off": off, "on": on, "outputs_identical": same,
      "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
      "paper_ratio": PAPER_SPEEDUP.get(name),
  }


def system_prompt_requests(num_requests: int, prefix_len: int, seed: int):
  from paged_jax.bench import workloads  # pylint: disable=g-import-not-at-top
  return workloads.shared_prefix(num_requests, prefix_len=prefix_len, seed=seed, max_len=1024,
                                 vocab_size=256)


def few_shot_requests(num_requests: int, shots: int, seed: int):
  from paged_jax.bench import workloads  # pylint: disable=g-import-not-at-top
  return workloads.shared_prefix(num_requests, num_shots=shots, seed=seed, max_len=1024,
                                 vocab_size=256)


def block_size_sweep(block_sizes: Sequence[int], *, num_pairs: int = 64, prompt_len: int = 512,
                     seed: int = 0) -> List[Dict]:
  """(c): hit rate vs block size for prompt pairs that differ after a random point."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax import prefix_cache as pc  # pylint: disable=g-import-not-at-top
  from paged_jax.config import CacheConfig  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  firsts = rng.integers(0, 256, (num_pairs, prompt_len)).astype(np.int32)
  cuts = rng.integers(1, prompt_len, num_pairs)
  seconds = firsts.copy()
  for i, c in enumerate(cuts):     # differ from position c on
    seconds[i, c:] = (firsts[i, c:] + 1 + rng.integers(0, 255, prompt_len - c)) % 256
  rows = []
  for bs in block_sizes:
    p = -(-prompt_len // bs)
    cfg = CacheConfig(block_size=bs, num_blocks=2 * p + 2, max_seqs=2, max_blocks_per_seq=p)
    attach = jax.jit(pc.attach)
    append = jax.jit(bm.append)
    register = jax.jit(pc.register)
    free = jax.jit(pc.free)
    reset = jax.jit(pc.reset)
    cache, blocks = pc.init(cfg), bm.init(cfg)
    n_full = prompt_len // bs
    hits = []
    for a, b in zip(firsts, seconds):
      cache, blocks, _, _ = attach(cache, blocks, 0, a, prompt_len)
      blocks, _, _ = append(blocks, jnp.arange(2) == 0, jnp.asarray([prompt_len, 0]))
      cache, blocks = register(cache, blocks, np.zeros((p,), np.int32),
                               np.arange(p, dtype=np.int32),
                               np.pad(a, (0, p * bs - prompt_len)).reshape(p, bs), n_full)
      cache, blocks, hit, _ = attach(cache, blocks, 1, b, prompt_len)
      hits.append(int(hit))
      cache, blocks, _ = free(cache, blocks, jnp.asarray([0, 1]))
      cache, blocks = reset(cache, blocks)
    hits = np.asarray(hits)
    shared = np.minimum(cuts, prompt_len - 1)
    rows.append({"block_size": bs, "hit_rate": float(hits.sum() / shared.sum()),
                 "mean_hit_tokens": float(hits.mean()), "mean_shared_tokens": float(shared.mean()),
                 "lost_tokens": float((shared - hits).mean())})
  return rows


def lookup_cost(num_blocks_list: Sequence[int], *, block_size: int = 16,
                cached_blocks: int = 330, reps: int = 15) -> List[Dict]:
  """(d): per looked-up block lookup time; eviction of 16 blocks (ring, donated, as
  the engine runs it) against the O(num_blocks) top-k scan it replaces; the
  per-step O(num_blocks) count of evictable blocks. One sequence of
  `cached_blocks` full blocks is cached and released first."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax import prefix_cache as pc  # pylint: disable=g-import-not-at-top
  from paged_jax.config import CacheConfig  # pylint: disable=g-import-not-at-top

  def timed(fn, n=reps):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(n):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t0)
    return float(np.median(ts))

  rows = []
  for nb in num_blocks_list:
    cb = min(cached_blocks, nb // 2)
    cfg = CacheConfig(block_size=block_size, num_blocks=nb, max_seqs=2,
                      max_blocks_per_seq=cb + 1)
    cache, blocks = pc.init(cfg), bm.init(cfg)
    toks = np.random.default_rng(nb).integers(0, 1000, cfg.max_seq_len).astype(np.int32)
    n = cb * block_size + 1
    cache, blocks, _, _ = jax.jit(pc.attach)(cache, blocks, 0, toks, n)
    blocks, _, _ = jax.jit(bm.append)(blocks, jnp.arange(2) == 0, jnp.asarray([n, 0]))
    cache, blocks = jax.jit(pc.register)(
        cache, blocks, np.zeros((cb,), np.int32), np.arange(cb, dtype=np.int32),
        toks[:cb * block_size].reshape(-1, block_size), cb)
    cache, blocks, _ = jax.jit(pc.free)(cache, blocks, 0)
    lookup = jax.jit(pc.lookup)
    assert int(lookup(cache, toks, n)[0]) == cb
    t_lookup = timed(lambda: lookup(cache, toks, n))
    vic = jax.jit(pc.lru_victims, static_argnames=("max_evict",))
    cnt = jax.jit(pc.num_evictable)
    short = blocks.replace(num_free=jnp.asarray(0, jnp.int32))
    t_topk = timed(lambda: vic(cache, short, 16, max_evict=64))
    t_count = timed(lambda: cnt(cache, blocks))
    ev = jax.jit(pc.ensure_free, donate_argnums=(0, 1), static_argnames=("max_evict",))
    ts = []
    for _ in range(min(reps, cb // 16 - 1)):       # each call evicts 16 more, donated
      blocks = blocks.replace(num_free=jnp.asarray(0, jnp.int32))
      t0 = time.perf_counter()
      cache, blocks, k = ev(cache, blocks, 16, max_evict=64)
      jax.block_until_ready(k)
      ts.append(time.perf_counter() - t0)
      assert int(k) == 16
    rows.append({"num_blocks": nb, "lookup_s": t_lookup, "lookup_s_per_block": t_lookup / cb,
                 "evict16_s": float(np.median(ts[1:])), "topk16_s": t_topk,
                 "count_evictable_s": t_count})
  return rows


def plot(result: Dict, path) -> str:
  plt = common.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  rows = result["serving"]
  names = [r["workload"] for r in rows]
  x = np.arange(len(rows))
  ax = axes[0]
  ax.bar(x - 0.2, [r["off"]["tokens_per_s"] for r in rows], 0.4, label="caching off")
  ax.bar(x + 0.2, [r["on"]["tokens_per_s"] for r in rows], 0.4, label="caching on")
  for i, r in enumerate(rows):
    label = f"{r['throughput_ratio']:.2f}x" + (f"\n(paper {r['paper_ratio']}x)"
                                              if r["paper_ratio"] else "")
    ax.annotate(label, (i + 0.2, r["on"]["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
  ax.set_xticks(x, names, rotation=15)
  ax.set_ylabel("generated tokens / s")
  ax.set_title("throughput, tiny model on CPU")
  ax.legend()
  ax = axes[1]
  ax.bar(x - 0.2, [r["prefill_tokens_off"] for r in rows], 0.4, label="prefill off")
  ax.bar(x + 0.2, [r["prefill_tokens_on"] for r in rows], 0.4, label="prefill on")
  ax.set_xticks(x, names, rotation=15)
  ax.set_ylabel("prompt tokens computed")
  ax.set_title("prefill work (hit rate above bars)")
  for i, r in enumerate(rows):
    ax.annotate(f"{r['hit_rate']:.2f}", (i + 0.2, r["prefill_tokens_on"]), ha="center",
                va="bottom", fontsize=8)
  ax.legend()
  ax = axes[2]
  sweep = result["block_size_sweep"]
  ax.plot([r["block_size"] for r in sweep], [r["hit_rate"] for r in sweep], "o-")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("block size (tokens)")
  ax.set_ylabel("hit tokens / shared tokens")
  ax.set_title("hit rate vs block size (prompts differ after a random point)")
  return str(common.save_png(fig, path))


HEADERS = ["workload", "hit rate", "prefill off", "prefill on", "saved", "peak blocks off/on",
           "tok/s off", "tok/s on", "ratio", "paper"]


def summary_rows(rows):
  return [[r["workload"], r["hit_rate"], r["prefill_tokens_off"], r["prefill_tokens_on"],
           r["prefill_reduction"], f"{r['off']['peak_blocks']}/{r['on']['peak_blocks']}",
           r["off"]["tokens_per_s"], r["on"]["tokens_per_s"], r["throughput_ratio"],
           r["paper_ratio"] or "-"] for r in rows]


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_list("system_prompt_lens", ["256", "512"], "(a) system prompt lengths (<= 896)")
  flags.DEFINE_integer("num_requests", 100, "(a) requests per system prompt", lower_bound=1)
  flags.DEFINE_integer("few_shot_requests", 64, "(b) requests per few-shot prefix (0: skip)",
                       lower_bound=0)
  flags.DEFINE_integer("block_size", 16, "tokens per KV block", lower_bound=1)
  flags.DEFINE_integer("kv_budget_tokens", 4096,
                       "KV pool in token slots (small enough that memory bounds the batch "
                       "without caching, as in the paper)", lower_bound=1)
  flags.DEFINE_integer("max_seqs", 64, "sequence slots", lower_bound=1)
  flags.DEFINE_integer("max_num_batched_tokens", 256, "tokens per step", lower_bound=1)
  flags.DEFINE_list("sweep_block_sizes", ["1", "2", "4", "8", "16", "32", "64", "128", "256"],
                    "(c) block sizes")
  flags.DEFINE_integer("sweep_pairs", 48, "(c) prompt pairs per block size", lower_bound=1)
  flags.DEFINE_list("lookup_num_blocks", ["1024", "16384", "262144", "1048576"],
                    "(d) pool sizes for the lookup / eviction cost")
  flags.DEFINE_integer("seed", 0, "workload seed")
  flags.DEFINE_string("out", "results/prefix_caching", "output directory")


def main(argv):
  from absl import flags  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    sys.exit(f"unexpected arguments {argv[1:]}")
  f = flags.FLAGS
  lens = [int(x) for x in f.system_prompt_lens]
  if any(not 1 <= n <= 896 for n in lens):
    sys.exit(f"--system_prompt_lens must be in [1, 896] (1024-position model), got {lens}")
  if f.kv_budget_tokens % f.block_size:
    sys.exit(f"--kv_budget_tokens must be a multiple of --block_size={f.block_size}")
  out = common.out_dir(f.out)
  start = time.time()
  kw = dict(block_size=f.block_size, kv_budget_tokens=f.kv_budget_tokens, max_seqs=f.max_seqs,
            max_len=1024, budget=f.max_num_batched_tokens)
  jobs = [(f"system{n}", system_prompt_requests(f.num_requests, n, f.seed)) for n in lens]
  if f.few_shot_requests:
    jobs += [(f"{s}-shot", few_shot_requests(f.few_shot_requests, s, f.seed)) for s in (1, 5)]
  rows = []
  for name, (prefix, requests) in common.progress(jobs, desc="workloads"):
    rows.append(compare(name, prefix, requests, **kw))
    r = rows[-1]
    print(f"{name}: hit rate {r['hit_rate']:.3f}, prefill {r['prefill_tokens_off']} -> "
          f"{r['prefill_tokens_on']}, {r['throughput_ratio']:.2f}x", file=sys.stderr)
  sweep = block_size_sweep([int(b) for b in f.sweep_block_sizes], num_pairs=f.sweep_pairs,
                           seed=f.seed)
  cost = lookup_cost([int(n) for n in f.lookup_num_blocks])
  result = {"serving": rows, "block_size_sweep": sweep, "lookup_cost": cost,
            "seconds": time.time() - start,
            "flags": {k: f[k].value for k in (
                "system_prompt_lens", "num_requests", "few_shot_requests", "block_size",
                "kv_budget_tokens", "max_seqs", "max_num_batched_tokens", "sweep_block_sizes",
                "sweep_pairs", "lookup_num_blocks", "seed")}}
  common.write_json(out / "prefix_caching.json", result)
  png = plot(result, out / "prefix_caching.png")
  print(common.table(summary_rows(rows), HEADERS, digits=2))
  print(common.table([[r["block_size"], r["hit_rate"], r["lost_tokens"]] for r in sweep],
                     ["block size", "hit rate", "lost shared tokens"], digits=3))
  print(common.table([[r["num_blocks"], r["lookup_s_per_block"] * 1e6, r["evict16_s"] * 1e6,
                       r["topk16_s"] * 1e6, r["count_evictable_s"] * 1e6] for r in cost],
                     ["num_blocks", "lookup us/block", "evict 16 (ring) us",
                      "evict 16 (top-k scan) us", "count evictable us"], digits=1))
  print(f"wrote {out / 'prefix_caching.json'}, {png}")


if __name__ == "__main__":
  # One runner for every experiment: one-line errors for bad flags and bad values.
  common.run_app(lambda flag_values, out: main([sys.argv[0]]), _define_flags)
