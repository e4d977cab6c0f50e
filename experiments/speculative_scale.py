r"""Speculative decoding at paper scale on the device-time model: max rate at the SLO and TPOT
against k and the acceptance rate (issue 39, point 5's paper-scale part).

    python -m experiments.speculative_scale --out=experiments/results/speculative_scale

OPT-13B on one A100-40GB (the paper's Table 1 deployment, its KV budget), ShareGPT-like
Poisson streams, the real engine with the stand-in forward on virtual time
(`paged_jax.bench.paper_scale`), as Fig. 12 runs it. The proposer is a stand-in too: it
knows the stand-in model's greedy continuation (`standin_proposer`) and proposes each
draft token right with probability `alpha`, stopping at the first wrong one it proposes
(so position i of a draft is accepted with probability alpha**(i+1): the per-token
acceptance rate alpha, swept); with `--full_drafts` the draft goes on to k tokens after
it (wrong, as prompt lookup or a draft model proposes k whatever comes after). A draft
costs what a real one of its length costs: its tokens verified in the step (the
device-time model prices the row as a chunk of 1 + drafts tokens at its context), a
lookahead slot each reserved in the KV pool for the step (fewer requests fit), the
rejected ones rolled back.

Where KV memory binds: `--kv_fraction` < 1 gives the pool that share of the deployment's
budget (and the stream's slots, `sweep.system_sizes`, shrink with it), and
`--fixed_rate_fraction` near 1 loads it; `kv_rows` then shows each (k, alpha)'s
saturation throughput (every request at t = 0: the pool full) with its batch and
preemptions, the same at the highest rate tried within the SLO, and the share of decode
rows that drafted, which the back-off (`speculative.STEP_MIN_GAIN`, per sequence
and engine-wide; not a config key) thins out. The fixed-rate point also counts what a
'keep' rule for rejected blocks would change (`speculative_tally.instrument`).

The SLO is `--slo_factor` x the unloaded normalized latency without speculation, the same
for every configuration. For each (k, alpha): the max rate at the SLO found by bracketing
and bisection (`rate_search.bracket_and_bisect`; "interpolated" between the last rates
under and over it; censored, ">= X", when no rate tried missed the SLO: a stream of
`--num_requests` drains in bounded time, so a configuration fast enough never crosses),
and TPOT p50 / p99 at `--fixed_rate_fraction` x speculation-off's max rate (a moderately
loaded server). `--nosearch` skips the searches (a point each costs minutes of CPU):
saturation throughput and TPOT at `--fixed_rate_fraction` x off's saturation rate. Where lookahead's KV and compute cost outweighs its
gain shows as a max rate below speculation off's. Writes OUT/speculative_scale.json.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import numpy as np

from experiments import common
from experiments import configs
from experiments import speculative_tally
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
  kv_fraction: float = configs.flag(1.0, "KV budget: this x the deployment's (Table 1's); "
                                    "< 1 makes KV memory bind", lower=0.01, upper=1.0)
  full_drafts: bool = configs.flag(False, "every draft is k tokens (the ones after its first "
                                   "wrong token wrong too, as prompt lookup or a draft "
                                   "model proposes k); off: it ends at its first wrong token")
  search: bool = configs.flag(True, "search each configuration's max rate at the SLO "
                              "(off: saturation throughput and the fixed-rate point only, "
                              "TPOT at --fixed_rate_fraction x off's saturation rate)")
  seed: int = configs.flag(0, "stream seed", lower=0)
  out: str = configs.flag("results/speculative_scale", "output directory")


def standin_proposer(vocab: int, alpha: float, seed: int, full: bool = False):
  """(tokens, k) -> drafts: the stand-in model's greedy continuation (`standin.apply`'s
  hash, in numpy), each token kept with probability `alpha` (a seeded draw per sequence
  length), the draft ending after the first token replaced by a wrong one (`full`: padded
  to k tokens with that wrong token: verification rejects them all the same)."""
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
        out.extend([(nxt + 1) % vocab] * (k - len(out) if full else 1))   # rejected
        break
      out.append(nxt)
      tok, pos = nxt, pos + 1
    return tuple(out)
  return propose


class Setup:
  """Flags `f`'s deployment: its KV budget (x `kv_fraction`), the stream's sizes and the
  model clock; `point` serves one stream on a fresh engine."""

  def __init__(self, f: Config):
    self.f = f
    self.setting = setting = paper_scale.setting(f.model, f.gpu)
    bs = paper_scale.BLOCK_SIZE
    full = setting.kv_budget_tokens(bs)
    self.budget = bs * int(full * f.kv_fraction // bs)
    if self.budget < setting.max_len:
      raise ValueError(f"--kv_fraction={f.kv_fraction} leaves {self.budget} KV tokens, under "
                       f"one request's {setting.max_len}; allowed: [{setting.max_len / full:.3f}"
                       ", 1]")
    base = sweep.rate_stream(f.workload, 1.0, None, f.seed, setting.max_len, f.num_requests,
                             setting.scale)
    self.sizes = sweep.system_sizes("paged", base, kv_budget_tokens=self.budget, block_size=bs,
                                    max_len=setting.max_len,
                                    max_seqs_cap=paper_scale.MAX_NUM_SEQS)
    self.made = []   # the last point's engine, for its speculation counters

  def spec(self, k: int, alpha: float):
    """The SpeculativeConfig of (k, alpha) (None for k = 0: speculation off)."""
    return None if k == 0 else speculative.SpeculativeConfig(
        method="ngram", num_speculative_tokens=k,
        proposer=standin_proposer(paper_scale.VOCAB_SIZE, alpha, self.f.seed,
                                  full=self.f.full_drafts))

  def point(self, k: int, alpha: float, rate: float, on_engine=None) -> Dict:
    """`rate_search.serve_point` of (k, alpha) at `rate` req/s; `on_engine(engine)` is
    called on the fresh engine before it serves."""
    spec, s = self.spec(k, alpha), self.setting

    def make(**kw):
      self.made[:] = [s.make_engine(**kw, speculative_config=spec)]
      if on_engine is not None:
        on_engine(self.made[0])
      return self.made[0]
    bs = paper_scale.BLOCK_SIZE
    self.clock = s.clock(bs)   # the point's model clock (device_s, num_steps after it)
    return rate_search.serve_point(
        "paged", rate, self.f.num_requests, workload=self.f.workload, seed=self.f.seed,
        max_len=s.max_len, scale=s.scale, kv_budget_tokens=self.budget, block_size=bs,
        sizes=self.sizes, clock=self.clock, preemption_mode="recompute", engine_fn=make)


def _load(point: Dict) -> Dict:
  """A point's batch and preemptions: mean / max running requests, preemptions, steps."""
  return dict(preemptions=point["preemptions"], mean_running=point["mean_running"],
              max_running=point["max_running"], steps=point["steps"])


def run(f: Config) -> Dict:
  setup = Setup(f)
  norm = lambda p: p["summary"]["normalized_latency_s_per_token"]
  probe_point = setup.point(0, 1.0, float("inf"))
  probe = rate_search.probe_rate(probe_point)
  unloaded = norm(setup.point(0, 1.0, probe * rate_search.UNLOADED_FRACTION))
  slo = latency.slo_from_unloaded([unloaded], f.slo_factor)
  configs_run: List[Tuple[int, float]] = [(0, 1.0)] + [(k, a) for k in f.ks for a in f.alphas]
  rows, off_rate, off_sat = [], None, probe
  for k, alpha in common.progress(configs_run, total=len(configs_run)):
    # Saturation: every request at t = 0, the pool full (where KV memory binds most).
    sat = probe_point if k == 0 else setup.point(k, alpha, float("inf"))
    row = dict(k=k, alpha=alpha if k else None, saturation_req_s=rate_search.probe_rate(sat),
               saturation=_load(sat), max_rate=None, found=None, censored=None, vs_off=None,
               curve=[], curve_load=[], at_slo=None)
    row["saturation_vs_off"] = row["saturation_req_s"] / off_sat
    if f.search:
      runs: Dict[float, Dict] = {}

      def measure(rate: float, k=k, alpha=alpha, runs=runs) -> float:
        runs[rate] = setup.point(k, alpha, rate)
        return norm(runs[rate])

      start = off_rate or rate_search.PROBE_FACTOR * probe
      curve = rate_search.bracket_and_bisect(measure, start, slo, rel_tol=0.05,
                                             max_points=f.max_points)
      found = latency.max_rate_at_slo([r for r, _ in curve], [v for _, v in curve], slo)
      best = found["interpolated"] or found["swept"]
      if k == 0:
        off_rate = best
      under = [r for r, v in curve if v <= slo]
      row.update(max_rate=best, found=found, censored=found["interpolated"] is None,
                 vs_off=best / off_rate, curve=[(r, v) for r, v in curve],
                 curve_load=[dict(rate=r, **_load(runs[r])) for r, _ in curve],
                 # the highest rate tried within the SLO
                 at_slo=dict(rate=max(under), **_load(runs[max(under)])) if under else None)
    tallies = []
    fixed_rate = f.fixed_rate_fraction * (off_rate if f.search else off_sat)
    fixed = setup.point(k, alpha, fixed_rate,
                        on_engine=lambda e, t=tallies: t.append(speculative_tally.instrument(e)))
    m = setup.made[0].metrics()
    row.update(tpot_p50_s=fixed["summary"]["tpot_p50_s"],
               tpot_p99_s=fixed["summary"]["tpot_p99_s"], fixed_rate=fixed_rate,
               acceptance=(m.get("spec_accepted_tokens", 0) / m["spec_draft_tokens"]
                           if m.get("spec_draft_tokens") else None),
               blocks=dict(dataclasses.asdict(tallies[-1]), **tallies[-1].summary()),
               **_load(fixed))
    rows.append(row)
  return {"setting": setup.setting.as_dict(), "kv_budget_tokens": setup.budget,
          "max_seqs": setup.sizes["max_seqs"], "slo_s_per_token": slo,
          "unloaded_s_per_token": unloaded, "probe_req_s": probe, "rows": rows}


def summary_rows(result: Dict):
  ms = lambda s: None if s is None else 1000 * s
  rate = lambda r: f">= {r['max_rate']:.3g}" if r.get("censored") else r["max_rate"]
  return [("off" if r["k"] == 0 else r["k"], "-" if r["alpha"] is None else r["alpha"],
           rate(r), r["vs_off"], ms(r["tpot_p50_s"]), ms(r["tpot_p99_s"]),
           "-" if r["acceptance"] is None else r["acceptance"], r["preemptions"])
          for r in result["rows"]]


KV_HEADERS = ("k", "alpha", "acceptance", "drafting rows / decode rows",
              "saturation (req/s)", "saturation vs off", "mean batch", "preemptions",
              "max rate at SLO (req/s)", "max rate vs off", "mean batch at max rate",
              "preemptions at max rate", "TPOT p50 (ms)", "TPOT p50 rate (req/s)")


def kv_rows(result: Dict):
  """A sweep where KV memory binds: each (k, alpha)'s saturation throughput (every
  request at t = 0) with its batch (mean running requests) and preemptions, the max rate
  at the SLO with the batch and preemptions at the highest rate tried within it ("-":
  not searched, --nosearch), TPOT p50 at the fixed rate, and the share of decode rows
  that drafted (the back-off thins it)."""
  ms = lambda s: None if s is None else 1000 * s
  dash = lambda x: "-" if x is None else x
  rate = lambda r: (f">= {r['max_rate']:.3g}" if r.get("censored") else dash(r["max_rate"]))
  at = lambda r, key: "-" if r.get("at_slo") is None else r["at_slo"][key]
  return [("off" if r["k"] == 0 else r["k"], dash(r["alpha"]), dash(r["acceptance"]),
           r["blocks"]["drafting_share"] if r["k"] else "-", r["saturation_req_s"],
           r["saturation_vs_off"], r["saturation"]["mean_running"],
           r["saturation"]["preemptions"], rate(r), dash(r["vs_off"]), at(r, "mean_running"),
           at(r, "preemptions"), ms(r["tpot_p50_s"]), r["fixed_rate"])
          for r in result["rows"]]


KV_RUNS_HEADERS = ("run", "KV budget", "seed") + KV_HEADERS


def kv_runs_rows(doc: Dict):
  """`kv_rows` of several runs, {"runs": [(name, result), ...]}, each row led by the
  run's name, its share of the KV budget (--kv_fraction) and its stream seed."""
  return [(name, d["flags"]["kv_fraction"], d["flags"]["seed"]) + tuple(row)
          for name, d in doc["runs"] for row in kv_rows(d)]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "speculative_scale.json", kv_rows(result), KV_HEADERS)


if __name__ == "__main__":
  common.run_app(main, Config)
