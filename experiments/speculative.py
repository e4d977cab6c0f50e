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
              match, so speculation must back off (no draft, a plain decode row).

Each configuration (speculation off, and ngram with each k of `--ks`) runs every workload
`--repeats` times after one untimed warm-up run (which compiles its step shapes), in
interleaved order, one engine per configuration; the median wall time gives tokens/s and
`ratio` = tokens/s / speculation off's in the same workload (> 1: faster). Steps are the
engine's device steps; acceptance = accepted drafts / drafted (`Engine.metrics()`
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

WORKLOADS = ("repetitive", "plain", "no_match")
HEADERS = ("workload", "k", "tokens/s ratio", "steps", "steps off", "acceptance",
           "accepted by position")


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
    elif kind == "plain":
      text = story[:f.plain_len]
    else:
      text = "".join(chr(int(c)) for c in rng.integers(33, 127, f.plain_len))
    out.append(tokenizer.encode(text))
  return out


def _engine(f: Config, model, k: int) -> Engine:
  """The shipped model's engine, speculating k tokens (0: off)."""
  mc, params = model
  longest = 300 + 2 + f.echo + f.gen + 2
  cc = mc.cache_config(block_size=16, max_seqs=f.max_seqs,
                       max_blocks_per_seq=-(-longest // 16), enable_prefix_caching=False)
  spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": f.lookup_max,
           "prompt_lookup_min": f.lookup_min} if k else None)
  return Engine(mc, params, cc, max_num_batched_tokens=f.max_num_batched_tokens,
                speculative_config=spec)


def _serve(engine: Engine, prompts, gen: int):
  """(outputs, wall seconds, metrics delta) of one run of `prompts`."""
  before = dict(engine.metrics())
  t0 = time.perf_counter()
  outs = engine.generate(prompts, SamplingParams(max_tokens=gen, temperature=0.0))
  seconds = time.perf_counter() - t0
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
  engines = {k: _engine(f, model, k) for k in ks}
  rows = []
  for kind in f.workloads:
    prompts = workload(f, kind)
    base = None
    for k in ks:   # warm-up: compiles each configuration's shapes; outputs checked
      outs, _, _ = _serve(engines[k], prompts, f.gen)
      if base is None:
        base = outs
      elif outs != base:
        raise RuntimeError(f"{kind}: greedy outputs with k={k} differ from speculation off")
    times = {k: [] for k in ks}
    metrics = {}
    for rep in common.progress(range(f.repeats), total=f.repeats):
      order = ks if rep % 2 == 0 else ks[::-1]
      for k in order:
        _, seconds, delta = _serve(engines[k], prompts, f.gen)
        times[k].append(seconds)
        metrics[k] = delta
    tokens = f.requests * f.gen
    off_tps = tokens / statistics.median(times[0])
    for k in ks:
      m, tps = metrics[k], tokens / statistics.median(times[k])
      drafted = m.get("spec_draft_tokens", 0)
      rows.append(dict(
          workload=kind, k=k, tokens_per_s=tps, ratio=tps / off_tps, seconds=times[k],
          steps=m["steps"], steps_off=metrics[0]["steps"], generated=m["generated_tokens"],
          drafted=drafted, accepted=m.get("spec_accepted_tokens", 0),
          acceptance=(m["spec_accepted_tokens"] / drafted) if drafted else None,
          accepted_by_position=[a / d if d else None for a, d in zip(
              m.get("spec_accepted_by_position", []), m.get("spec_drafted_by_position", []))]))
  return {"rows": rows}


def summary_rows(result: Dict):
  fmt = lambda xs: " ".join("-" if x is None else f"{x:.2f}" for x in xs)
  return [(r["workload"], r["k"] or "off", r["ratio"], r["steps"], r["steps_off"],
           "-" if r["acceptance"] is None else r["acceptance"], fmt(r["accepted_by_position"]))
          for r in result["rows"]]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "speculative.json", summary_rows(result), HEADERS)


if __name__ == "__main__":
  common.run_app(main, Config)
