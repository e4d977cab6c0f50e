r"""Hybrid KV with prefix caching at paper scale on the device-time model (issue 38, point 4(c)).

    python -m experiments.hybrid_scale --out=experiments/results/hybrid_scale

Gemma-2-9B (`perf.catalog`: 42 layers, every even one a 4,096-token sliding window) on one
A100-80GB: the real engine (scheduler, jitted block manager, prefix cache over both KV
groups) with the stand-in forward on virtual time (`paged_jax.bench.paper_scale`, as
experiments.paper_scale runs the paper's Fig. 12). Four configurations, same KV memory
(what the GPU leaves after the weights, `perf.kv_budget`), same requests:

  hybrid_caching   hybrid KV + prefix caching (the engine's default for a hybrid model);
  hybrid           hybrid KV, caching off;
  caching          one pool for every layer (`hybrid_kv=False`) + prefix caching;
  neither          one pool, caching off.

Pools (`perf.budget.pool_config`: `pool_sizing.from_memory_budget`, as the engine sizes its
own): one pool gets every whole block the budget holds; hybrid KV takes its sliding pool
at `sliding_pool_blocks` for `max_seqs` slots (every slot's whole window, or the main
pool's blocks if fewer: the size the engine requires so that pool never runs short), the
full-attention layers' pool gets the rest. So while windows are fewer than main blocks a
hybrid slot costs window x sliding layers of K/V whether it is used or not, and `max_seqs`
is sized per configuration: one pool: `--headroom` x the requests its memory holds at the
stream's mean (rounded up to 4; `sweep.system_sizes`' rule); hybrid: the most slots (a
multiple of 4) no more than `--headroom` x the mean requests the full pool then holds.
With caching the shared prompts' whole blocks count once.

Stream (`stream`): `--num_prefixes` seeded system prompts of `--prefix_min`..`--prefix_max`
tokens (uniform), each request one of them (uniform) plus a ShareGPT-like tail (prompt and
output lengths of `workloads.DATASETS["sharegpt"]`, the vLLM paper's Table 1 means), Poisson
arrivals; contexts up to the model's 8,192, so many requests outgrow the window.

Measured: the max request rate at the SLO (`--slo_factor` x neither's unloaded normalized
latency, the same for all; bracketing and bisection, `rate_search.bracket_and_bisect`,
interpolated at the crossing; ">= X" when no rate tried missed it); at one fixed rate
(`--fixed_rate_fraction` x neither's max rate): TTFT p50 / p99, the prefix hit rate (prompt
tokens attached from the cache / prompt tokens), and the KV memory per running request
(layer-blocks: one layer's K/V block of 16 tokens; after each step, the blocks some running
sequence's block table points at, each pool's x its layers (`hybrid_caching`'s "live"; a
shared block counts once), over the running requests; mean over steps). `memory_saved`: 1 - a
hybrid configuration's per-request figure / the one-pool configuration's with the same
caching. `analytic_saved`: the same for the stream's requests at their full lengths with
nothing shared (what an allocator that frees out-of-window blocks into one shared pool,
as vLLM's hybrid allocator, holds). Writes OUT/hybrid_scale.json.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Tuple

import numpy as np

from experiments import common
from experiments import configs
from experiments import hybrid_caching
from paged_jax import perf
from paged_jax.bench import arrivals
from paged_jax.bench import latency
from paged_jax.bench import paper_scale
from paged_jax.bench import rate_search
from paged_jax.bench import sweep
from paged_jax.bench import workloads
from paged_jax.perf import budget as budget_lib

# name: (hybrid KV, prefix caching); the first sets the SLO and the fixed rate.
CONFIGS = {"neither": (False, False), "caching": (False, True), "hybrid": (True, False),
           "hybrid_caching": (True, True)}

# vLLM's published figures for hybrid allocation (the comparison rows of the docs' table;
# rendered from here, the cited constants, not from a run).
VLLM_FIGURES = (
    dict(source="vLLM RFC #11382 (github.com/vllm-project/vllm/issues/11382)",
         model="Gemma-2", figure="KV memory wasted allocating every layer the whole context",
         value="25%", setup="the RFC's count (block size 1): half the layers need only the "
         "4K window of an 8K context; no serving run"),
    dict(source="vLLM RFC #11382", model="Ministral", figure="the same", value="56.25%",
         setup="as above, Ministral's window pattern"),
    dict(source="vLLM PR #11938 (github.com/vllm-project/vllm/pull/11938)",
         model="Gemma-2-27B-it", figure="throughput, total (input + output) tok/s, main -> "
         "hybrid allocator", value="1,077.11 -> 1,239.96 (1.15x; output tok/s 153.87 -> "
         "177.14)", setup="vLLM V1 benchmark_throughput.py: 50 prompts of 6,144 random "
         "tokens + 1,024 generated, all at once, no shared prefix; one pool for both groups, "
         "out-of-window blocks freed into it; GPU not stated (the follow-up PR #12655 ran "
         "the same command on an H100)"),
)
VLLM_HEADERS = ("source", "model", "figure", "value", "setup")

HEADERS = ("config", "max_seqs", "full pool blocks", "sliding pool blocks",
           "max rate at SLO (req/s)", "vs neither", "TTFT p50 (s)", "TTFT p99 (s)",
           "hit rate", "layer-blocks / request", "memory saved", "analytic saved",
           "preemptions")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.hybrid_scale."""
  model: str = configs.flag("gemma-2-9b", "catalog model with sliding and full layers")
  gpu: str = configs.flag("a100-80gb", "catalog GPU")
  configs_run: Tuple[str, ...] = configs.flag(tuple(CONFIGS), "configurations (the first "
                                              "sets the SLO)", choices=tuple(CONFIGS))
  mode: str = configs.flag("search", "search: max rate at the SLO and a fixed-rate point per "
                           "configuration; burst: every request at t = 0 (saturated "
                           "throughput, where KV memory bounds the batch)",
                           choices=("search", "burst"))
  num_prefixes: int = configs.flag(8, "distinct shared system prompts", lower=1)
  prefix_min: int = configs.flag(2048, "shortest system prompt (tokens)", lower=1)
  prefix_max: int = configs.flag(7168, "longest system prompt (tokens)", lower=1)
  num_requests: int = configs.flag(150, "requests per point", lower=10)
  slo_factor: float = configs.flag(3.0, "SLO: this x neither's unloaded normalized latency",
                                   lower=1.0)
  fixed_rate_fraction: float = configs.flag(0.5, "TTFT, hits and memory measured at this x "
                                            "the first configuration's max rate",
                                            lower=0.01, upper=1.0)
  headroom: float = configs.flag(1.5, "one pool: max_seqs = this x its memory concurrency",
                                 lower=1.0)
  max_seqs_cap: int = configs.flag(paper_scale.MAX_NUM_SEQS, "max_seqs cap", lower=4)
  max_points: int = configs.flag(6, "rates measured per search", lower=2)
  rel_tol: float = configs.flag(0.1, "bisect until the bracket's hi / lo <= 1 + this",
                                lower=0.001)
  seed: int = configs.flag(0, "stream seed", lower=0)
  out: str = configs.flag("results/hybrid_scale", "output directory")

  def check(self) -> None:
    if self.prefix_max < self.prefix_min:
      raise ValueError(f"--prefix_max must be >= --prefix_min={self.prefix_min}, got "
                       f"{self.prefix_max}")


def stream(f: Config, max_len: int) -> Tuple[List[np.ndarray], List[workloads.Request]]:
  """(the system prompts, the requests at rate 1 req/s): see the module docstring."""
  if f.prefix_max + 2 > max_len:
    raise ValueError(f"--prefix_max must be <= max_len - 2 = {max_len - 2}, got {f.prefix_max}")
  rng = np.random.default_rng([f.seed, 38])
  vocab = paper_scale.VOCAB_SIZE
  prefixes = [rng.integers(0, vocab, int(n), dtype=np.int32)
              for n in rng.integers(f.prefix_min, f.prefix_max + 1, f.num_prefixes)]
  tails, outs = workloads.sample_lengths(workloads.DATASETS["sharegpt"], f.num_requests,
                                         seed=f.seed, max_len=max_len - f.prefix_max)
  which = rng.integers(0, f.num_prefixes, f.num_requests)
  reqs = [workloads.Request(i, np.concatenate([prefixes[w], rng.integers(0, vocab, int(t),
                                                                          dtype=np.int32)]),
                            int(o))
          for i, (w, t, o) in enumerate(zip(which, tails, outs))]
  return prefixes, reqs


def at_rate(reqs, rate: float, seed: int) -> List[workloads.Request]:
  times = arrivals.arrival_times(rate, seed=seed, num_requests=len(reqs))
  return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(reqs, times)]


def sizes(f: Config, setting, prefixes, reqs, hybrid: bool, caching: bool) -> Dict:
  """{"max_seqs", "num_blocks", "num_sliding_blocks", "memory_concurrency"} (module doc)."""
  bs = paper_scale.BLOCK_SIZE
  shared = sum((len(p) // bs) * bs for p in prefixes) if caching else 0
  # Tokens a request holds on average over its life; with caching its system prompt's
  # whole blocks are held once for all (`shared`), not by the request.
  own = [r.prompt_len - (_prefix_len(r, prefixes) // bs * bs if caching else 0) for r in reqs]
  held = float(np.mean([o + r.output_len / 2 + bs / 2 for o, r in zip(own, reqs)]))

  def pools(max_seqs: int):
    return budget_lib.pool_config(
        setting.model, setting.budget, block_size=bs, max_seqs=max_seqs,
        max_len=setting.max_len, max_num_batched_tokens=paper_scale.PAPER.max_num_batched_tokens,
        hybrid_kv=hybrid)

  conc = lambda c: (c.num_blocks * bs - shared) / held
  if not hybrid:
    c = pools(4)
    max_seqs = max(4, min(f.max_seqs_cap, 4 * math.ceil(f.headroom * conc(c) / 4)))
  else:
    max_seqs = 4
    while (max_seqs + 4 <= f.max_seqs_cap
           and f.headroom * conc(pools(max_seqs + 4)) >= max_seqs + 4):
      max_seqs += 4
  c = pools(max_seqs)
  if c.num_blocks * bs < setting.max_len:
    raise ValueError(f"{setting.model}: the full pool holds no {setting.max_len}-token context "
                     f"beside a sliding pool for {max_seqs} slots")
  return {"max_seqs": int(max_seqs), "num_blocks": int(c.num_blocks),
          "num_sliding_blocks": int(c.num_sliding_blocks), "memory_concurrency": conc(c),
          "kv_cache_bytes": int(c.kv_cache_bytes), "shared_tokens": int(shared)}


def _prefix_len(req, prefixes) -> int:
  """Tokens of the system prompt `req` starts with (its longest matching prefix)."""
  ids = req.prompt_token_ids
  best = 0
  for p in prefixes:
    if len(p) <= len(ids) and np.array_equal(ids[:len(p)], p):
      best = max(best, len(p))
  return best


def analytic_layer_blocks(spec, reqs, hybrid: bool) -> float:
  """Mean layer-blocks a request holds at its full length with nothing shared: every layer
  every block (one pool), or the sliding layers at most the window's blocks + 1."""
  bs = paper_scale.BLOCK_SIZE
  blocks = np.array([-(-r.total_len // bs) for r in reqs], np.float64)
  if not hybrid:
    return float(np.mean(blocks * spec.num_layers))
  win = -(-(spec.sliding_window - 1) // bs) + 1
  return float(np.mean(blocks * spec.num_full_layers
                       + np.minimum(blocks, win) * spec.num_sliding_layers))


class MeteredClock(perf.ModelClock):
  """A ModelClock that also reads the engine's pool counts after each step (`attach`)."""

  def attach(self, engine, spec) -> None:
    self.engine, self.spec = engine, spec
    self.samples: List[float] = []

  def stepped(self, step=None, **kw) -> float:
    out = super().stepped(step, **kw)
    eng = getattr(self, "engine", None)
    running = eng.metrics()["num_running"] if eng is not None else 0
    if running:
      _, live = hybrid_caching._layer_blocks(   # pylint: disable=protected-access
          eng.state, self.spec.num_full_layers, self.spec.num_sliding_layers)
      self.samples.append(live / running)
    return out


def run(f: Config) -> Dict:
  """Every configuration of `f.configs_run`: its sizes, max rate at the SLO and fixed-rate
  point (module docstring)."""
  from paged_jax.engine import release_compiled  # pylint: disable=g-import-not-at-top
  setting = paper_scale.setting(f.model, f.gpu, max_len=perf.model_spec(f.model).max_context)
  spec = setting.device_model.model
  if not 0 < spec.num_sliding_layers < spec.num_layers:
    raise ValueError(f"--model must have sliding-window and full-attention layers (hybrid KV); "
                     f"{spec.name} has {spec.num_sliding_layers} sliding of {spec.num_layers}")
  bs, max_len = paper_scale.BLOCK_SIZE, setting.max_len
  prefixes, base = stream(f, max_len)
  prompt_tokens = int(sum(r.prompt_len for r in base))

  def point(name: str, size: Dict, rate: float, n: int = f.num_requests) -> Dict:
    hybrid, caching = CONFIGS[name]
    clock = MeteredClock(setting.device_model, block_size=bs)
    made = []

    def make(**kw):
      kw.pop("attention_backend", None)
      made.append(setting.make_engine(
          **kw, prefix_caching=caching, hybrid_kv=hybrid,
          num_sliding_blocks=size["num_sliding_blocks"]))
      clock.attach(made[-1], spec)
      return made[-1]

    reqs = at_rate(base[:n], rate, f.seed)
    res = sweep.run_point("paged", reqs, kv_budget_tokens=size["num_blocks"] * bs,
                          block_size=bs, max_len=max_len,
                          sizes={"max_seqs": size["max_seqs"],
                                 "pool_tokens": size["num_blocks"] * bs},
                          params_fn=sweep.sampling({}), clock=clock,
                          preemption_mode="recompute", engine_fn=make,
                          max_num_batched_tokens=paper_scale.PAPER.max_num_batched_tokens)
    m = made[-1].metrics()
    res["hit_rate"] = m["prefix_hit_tokens"] / sum(r.prompt_len for r in reqs)
    res["layer_blocks_per_request"] = (float(np.mean(clock.samples)) if clock.samples
                                       else None)
    return res

  norm = lambda p: p["summary"]["normalized_latency_s_per_token"]
  first = f.configs_run[0]
  all_sizes = {c: sizes(f, setting, prefixes, base, *CONFIGS[c]) for c in f.configs_run}
  head = {"mode": f.mode, "setting": setting.as_dict(),
          "forward": "paged_jax.models.standin.hybrid_config (2 layers: one sliding, one "
          "full; no attention)", "prefix_lens": [len(p) for p in prefixes],
          "prompt_tokens": prompt_tokens, "mean_prompt_len": prompt_tokens / len(base),
          "mean_output_len": float(np.mean([r.output_len for r in base])),
          "share_over_window": float(np.mean([r.total_len > spec.sliding_window
                                              for r in base])),
          "vllm": list(VLLM_FIGURES)}
  if f.mode == "burst":
    rows = []
    for name in common.progress(f.configs_run, total=len(f.configs_run)):
      p = point(name, all_sizes[name], math.inf)
      hybrid, caching = CONFIGS[name]
      rows.append(dict(config=name, hybrid_kv=hybrid, prefix_caching=caching,
                       sizes=all_sizes[name], summary=p["summary"], hit_rate=p["hit_rate"],
                       layer_blocks_per_request=p["layer_blocks_per_request"],
                       mean_running=p["mean_running"], max_running=p["max_running"],
                       preemptions=p["preemptions"], steps=p["steps"]))
      release_compiled()
    first_tok = rows[0]["summary"]["throughput_tok_s"]
    for r in rows:
      r["vs_first"] = r["summary"]["throughput_tok_s"] / first_tok
    return dict(head, rows=rows)
  probe = rate_search.probe_rate(point(first, all_sizes[first], math.inf))
  unloaded = norm(point(first, all_sizes[first], probe * rate_search.UNLOADED_FRACTION, 24))
  slo = latency.slo_from_unloaded([unloaded], f.slo_factor)
  rows, first_rate = [], None
  for name in common.progress(f.configs_run, total=len(f.configs_run)):
    size = all_sizes[name]
    runs: Dict[float, Dict] = {}

    def measure(rate: float, name=name, size=size, runs=runs) -> float:
      runs[rate] = point(name, size, rate)
      return norm(runs[rate])

    start = first_rate or rate_search.PROBE_FACTOR * probe
    curve = rate_search.bracket_and_bisect(measure, start, slo, rel_tol=f.rel_tol,
                                           max_points=f.max_points)
    found = latency.max_rate_at_slo([r for r, _ in curve], [v for _, v in curve], slo)
    best = found["interpolated"] or found["swept"]
    if first_rate is None:
      first_rate = best
    fixed = point(name, size, f.fixed_rate_fraction * first_rate)
    hybrid, caching = CONFIGS[name]
    rows.append(dict(
        config=name, hybrid_kv=hybrid, prefix_caching=caching, sizes=size, max_rate=best,
        found=found, censored=found["interpolated"] is None, curve=[list(c) for c in curve],
        fixed_rate=f.fixed_rate_fraction * first_rate,
        ttft_p50_s=fixed["summary"]["ttft_p50_s"], ttft_p99_s=fixed["summary"]["ttft_p99_s"],
        fixed_summary=fixed["summary"], hit_rate=fixed["hit_rate"],
        layer_blocks_per_request=fixed["layer_blocks_per_request"],
        mean_running=fixed["mean_running"], preemptions=fixed["preemptions"],
        analytic_layer_blocks=analytic_layer_blocks(spec, base, hybrid)))
    release_compiled()
  by = {r["config"]: r for r in rows}
  for r in rows:
    r["vs_first"] = r["max_rate"] / first_rate if first_rate else None
    twin = by.get("caching" if r["prefix_caching"] else "neither")
    r["memory_saved"] = r["analytic_saved"] = None
    if r["hybrid_kv"] and twin is not None:
      if r["layer_blocks_per_request"] and twin["layer_blocks_per_request"]:
        r["memory_saved"] = 1 - r["layer_blocks_per_request"] / twin["layer_blocks_per_request"]
      r["analytic_saved"] = 1 - r["analytic_layer_blocks"] / twin["analytic_layer_blocks"]
  return dict(head, slo_s_per_token=slo, unloaded_s_per_token=unloaded, probe_req_s=probe,
              rows=rows)


def summary_rows(result: Dict):
  rate = lambda r: f">= {r['max_rate']:.3g}" if r.get("censored") else r["max_rate"]
  dash = lambda v: "-" if v is None else v
  return [(r["config"], r["sizes"]["max_seqs"], r["sizes"]["num_blocks"],
           r["sizes"]["num_sliding_blocks"] or "-", rate(r), dash(r["vs_first"]),
           r["ttft_p50_s"], r["ttft_p99_s"], r["hit_rate"] if r["prefix_caching"] else "-",
           dash(r["layer_blocks_per_request"]), dash(r["memory_saved"]),
           dash(r["analytic_saved"]), r["preemptions"]) for r in result["rows"]]


BURST_HEADERS = ("config", "max_seqs", "full pool blocks", "sliding pool blocks",
                 "throughput (tok/s)", "vs first", "requests running (mean / max)",
                 "hit rate", "layer-blocks / request", "TTFT p50 (s)", "preemptions")


def burst_rows(result: Dict):
  return [(r["config"], r["sizes"]["max_seqs"], r["sizes"]["num_blocks"],
           r["sizes"]["num_sliding_blocks"] or "-", r["summary"]["throughput_tok_s"],
           r["vs_first"], f"{r['mean_running']:.1f} / {r['max_running']}",
           r["hit_rate"] if r["prefix_caching"] else "-", r["layer_blocks_per_request"],
           r["summary"]["ttft_p50_s"], r["preemptions"]) for r in result["rows"]]


def vllm_rows(result: Dict):
  """VLLM_FIGURES (cited constants; `result` is not read)."""
  del result
  return [tuple(v[k] for k in VLLM_HEADERS) for v in VLLM_FIGURES]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  burst = f.mode == "burst"
  slo = "" if burst else f"SLO {result['slo_s_per_token']:.4g} s/token; "
  common.report(result, out, "hybrid_scale.json",
                (burst_rows if burst else summary_rows)(result),
                BURST_HEADERS if burst else HEADERS,
                lines=[f"{slo}prompts mean {result['mean_prompt_len']:.0f} tokens, "
                       f"{result['share_over_window']:.0%} of requests outgrow the window"])


if __name__ == "__main__":
  common.run_app(main, Config)
