r"""Speculative decoding at paper scale on the device-time model: max rate at the SLO and TPOT
against k and the acceptance rate (issue 39, point 5's paper-scale part).

    python -m experiments.speculative_scale --out=experiments/results/speculative_scale

OPT-13B on one A100-40GB (the paper's Table 1 deployment, its KV budget), ShareGPT-like
Poisson streams, the real engine with the stand-in forward on virtual time
(`paged_jax.bench.paper_scale`), as Fig. 12 runs it. The proposer is a stand-in too: it
knows the stand-in model's greedy continuation (`standin_proposer`) and proposes each
draft token right with probability `alpha`, stopping at the first wrong one it proposes
(so position i of a draft is accepted with probability alpha**(i+1): the per-token
acceptance rate alpha, swept). Every draft costs what a real one costs: k + 1 tokens
verified in the step (the device-time model prices the row as a chunk of 1 + k tokens at
its context), k lookahead slots reserved in the KV pool for the step (fewer requests fit),
the rejected ones rolled back.

The SLO is `--slo_factor` x the unloaded normalized latency without speculation, the same
for every configuration. For each (k, alpha): the max rate at the SLO found by bracketing
and bisection (`rate_search.bracket_and_bisect`; "interpolated" between the last rates
under and over it; censored, ">= X", when no rate tried missed the SLO: a stream of
`--num_requests` drains in bounded time, so a configuration fast enough never crosses),
and TPOT p50 / p99 at `--fixed_rate_fraction` x speculation-off's max rate (a moderately
loaded server). Where lookahead's KV and compute cost outweighs its
gain shows as a max rate below speculation off's. Writes OUT/speculative_scale.json.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Tuple

import numpy as np

from experiments import common
from experiments import configs
from paged_jax.bench import latency
from paged_jax.bench import paper_scale
from paged_jax.bench import rate_search
from paged_jax.bench import sweep
from paged_jax.engine import speculative
from paged_jax.models import standin

HEADERS = ("k", "alpha", "max rate at SLO (req/s; >= X: no rate tried missed it)", "vs off",
           "TPOT p50 (ms)",
           "TPOT p99 (ms)", "acceptance", "preemptions")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.speculative_scale."""
  model: str = configs.flag("opt-13b", "catalog model")
  gpu: str = configs.flag("a100-40gb", "catalog GPU")
  workload: str = configs.flag("sharegpt", "request lengths", choices=("sharegpt", "alpaca"))
  ks: Tuple[int, ...] = configs.flag((2, 4), "num_speculative_tokens values", lower=1,
                                     upper=16)
  alphas: Tuple[float, ...] = configs.flag((0.3, 0.9), "per-token acceptance rates",
                                           lower=0.0, upper=1.0)
  num_requests: int = configs.flag(300, "requests per point", lower=10)
  slo_factor: float = configs.flag(3.0, "SLO: this x the unloaded latency (Fig. 12's)",
                                   lower=1.0)
  fixed_rate_fraction: float = configs.flag(0.5, "TPOT measured at this x speculation "
                                            "off's max rate", lower=0.01, upper=1.0)
  max_points: int = configs.flag(6, "rates measured per search", lower=2)
  seed: int = configs.flag(0, "stream seed", lower=0)
  out: str = configs.flag("results/speculative_scale", "output directory")


def standin_proposer(vocab: int, alpha: float, seed: int):
  """(tokens, k) -> drafts: the stand-in model's greedy continuation (`standin.apply`'s
  hash, in numpy), each token kept with probability `alpha` (a seeded draw per sequence
  length), the draft ending after the first token replaced by a wrong one."""
  mix = [np.uint32(m) for m in standin._MIX]   # pylint: disable=protected-access
  ids = np.arange(vocab, dtype=np.uint32)

  def greedy_next(tok: int, pos: int) -> int:
    with np.errstate(over="ignore"):
      x = np.uint32(tok) * mix[0] + np.uint32(pos) * mix[1] + ids * mix[2]
      x = x ^ (x >> np.uint32(16))
      x = x * mix[3]
      x = x ^ (x >> np.uint32(15))
    return int(np.argmax(x >> np.uint32(8)))

  def propose(tokens, k: int) -> tuple:
    rng = np.random.default_rng((seed, len(tokens), int(tokens[0])))
    out, tok, pos = [], int(tokens[-1]), len(tokens) - 1
    for _ in range(k):
      nxt = greedy_next(tok, pos)
      if rng.random() >= alpha:
        out.append((nxt + 1) % vocab)   # a wrong draft: verification rejects it
        break
      out.append(nxt)
      tok, pos = nxt, pos + 1
    return tuple(out)
  return propose


def run(f: Config) -> Dict:
  setting = paper_scale.setting(f.model, f.gpu)
  bs = paper_scale.BLOCK_SIZE
  budget = setting.kv_budget_tokens(bs)
  max_len = setting.max_len
  base = sweep.rate_stream(f.workload, 1.0, None, f.seed, max_len, f.num_requests,
                           setting.scale)
  sizes = sweep.system_sizes("paged", base, kv_budget_tokens=budget, block_size=bs,
                             max_len=max_len, max_seqs_cap=paper_scale.MAX_NUM_SEQS)

  made = []   # the last point's engine, for its speculation counters

  def engine_fn(spec):
    def make(**kw):
      made[:] = [setting.make_engine(**kw, speculative_config=spec)]
      return made[0]
    return make

  def point(spec, rate: float) -> Dict:
    return rate_search.serve_point(
        "paged", rate, f.num_requests, workload=f.workload, seed=f.seed, max_len=max_len,
        scale=setting.scale, kv_budget_tokens=budget, block_size=bs, sizes=sizes,
        clock=setting.clock(bs), preemption_mode="recompute", engine_fn=engine_fn(spec))

  norm = lambda p: p["summary"]["normalized_latency_s_per_token"]
  probe = rate_search.probe_rate(point(None, float("inf")))
  unloaded = norm(point(None, probe * rate_search.UNLOADED_FRACTION))
  slo = latency.slo_from_unloaded([unloaded], f.slo_factor)
  configs_run: List[Tuple[int, float]] = [(0, 1.0)] + [(k, a) for k in f.ks for a in f.alphas]
  rows, off_rate = [], None
  for k, alpha in common.progress(configs_run, total=len(configs_run)):
    spec = None if k == 0 else speculative.SpeculativeConfig(
        method="ngram", num_speculative_tokens=k,
        proposer=standin_proposer(paper_scale.VOCAB_SIZE, alpha, f.seed))
    runs: Dict[float, Dict] = {}

    def measure(rate: float, spec=spec, runs=runs) -> float:
      runs[rate] = point(spec, rate)
      return norm(runs[rate])

    start = off_rate or rate_search.PROBE_FACTOR * probe
    curve = rate_search.bracket_and_bisect(measure, start, slo, rel_tol=0.05,
                                           max_points=f.max_points)
    found = latency.max_rate_at_slo([r for r, _ in curve], [v for _, v in curve], slo)
    best = found["interpolated"] or found["swept"]
    if k == 0:
      off_rate = best
    fixed = point(spec, f.fixed_rate_fraction * off_rate)
    m = made[0].metrics()
    rows.append(dict(k=k, alpha=alpha if k else None, max_rate=best, found=found,
                     censored=found["interpolated"] is None,
                     vs_off=best / off_rate if off_rate else None,
                     curve=[(r, v) for r, v in curve],
                     tpot_p50_s=fixed["summary"]["tpot_p50_s"],
                     tpot_p99_s=fixed["summary"]["tpot_p99_s"],
                     fixed_rate=f.fixed_rate_fraction * off_rate,
                     acceptance=(m.get("spec_accepted_tokens", 0) / m["spec_draft_tokens"]
                                 if m.get("spec_draft_tokens") else None),
                     preemptions=fixed.get("preemptions")))
  return {"setting": setting.as_dict(), "slo_s_per_token": slo,
          "unloaded_s_per_token": unloaded, "probe_req_s": probe, "rows": rows}


def summary_rows(result: Dict):
  ms = lambda s: None if s is None else 1000 * s
  rate = lambda r: f">= {r['max_rate']:.3g}" if r.get("censored") else r["max_rate"]
  return [("off" if r["k"] == 0 else r["k"], "-" if r["alpha"] is None else r["alpha"],
           rate(r), r["vs_off"], ms(r["tpot_p50_s"]), ms(r["tpot_p99_s"]),
           "-" if r["acceptance"] is None else r["acceptance"], r["preemptions"])
          for r in result["rows"]]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "speculative_scale.json", summary_rows(result), HEADERS)


if __name__ == "__main__":
  common.run_app(main, Config)
