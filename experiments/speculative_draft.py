r"""The draft_model proposer's extra dispatch on this CPU: tokens/s and steps of speculation
off, prompt lookup (ngram) and a draft model side by side, and the draft dispatch's share
of the step time (issue 39, point 3: "one extra dispatch, measured").

    python -m experiments.speculative_draft --out=experiments/results/speculative/draft_model

The shipped byte-level model (`paged_jax/assets/tiny_byte_llama`, 4 layers) serves
`--requests` greedy requests of `--gen` tokens from experiments.speculative's seeded
`repetitive` and `plain` workloads, or `shared_prefix` (prefix caching on: a story's first
`--prefix_len` bytes, then `--tail_len` bytes of another story per request; the first
request's prefill registers the prefix, later ones hit it), under each method of
`--methods`:

  off         no speculation;
  ngram       prompt lookup (`--lookup_max` / `--lookup_min`), k = `--k`;
  draft_1     method draft_model, the target's first layer as the draft
              (`draft_model.truncated`: its embeddings, norm and head kept), k = `--k`;
  draft_half  the same with the target's first half of its layers (2 of 4);
  draft_self  method draft_model, the target as its own draft (greedy: acceptance 1; its
              dispatch runs the whole target over the catch-up and k - 1 iterations);
  draft_self_noreuse  the same, its catch-up never skipping prefix-hit blocks whose draft
              K/V are whole (`DraftModel.reuse_prefix` off; differs on shared_prefix only).

One engine per method and workload (shared compiled steps), one untimed warm-up run each
(compiles; greedy outputs must equal speculation off's, else RuntimeError), then `--repeats`
timed runs, interleaved: each repetition runs every workload and method, the methods'
order reversed every other repetition. A run is `Engine.step()` until done: tokens/s on
`--clock` (cpu: this process's CPU seconds; wall) from the median run; `ratio` = tokens/s /
off's in the same workload with a bootstrap 90% interval of the ratio of medians
(experiments.speculative's). Steps, dispatches and catch-up tokens are means per timed run,
acceptance over all of them (each engine's back-off state carries over from its runs
before); `draft share` is the draft's `timing["prepare_s"]` (its host work, dispatch and
sync) over the engine's `timing["step_s"]`, `dispatch share` the jitted call until the
drafts are on the host alone, and `wall ms / dispatch` that call's mean (all wall seconds
summed over the timed runs); `reused` the catch-up tokens skipped on prefix hits, per run.
Writes OUT/speculative_draft.json
(flags, versions, machine; the load average at the start too).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Dict, List, Tuple

from experiments import common
from experiments import configs
from experiments import speculative as spec_cpu
from paged_jax import models
from paged_jax.engine import Engine, SamplingParams
from paged_jax.engine import draft_model
from paged_jax.engine import speculative

METHODS = ("off", "ngram", "draft_1", "draft_half", "draft_self", "draft_self_noreuse")
WORKLOADS = ("repetitive", "plain", "shared_prefix")
HEADERS = ("workload", "method", "k", "tokens/s ratio", "90% interval", "steps / run",
           "steps off", "wall ms / step", "acceptance", "draft dispatches / run (catch-up "
           "tokens)", "reused / run", "wall ms / dispatch", "draft share of step time",
           "dispatch share")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.speculative_draft."""
  workloads: Tuple[str, ...] = configs.flag(("repetitive", "plain"), "workloads to run",
                                            choices=WORKLOADS)
  methods: Tuple[str, ...] = configs.flag(METHODS, "methods to run (off always runs)",
                                          choices=METHODS)
  k: int = configs.flag(3, "num_speculative_tokens", lower=1, upper=16)
  lookup_max: int = configs.flag(4, "ngram: prompt_lookup_max", lower=1, upper=64)
  lookup_min: int = configs.flag(2, "ngram: prompt_lookup_min", lower=1, upper=64)
  requests: int = configs.flag(8, "requests per workload", lower=1)
  gen: int = configs.flag(64, "greedy tokens per request", lower=1)
  echo: int = configs.flag(48, "repetitive: bytes of the story repeated after it", lower=1)
  plain_len: int = configs.flag(64, "plain: prompt bytes", lower=1)
  prefix_len: int = configs.flag(256, "shared_prefix: shared bytes", lower=1, upper=300)
  tail_len: int = configs.flag(16, "shared_prefix: own bytes per request", lower=1,
                               upper=300)
  max_seqs: int = configs.flag(8, "sequence slots", lower=1)
  max_num_batched_tokens: int = configs.flag(256, "token budget per step", lower=8)
  repeats: int = configs.flag(11, "timed runs per method and workload", lower=1)
  clock: str = configs.flag("cpu", "what a run's time is: cpu (process CPU seconds) or "
                            "wall", choices=("cpu", "wall"))
  seed: int = configs.flag(0, "seed of the workloads", lower=0)
  out: str = configs.flag("results/speculative/draft_model", "output directory")

  def check(self) -> None:
    if self.lookup_min > self.lookup_max:
      raise ValueError(f"--lookup_min must be <= --lookup_max={self.lookup_max}, got "
                       f"{self.lookup_min}")


def prompts_of(f: Config, kind: str) -> List[List[int]]:
  """Seeded prompts (token ids) of one workload (WORKLOADS)."""
  if kind != "shared_prefix":
    return spec_cpu.workload(f, kind)
  stories = spec_cpu.workload(dataclasses.replace(f, requests=f.requests + 1, echo=1),
                              "repetitive")   # [BOS] + story + "\n\n" + its first byte
  return [stories[0][:1 + f.prefix_len] + s[1:1 + f.tail_len] for s in stories[1:]]


def make_engine(f: Config, model, method: str, caching: bool = False) -> Engine:
  """The shipped model's engine under `method` (METHODS)."""
  mc, params = model
  longest = 300 + 2 + max(f.echo, f.tail_len) + f.gen + 2
  cc = mc.cache_config(block_size=16, max_seqs=f.max_seqs,
                       max_blocks_per_seq=-(-longest // 16), enable_prefix_caching=caching)
  spec = None
  if method == "ngram":
    spec = speculative.SpeculativeConfig("ngram", f.k, f.lookup_max, f.lookup_min)
  elif method.startswith("draft_"):
    layers = {"draft_1": 1, "draft_half": max(1, mc.num_layers // 2)}.get(method)
    draft = model if layers is None else draft_model.truncated(mc, params, layers)
    spec = speculative.SpeculativeConfig("draft_model", f.k, model=draft)
  engine = Engine(mc, params, cc, max_num_batched_tokens=f.max_num_batched_tokens,
                  speculative_config=spec)
  if method == "draft_self_noreuse":
    engine._drafter.reuse_prefix = False   # pylint: disable=protected-access
  return engine


def serve(engine: Engine, prompts, gen: int, clock: str = "wall") -> Dict:
  """One run of `prompts` by `engine.step()`: outputs, seconds on `clock`, and the deltas
  of its metrics, its `timing` and its draft model's `timing` / `stats` (wall seconds)."""
  now = time.process_time if clock == "cpu" else time.perf_counter
  drafter = engine._drafter   # pylint: disable=protected-access
  snap = lambda: (dict(engine.metrics()), dict(engine.timing),
                  dict(drafter.timing) if drafter else {}, dict(drafter.stats) if drafter else {})
  before = snap()
  ids = [engine.add_request(p, SamplingParams(max_tokens=gen, temperature=0.0))
         for p in prompts]
  outs = {}
  t0 = now()
  while engine.has_unfinished():
    outs.update((o.request_id, o.outputs[0]) for o in engine.step())
  seconds = now() - t0
  after = snap()
  delta = [{k: v - b.get(k, 0) for k, v in a.items() if isinstance(v, (int, float))}
           for a, b in zip(after, before)]
  return dict(outputs=[outs[i] for i in ids], seconds=seconds, metrics=delta[0],
              timing=delta[1], draft_timing=delta[2], draft_stats=delta[3])


def run(f: Config) -> Dict:
  load_start = list(os.getloadavg())
  model = models.load_hf_checkpoint(models.DEFAULT_CHECKPOINT)
  methods = ("off",) + tuple(m for m in f.methods if m != "off")
  engines, prompts, base = {}, {}, {}
  for kind in f.workloads:   # warm-up: compiles every shape; greedy outputs checked
    prompts[kind] = prompts_of(f, kind)
    for m in methods:
      engines[kind, m] = make_engine(f, model, m, caching=kind == "shared_prefix")
      outs = serve(engines[kind, m], prompts[kind], f.gen)["outputs"]
      base.setdefault(kind, outs)
      if outs != base[kind]:
        raise RuntimeError(f"{kind}: greedy outputs under {m} differ from speculation off")
  runs = {key: [] for key in engines}
  for rep in common.progress(range(f.repeats), total=f.repeats):
    for kind in f.workloads:
      for m in (methods if rep % 2 == 0 else methods[::-1]):
        runs[kind, m].append(serve(engines[kind, m], prompts[kind], f.gen, f.clock))
  tokens = f.requests * f.gen
  rows = []
  for kind in f.workloads:
    off = [r["seconds"] for r in runs[kind, "off"]]
    for m in methods:
      rs = runs[kind, m]
      seconds = [r["seconds"] for r in rs]
      total = lambda part, key: sum(r[part].get(key, 0) for r in rs)   # over the timed runs
      drafted, dispatches = total("metrics", "spec_draft_tokens"), total("draft_stats",
                                                                         "dispatches")
      drafts = m.startswith("draft_")
      rows.append(dict(
          workload=kind, method=m, k=0 if m == "off" else f.k,
          tokens_per_s=tokens / statistics.median(seconds),
          ratio=statistics.median(off) / statistics.median(seconds),
          ratio_ci90=spec_cpu._ratio_ci(off, seconds, f.seed),   # pylint: disable=protected-access
          seconds=seconds, steps=total("metrics", "steps") / len(rs),
          steps_off=sum(r["metrics"]["steps"] for r in runs[kind, "off"]) / len(rs),
          wall_ms_per_step=1e3 * total("timing", "step_s") / total("metrics", "steps"),
          drafting_steps=total("metrics", "spec_steps") / len(rs), drafted=drafted,
          accepted=total("metrics", "spec_accepted_tokens"),
          acceptance=total("metrics", "spec_accepted_tokens") / drafted if drafted else None,
          draft_dispatches=dispatches / len(rs) if drafts else None,
          draft_catchup_tokens=total("draft_stats", "catchup_tokens") / len(rs) if drafts
          else None,
          reused_tokens=total("draft_stats", "reused_tokens") / len(rs) if drafts else None,
          prefix_hit_tokens=total("metrics", "prefix_hit_tokens") / len(rs),
          draft_ms_per_dispatch=(1e3 * total("draft_timing", "dispatch_s") / dispatches
                                 if dispatches else None),
          draft_share=(total("draft_timing", "prepare_s") / total("timing", "step_s")
                       if drafts else None),
          dispatch_share=(total("draft_timing", "dispatch_s") / total("timing", "step_s")
                          if drafts else None)))
  return {"rows": rows, "load_avg_start_1_5_15": load_start}


def summary_rows(result: Dict):
  pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
  rows = []
  for r in result["rows"]:
    lo, hi = r["ratio_ci90"]
    rows.append((r["workload"], r["method"], r["k"] or "-", r["ratio"],
                 "-" if r["method"] == "off" else f"{lo:.3f}-{hi:.3f}", r["steps"],
                 r["steps_off"], r["wall_ms_per_step"],
                 "-" if r["acceptance"] is None else r["acceptance"],
                 "-" if r["draft_dispatches"] is None else
                 f"{r['draft_dispatches']:.1f} ({r['draft_catchup_tokens']:.0f})",
                 "-" if r.get("reused_tokens") is None else f"{r['reused_tokens']:.0f}",
                 "-" if r["draft_ms_per_dispatch"] is None else r["draft_ms_per_dispatch"],
                 pct(r["draft_share"]), pct(r["dispatch_share"])))
  return rows


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "speculative_draft.json", summary_rows(result), HEADERS,
                [f"load average 1/5/15 min: {result['load_avg_start_1_5_15']} at the start, "
                 f"{result['machine']['load_avg_1_5_15']} at the end"])


if __name__ == "__main__":
  common.run_app(main, Config)
