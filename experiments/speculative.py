r"""Speculative decoding (n-gram prompt lookup) on this CPU: tokens/s, steps and acceptance,
with and without speculation, side by side (issue 39, point 5's CPU part).

    python -m experiments.speculative --out=experiments/results/speculative

The shipped byte-level model (`paged_jax/assets/tiny_byte_llama`) serves `--requests`
greedy requests of `--gen` tokens from three seeded workloads built from
experiments/data/stories.txt:

  repetitive  a story, a blank line, then the story's first `--echo` bytes again: the
              model copies the story, which prompt lookup proposes (high acceptance);
  plain       a story's first `--plain_len` bytes: free continuation of templated text;
  no_match    `--plain_len` seeded random printable bytes: little for prompt lookup to
              match, so speculation must back off (no draft, a plain decode row);
  always_miss the plain prompts with a proposer that drafts k NUL bytes every step, a
              token the model never emits: acceptance 0 with a draft on every step
              the back-off allows, the case where speculation must cost nothing
              (issue 39: at most 3% slower than off);
  always_hit  the plain prompts with a proposer that drafts speculation off's own
              greedy continuation (from the warm-up run): acceptance 1, the case where
              the back-off must never stop drafting;
  draft_self  the plain prompts, method draft_model with the shipped model as its own
              draft (greedy: acceptance 1);
  draft_half  the plain prompts, method draft_model with the shipped model's first half
              of its layers as the draft (`draft_model.truncated`).

Each configuration (speculation off, and ngram with each k of `--ks`) runs every workload
`--repeats` times after one untimed warm-up run (which compiles its step shapes), in
interleaved order, one engine per configuration and workload (fresh back-off state,
shared compiled steps); the median time on `--clock` (cpu: this process's CPU seconds,
which other tenants of a shared machine barely move; wall) gives tokens/s and `ratio` =
tokens/s / speculation off's in the same workload (> 1: faster), with a bootstrap 90%
interval of the ratio of medians (`ratio_ci90`). Steps are the
engine's device steps, drafting steps those with at least one draft (`spec_steps`, what
the engine-wide back-off thins out); acceptance = accepted drafts / drafted (`Engine.metrics()`
spec_*), and by draft position. Greedy outputs must equal speculation off's (checked;
RuntimeError otherwise). Writes OUT/speculative.json (flags, versions, machine).
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time
from typing import Dict, List, Tuple

import numpy as np

from experiments import common
from experiments import configs
from paged_jax import models
from paged_jax import tokenizer
from paged_jax.engine import Engine, SamplingParams
from paged_jax.engine import draft_model
from paged_jax.engine import speculative

WORKLOADS = ("repetitive", "plain", "no_match", "always_miss", "always_hit", "draft_self",
             "draft_half")
NUL = tokenizer.encode("\x00")[-1]   # the byte the always_miss proposer drafts
HEADERS = ("workload", "k", "tokens/s ratio", "90% interval", "steps", "steps off",
           "drafted", "acceptance", "accepted by position")
COUNT_HEADERS = ("workload", "k", "steps", "steps off", "drafting steps",
                 "drafting steps / steps", "drafting rows", "drafted", "acceptance",
                 "accepted per drafting row", "first run: drafting steps / steps",
                 "draft model dispatches (catch-up tokens)")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.speculative."""
  workloads: Tuple[str, ...] = configs.flag(WORKLOADS, "workloads to run", choices=WORKLOADS)
  ks: Tuple[int, ...] = configs.flag((2, 4), "num_speculative_tokens values", lower=1,
                                     upper=16)
  lookup_max: int = configs.flag(4, "prompt_lookup_max", lower=1, upper=64)
  lookup_min: int = configs.flag(2, "prompt_lookup_min", lower=1, upper=64)
  requests: int = configs.flag(16, "requests per workload", lower=1)
  gen: int = configs.flag(128, "greedy tokens per request", lower=1)
  echo: int = configs.flag(48, "repetitive: bytes of the story repeated after it", lower=1)
  plain_len: int = configs.flag(64, "plain / no_match: prompt bytes", lower=1)
  max_seqs: int = configs.flag(8, "sequence slots", lower=1)
  max_num_batched_tokens: int = configs.flag(256, "token budget per step", lower=8)
  repeats: int = configs.flag(3, "timed runs per configuration and workload", lower=1)
  clock: str = configs.flag("cpu", "what a run's time is: cpu (process CPU seconds) or "
                            "wall", choices=("cpu", "wall"))
  seed: int = configs.flag(0, "seed of the workloads", lower=0)
  out: str = configs.flag("results/speculative", "output directory")

  def check(self) -> None:
    if self.lookup_min > self.lookup_max:
      raise ValueError(f"--lookup_min must be <= --lookup_max={self.lookup_max}, got "
                       f"{self.lookup_min}")


def workload(f: Config, kind: str) -> List[List[int]]:
  """Seeded prompts (token ids) of one workload."""
  rng = np.random.default_rng(f.seed)
  text = (pathlib.Path(__file__).parent / "data" / "stories.txt").read_text(encoding="utf-8")
  stories = [s for s in text.split("\n\n") if len(s) > 300]
  picks = rng.choice(len(stories), f.requests, replace=len(stories) < f.requests)
  out = []
  for i in picks:
    story = stories[int(i)][:300]
    if kind == "repetitive":
      text = story + "\n\n" + story[:f.echo]
    elif kind in ("plain", "always_miss", "always_hit", "draft_self", "draft_half"):
      text = story[:f.plain_len]
    else:
      text = "".join(chr(int(c)) for c in rng.integers(33, 127, f.plain_len))
    out.append(tokenizer.encode(text))
  return out


def _never(tokens, k):   # the always_miss proposer
  del tokens
  return (NUL,) * k


def _oracle(reference):
  """The always_hit proposer: drafts the next tokens of `reference` (dict prompt tuple ->
  greedy output, filled once speculation off has run) after a request's tokens so far."""
  def propose(tokens, k):
    for p, out in reference.items():
      if tuple(tokens[:len(p)]) == p:
        done = len(tokens) - len(p)
        return tuple(out[done:done + k])
    return ()
  return propose


def _engine(f: Config, model, k: int, kind: str = "", reference=None) -> Engine:
  """The shipped model's engine, speculating k tokens (0: off) on workload `kind`
  (always_hit: `reference`, the dict `_oracle` reads)."""
  mc, params = model
  longest = 300 + 2 + f.echo + f.gen + 2
  cc = mc.cache_config(block_size=16, max_seqs=f.max_seqs,
                       max_blocks_per_seq=-(-longest // 16), enable_prefix_caching=False)
  proposer = {"always_miss": _never,
              "always_hit": _oracle(reference if reference is not None else {})}
  spec = (speculative.SpeculativeConfig("ngram", k, f.lookup_max, f.lookup_min,
                                        proposer=proposer.get(kind))
          if k else None)
  if k and kind.startswith("draft_"):
    draft = model if kind == "draft_self" else draft_model.truncated(
        mc, params, max(1, mc.num_layers // 2))
    spec = speculative.SpeculativeConfig("draft_model", k, model=draft)
  return Engine(mc, params, cc, max_num_batched_tokens=f.max_num_batched_tokens,
                speculative_config=spec)


def _serve(engine: Engine, prompts, gen: int, clock: str = "wall"):
  """(outputs, seconds on `clock`, metrics delta) of one run of `prompts`."""
  now = time.process_time if clock == "cpu" else time.perf_counter
  before = dict(engine.metrics())
  t0 = now()
  outs = engine.generate(prompts, SamplingParams(max_tokens=gen, temperature=0.0))
  seconds = now() - t0
  after = engine.metrics()
  delta = {}
  for key, v in after.items():
    if isinstance(v, list):
      delta[key] = [a - b for a, b in zip(v, before[key])]
    elif isinstance(v, (int, float)) and key in before:
      delta[key] = v - before[key]
  return [o.outputs[0] for o in outs], seconds, delta


def run(f: Config) -> Dict:
  model = models.load_hf_checkpoint(models.DEFAULT_CHECKPOINT)
  ks = (0,) + tuple(f.ks)
  rows = []
  for kind in f.workloads:
    reference = {}   # always_hit's proposer reads speculation off's outputs
    engines = {k: _engine(f, model, k, kind, reference) for k in ks}
    prompts = workload(f, kind)
    base, first = None, {}
    for k in ks:   # warm-up: compiles each configuration's shapes; outputs checked
      outs, _, first[k] = _serve(engines[k], prompts, f.gen)
      if base is None:
        base = outs
        reference.update((tuple(p), o) for p, o in zip(prompts, outs))
      elif outs != base:
        raise RuntimeError(f"{kind}: greedy outputs with k={k} differ from speculation off")
    times = {k: [] for k in ks}
    metrics = {}
    for rep in common.progress(range(f.repeats), total=f.repeats):
      order = ks if rep % 2 == 0 else ks[::-1]
      for k in order:
        _, seconds, delta = _serve(engines[k], prompts, f.gen, f.clock)
        times[k].append(seconds)
        metrics[k] = delta
    tokens = f.requests * f.gen
    off_tps = tokens / statistics.median(times[0])
    for k in ks:
      m, tps = metrics[k], tokens / statistics.median(times[k])
      drafted = m.get("spec_draft_tokens", 0)
      rows.append(dict(
          workload=kind, k=k, tokens_per_s=tps, ratio=tps / off_tps, seconds=times[k],
          ratio_ci90=_ratio_ci(times[0], times[k], f.seed),
          steps=m["steps"], steps_off=metrics[0]["steps"], generated=m["generated_tokens"],
          drafting_steps=m.get("spec_steps", 0),
          first_run_steps=first[k]["steps"],
          first_run_drafting_steps=first[k].get("spec_steps", 0),
          drafting_rows=sum(m.get("spec_drafted_by_position", [0])[:1]),
          draft_dispatches=m.get("draft_dispatches"),
          draft_catchup_tokens=m.get("draft_catchup_tokens"),
          drafted=drafted, accepted=m.get("spec_accepted_tokens", 0),
          acceptance=(m["spec_accepted_tokens"] / drafted) if drafted else None,
          accepted_by_position=[a / d if d else None for a, d in zip(
              m.get("spec_accepted_by_position", []), m.get("spec_drafted_by_position", []))]))
  return {"rows": rows}


def _ratio_ci(off: List[float], on: List[float], seed: int) -> Tuple[float, float]:
  """A bootstrap 90% interval of median(off) / median(on) (2,000 resamples, seeded)."""
  rng = np.random.default_rng(seed)
  a, b = np.asarray(off), np.asarray(on)
  ia = rng.integers(0, len(a), (2000, len(a)))
  ib = rng.integers(0, len(b), (2000, len(b)))
  r = np.median(a[ia], axis=1) / np.median(b[ib], axis=1)
  return float(np.quantile(r, 0.05)), float(np.quantile(r, 0.95))


def summary_rows(result: Dict):
  fmt = lambda xs: " ".join("-" if x is None else f"{x:.2f}" for x in xs)
  ci = lambda r: "-" if not r["k"] or "ratio_ci90" not in r else (
      f"{r['ratio_ci90'][0]:.3f}-{r['ratio_ci90'][1]:.3f}")
  return [(r["workload"], r["k"] or "off", r["ratio"], ci(r), r["steps"], r["steps_off"],
           r["drafted"], "-" if r["acceptance"] is None else r["acceptance"],
           fmt(r["accepted_by_position"])) for r in result["rows"]]


def count_rows(result: Dict):
  """The step counts alone (what the engine-wide back-off decides), one row a run: the
  timed run's (the back-off state carried over from the warm-up run on the same engine)
  and the warm-up's, a fresh engine's first run."""
  out = []
  for r in result["rows"]:
    rows = r.get("drafting_rows", 0)
    out.append((r["workload"], r["k"] or "off", r["steps"], r["steps_off"],
                r.get("drafting_steps", 0), r.get("drafting_steps", 0) / r["steps"], rows,
                r["drafted"], "-" if r["acceptance"] is None else r["acceptance"],
                r["accepted"] / rows if rows else "-",
                f"{r.get('first_run_drafting_steps', 0)} / {r.get('first_run_steps', '-')}",
                "-" if r.get("draft_dispatches") is None else
                f"{r['draft_dispatches']} ({r['draft_catchup_tokens']})"))
  return out


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "speculative.json", summary_rows(result), HEADERS,
                [common.table(count_rows(result), COUNT_HEADERS)])


if __name__ == "__main__":
  common.run_app(main, Config)
