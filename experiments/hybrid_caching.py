r"""Hybrid KV with prefix caching on shared-prefix streams: memory held and hit rate kept
(issue 38, points 3 and 4(b)).

    python -m experiments.hybrid_caching --out=experiments/results/hybrid_caching

A Gemma-3-like layer pattern (`--sliding_per_full` sliding-window layers per full-attention
one, window `--window` tokens, the real tiny model with seeded random weights) serves the
same seeded streams of requests in three configurations (and the sweep below):

  hybrid_caching     hybrid KV + prefix caching (the default for a hybrid model);
  one_pool_caching   one pool for every layer + prefix caching (`hybrid_kv=False`);
  hybrid_no_caching  hybrid KV, prefix caching off.

Streams (`--streams`): `num_prefixes` seeded prefixes, each request one of them (uniform)
plus its own suffix, `gen` greedy tokens. "long": prefixes of W + bs .. 3W tokens (longer
than the window: a hit needs the full layers' every block and the sliding layers' last
window before the hit point). "short": prefixes of bs .. W - 1 tokens, short suffixes
(point 3's stream of short shared prompts: a hit needs every block on both groups; vLLM
#40696 hit 0% there). Requests arrive `arrivals_per_step` before each engine step, so a
later request can hit an earlier one's registered prefix. Each stream is drawn once per
seed of `--seeds` (the summary pools them; the weights come from the first).

Fairness: **equal main pools**. Every configuration has `num_blocks` main-pool blocks (the
one pool's, or the full-attention layers' pool with hybrid KV); hybrid KV adds its sliding
pool at the size `ModelConfig.cache_config` gives by default (`sliding_pool_blocks`: what
live sequences can hold plus one step's tokens; with caching, companions use the rest and
are evicted under pressure). So the full-attention layers cache exactly what the one pool
caches, and the comparison isolates what the smaller sliding pool costs in hits against
the memory it saves. `hybrid_caching+N` (`--sliding_extra`) gives the sliding pool N more
blocks: what room for companions buys back. (At equal KV bytes instead, the one pool
would have too few blocks for `max_seqs` sequences and preempt.) No request is preempted
(the main pool holds `max_seqs` sequences at full length, twice by default; checked), so
no hit is a recomputed request hitting its own blocks.

Measured per configuration and stream, after every step from the device state (unit: the
layer-block, one layer's K/V block of `block_size` tokens; `kv_bytes` converts):
held = layer-blocks not on a free list (live sequences' blocks + cached blocks and
companions); live = layer-blocks some running sequence's block table points at. Peak and
mean over the stream's steps. Hit rate = prompt tokens attached from the prefix cache
(`Engine.stats["prefix_hit_tokens"]`, what `Engine.metrics()` reports) / prompt tokens.
Headlines, per hybrid + caching configuration against one_pool_caching: `memory_saved` =
1 - its mean held / one pool's (`memory_saved_peak`: at the peak; `allocated_saved`: of
the layer-blocks each allocates), `hit_rate_kept` = its hit rate / one pool's.
Greedy outputs must be identical across all configurations (checked; RuntimeError
otherwise). One engine per configuration serves every stream, its prefix cache reset
between streams.
Writes OUT/hybrid_caching.json (flags, versions, machine) and prints a table.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np

from experiments import common
from experiments import configs
from experiments import hybrid_kv
from paged_jax.config import ModelConfig, cdiv, sliding_pool_blocks
from paged_jax.engine import Engine, SamplingParams
from paged_jax.models import init_params

CONFIGS = ("hybrid_caching", "one_pool_caching", "hybrid_no_caching")
STREAMS = ("long", "short")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.hybrid_caching."""
  streams: Tuple[str, ...] = configs.flag(STREAMS, "shared-prefix streams: prefixes longer "
                                          "(long) or shorter (short) than the window",
                                          choices=STREAMS)
  window: int = configs.flag(32, "sliding window in tokens", lower=2)
  sliding_per_full: int = configs.flag(5, "sliding-window layers per full-attention layer "
                                       "(Gemma-3: 5, Gemma-2: 1)", lower=1)
  block_size: int = configs.flag(4, "tokens per KV block", lower=1, upper=64)
  requests: int = configs.flag(48, "requests per stream", lower=1)
  num_prefixes: int = configs.flag(4, "distinct shared prefixes per stream", lower=1)
  gen: int = configs.flag(8, "greedy tokens per request", lower=1)
  max_seqs: int = configs.flag(8, "sequence slots", lower=1)
  num_blocks: int = configs.flag(0, "main-pool blocks in every configuration (0: twice "
                                 "max_seqs sequences at full length)", lower=0)
  max_num_batched_tokens: int = configs.flag(64, "engine token budget per step", lower=1)
  arrivals_per_step: int = configs.flag(1, "requests added before each step", lower=1)
  sliding_extra: Tuple[int, ...] = configs.flag((16, 32, 64), "also run hybrid + caching with "
                                                "this many sliding blocks over the default "
                                                "pool (room for companions)", lower=1)
  seeds: Tuple[int, ...] = configs.flag((0, 1, 2), "seeds of the streams (the model's "
                                        "weights: the first)", lower=0)
  out: str = configs.flag("results/hybrid_caching", "output directory")

  def check(self) -> None:
    if self.window <= self.block_size:
      raise ValueError(f"--window must be > --block_size={self.block_size} (a short prefix "
                       f"of at least one block), got {self.window}")

  @property
  def max_len(self) -> int:
    """Longest request in tokens (long prefix + suffix + generated)."""
    return 3 * self.window + 2 * self.block_size + self.gen


def model_config(f: Config) -> ModelConfig:
  """`hybrid_kv.gemma_like` for these flags, positions up to --max_len."""
  return hybrid_kv.gemma_like(f.window, f.sliding_per_full, f.max_len)


def stream(f: Config, kind: str, seed: int) -> Tuple[List[List[int]], List[List[int]]]:
  """Stream `kind` of `seed`: (its shared prefixes, its prompts in arrival order); token
  ids in 1..63."""
  rng = np.random.default_rng([seed, STREAMS.index(kind)])
  w, bs = f.window, f.block_size
  lo, hi, suffix = (w + bs, 3 * w, 2 * bs) if kind == "long" else (bs, w - 1, bs)
  tok = lambda n: [int(t) for t in rng.integers(1, 64, size=n)]
  prefixes = [tok(int(rng.integers(lo, hi + 1))) for _ in range(f.num_prefixes)]
  return prefixes, [prefixes[int(rng.integers(f.num_prefixes))]
                    + tok(int(rng.integers(1, suffix + 1))) for _ in range(f.requests)]


def _layer_blocks(st, n_full: int, n_sliding: int) -> Tuple[int, int]:
  """(held, live) layer-blocks of engine state `st` (see module doc)."""
  def pool(b):
    b = jax.device_get(b)
    tables = np.asarray(b.block_tables)[np.asarray(b.active)]
    return b.num_blocks - int(b.num_free), len(np.unique(tables[tables >= 0]))
  main = pool(st.blocks)
  if len(st.groups) == 1:
    return tuple(m * (n_full + n_sliding) for m in main)
  side = pool(st.groups[1].blocks)
  return tuple(n_full * m + n_sliding * s for m, s in zip(main, side))


def serve(engine: Engine, f: Config, prompts: List[List[int]], n_full: int,
          n_sliding: int) -> Dict:
  """Serves `prompts` to the end on `engine` (arrivals per step as flagged); its outputs
  in arrival order, hits, steps and the layer-blocks held / live after each step."""
  params = SamplingParams(max_tokens=f.gen, temperature=0.0)
  hits0, pre0 = engine.stats["prefix_hit_tokens"], engine.num_preemptions
  ids, done, held, live, nxt = [], {}, [], [], 0
  while nxt < len(prompts) or engine.has_unfinished():
    for p in prompts[nxt:nxt + f.arrivals_per_step]:
      ids.append(engine.add_request(p, params))
    nxt += f.arrivals_per_step
    done.update({o.request_id: o.outputs[0] for o in engine.step()})
    h, l = _layer_blocks(engine.state, n_full, n_sliding)
    held.append(h)
    live.append(l)
  outputs = [done[i] for i in ids]
  hit = engine.stats["prefix_hit_tokens"] - hits0
  prompt_tokens = sum(len(p) for p in prompts)
  return {"outputs": outputs, "served": sum(len(o) == f.gen for o in outputs),
          "steps": len(held), "preemptions": engine.num_preemptions - pre0,
          "hit_tokens": hit, "prompt_tokens": prompt_tokens, "hit_rate": hit / prompt_tokens,
          "held_peak": max(held), "held_mean": float(np.mean(held)),
          "live_peak": max(live), "live_mean": float(np.mean(live))}


def engines(f: Config) -> Dict[str, Tuple[Engine, Dict]]:
  """Each configuration's engine (the three, then hybrid_caching+N per `sliding_extra`) over
  one model and its weights, with facts of its cache config (pool sizes in blocks,
  allocated layer-blocks, KV bytes)."""
  mc = model_config(f)
  params = init_params(mc, jax.random.key(f.seeds[0]))
  per_seq = cdiv(f.max_len, f.block_size)
  nb = f.num_blocks or 2 * f.max_seqs * per_seq
  kw = dict(block_size=f.block_size, max_blocks_per_seq=per_seq, num_blocks=nb,
            max_seqs=f.max_seqs, max_num_batched_tokens=f.max_num_batched_tokens)
  pool = sliding_pool_blocks(f.window, f.block_size, f.max_seqs, f.max_num_batched_tokens)
  # (hybrid KV, prefix caching, extra sliding blocks over the default pool).
  settings = {"hybrid_caching": (True, True, 0), "one_pool_caching": (False, True, 0),
              "hybrid_no_caching": (True, False, 0)}
  settings.update({f"hybrid_caching+{x}": (True, True, x) for x in f.sliding_extra})
  n_layers, n_sliding = mc.num_layers, len(mc.sliding_layers)
  out = {}
  for name, (hybrid, caching, extra) in settings.items():
    cc = mc.cache_config(hybrid_kv=hybrid, enable_prefix_caching=caching, **kw,
                         **(dict(num_sliding_blocks=pool + extra) if extra else {}))
    # The default configurations get cache_config's own sliding pool: the one measured.
    assert not hybrid or cc.num_sliding_blocks == pool + extra, cc.num_sliding_blocks
    allocated = (nb * n_layers if not hybrid
                 else nb * (n_layers - n_sliding) + cc.num_sliding_blocks * n_sliding)
    out[name] = (Engine(mc, params, cc, max_num_batched_tokens=f.max_num_batched_tokens,
                        shape_buckets=False),
                 {"num_blocks": nb, "num_sliding_blocks": cc.num_sliding_blocks,
                  "allocated_layer_blocks": allocated, "kv_bytes": cc.kv_cache_bytes})
  return out


def run(f: Optional[Config] = None) -> Dict:
  """Every stream through every configuration (one engine each, the prefix cache reset
  between streams); the rows and headline numbers (module doc)."""
  f = f or Config()
  mc = model_config(f)
  n_sliding = len(mc.sliding_layers)
  n_full = mc.num_layers - n_sliding
  built = engines(f)
  rows = []
  for kind, seed in ((k, s) for k in f.streams for s in f.seeds):
    prefixes, prompts = stream(f, kind, seed)
    per = {}
    for name, (engine, facts) in built.items():
      if engine.state.prefix is not None:
        engine.reset_prefix_cache()
      per[name] = dict(serve(engine, f, prompts, n_full, n_sliding), **facts)
    outs = {name: r.pop("outputs") for name, r in per.items()}
    if any(o != outs[CONFIGS[0]] for o in outs.values()):
      raise RuntimeError(f"stream {kind} seed {seed}: greedy outputs differ across "
                         f"configurations")
    if any(r["preemptions"] for r in per.values()):   # a flag's doing: a one-line error
      raise ValueError(f"stream {kind} seed {seed}: a request was preempted (raise "
                         f"--num_blocks)")
    _headlines(per)
    rows.append({"stream": kind, "seed": seed, "requests": len(prompts),
                 "prefix_lens": sorted(len(p) for p in prefixes), "configs": per,
                 "outputs_equal": True})
  return {"rows": rows, "summary": pooled(rows), "num_layers": mc.num_layers,
          "num_sliding_layers": n_sliding,
          "fairness": "equal main pools; sliding pool at its default size (hybrid_caching) "
                      "or that + sliding_extra blocks (hybrid_caching+N)"}


def _headlines(per: Dict[str, Dict]) -> None:
  """Adds each hybrid + caching configuration's headlines against one_pool_caching."""
  one = per["one_pool_caching"]
  for name, hy in per.items():
    if name.startswith("hybrid_caching"):
      hy.update(memory_saved=1 - hy["held_mean"] / one["held_mean"],
                memory_saved_peak=1 - hy["held_peak"] / one["held_peak"],
                allocated_saved=1 - hy["allocated_layer_blocks"]
                                / one["allocated_layer_blocks"],
                hit_rate_kept=hy["hit_rate"] / one["hit_rate"] if one["hit_rate"] else None)


def pooled(rows: List[Dict]) -> List[Dict]:
  """Per stream: every configuration over the seeds (held and live: mean of the seeds'
  means, peak of peaks; hits, prompt tokens, steps, requests: sums), the headlines of the
  pooled figures, and `hit_rate_kept_per_seed`."""
  out = []
  for kind in dict.fromkeys(r["stream"] for r in rows):
    mine = [r for r in rows if r["stream"] == kind]
    per = {}
    for name, first in mine[0]["configs"].items():
      rs = [r["configs"][name] for r in mine]
      total = lambda k: sum(r[k] for r in rs)   # pylint: disable=cell-var-from-loop
      per[name] = {k: first[k] for k in ("num_sliding_blocks", "allocated_layer_blocks")}
      per[name].update(
          held_mean=float(np.mean([r["held_mean"] for r in rs])),
          held_peak=max(r["held_peak"] for r in rs),
          live_mean=float(np.mean([r["live_mean"] for r in rs])),
          hit_tokens=total("hit_tokens"), prompt_tokens=total("prompt_tokens"),
          hit_rate=total("hit_tokens") / total("prompt_tokens"), steps=total("steps"),
          served=total("served"))
      if "hit_rate_kept" in first:
        per[name]["hit_rate_kept_per_seed"] = [r["hit_rate_kept"] for r in rs]
    _headlines(per)
    out.append({"stream": kind, "seeds": [r["seed"] for r in mine],
                "requests": sum(r["requests"] for r in mine), "configs": per})
  return out


HEADERS = ["stream", "config", "sliding pool", "held mean", "held peak", "live mean",
           "allocated", "hit rate", "steps", "served", "saved: held mean / peak / allocated",
           "hit rate kept (per seed)"]


def summary_rows(result: Dict):
  """One row per stream and configuration, pooled over the seeds; the headlines (against
  one_pool_caching) on the hybrid + caching rows."""
  out = []
  for row in result["summary"]:
    for name, r in row["configs"].items():
      head = "memory_saved" in r
      kept = r.get("hit_rate_kept")
      out.append([row["stream"], name, r["num_sliding_blocks"] or "-", r["held_mean"],
                  r["held_peak"], r["live_mean"], r["allocated_layer_blocks"], r["hit_rate"],
                  r["steps"], f"{r['served']}/{row['requests']}",
                  f"{r['memory_saved']:.3f} / {r['memory_saved_peak']:.3f} / "
                  f"{r['allocated_saved']:.3f}" if head else "",
                  _kept(kept, r.get("hit_rate_kept_per_seed")) if head else ""])
  return out


def _kept(kept: Optional[float], per_seed: List[Optional[float]]) -> str:
  cell = lambda x: "n/a" if x is None else f"{x:.3f}"
  return f"{cell(kept)} ({' / '.join(map(cell, per_seed))})"


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "hybrid_caching.json", summary_rows(result), HEADERS,
                ["held / live: layer-blocks (one layer's K/V block); memory saved and hit "
                 "rate kept: hybrid_caching against one_pool_caching"])


if __name__ == "__main__":
  common.run_app(main, Config)
