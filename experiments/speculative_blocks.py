r"""Speculative decoding's rejected lookahead blocks: free them at rollback (what the engine
does) or keep them reserved for the slot's next step? Counted exactly (issue 39, point 1).

    python -m experiments.speculative_blocks --out=experiments/results/speculative_blocks

A drafting row reserves KV slots for its 1 + k tokens; `speculative.rollback` then frees
the blocks past the accepted length in the same jitted step. A 'keep' rule would leave
them in the slot's table until the sequence grows into them (or ends, or is preempted):
it saves the pops that grow into them, and holds blocks that 'free' returns to the pool.
`instrument(engine)` counts both, per step, on the host from the plan each step ran
(`Chunk.start`, `.end`, `.draft`) and the committed lengths after it (`num_computed`);
the engine's own count of used blocks (`metrics()`: num_blocks - num_free_blocks) must
equal the 'free' rule's holdings after every step ("mismatched_steps" counts the steps
where it did not: 0 means the host model is the engine's allocator, block for block).
It is a first-order counterfactual: the same trajectory, with what 'keep' would hold.

Two runs: the CPU engine (the shipped byte model, prompt lookup, the repetitive workload
of experiments.speculative, greedy) and paper scale (OPT-13B / A100-40GB on the device-time
model with the stand-in proposer of per-token acceptance alpha, full k-token drafts, one
Poisson stream at `--paper_rate` req/s: experiments.speculative_scale's setting). For
the paper run the counts are put in the device-time model's terms: a saved pop is
allocator work the model prices at 0 (a few int32 reads and writes in the step: at its
elementwise bandwidth, `POP_BYTES` bytes take picoseconds), and the blocks 'keep' holds
are rows the pool cannot hold (held blocks / mean blocks per running sequence).
Writes OUT/speculative_blocks.json.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from experiments import common
from experiments import configs
from experiments.speculative_tally import instrument

HEADERS = ("run", "k", "alpha", "drafting rows / decode rows", "blocks freed by rollback "
           "/ step", "pops 'keep' saves / step (next step)", "extra blocks 'keep' holds / step",
           "rows 'keep' costs (% of batch)", "pop time 'keep' saves (model s / step)",
           "rows' time 'keep' costs where KV binds (model s / step)", "mismatched steps")
POP_BYTES = 12   # assumption: a pop reads the stack top, writes a table entry and a refcount


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.speculative_blocks."""
  ks: Tuple[int, ...] = configs.flag((2, 4, 8), "num_speculative_tokens values", lower=1,
                                     upper=16)
  cpu_requests: int = configs.flag(16, "CPU run: requests (repetitive workload)", lower=1)
  cpu_gen: int = configs.flag(128, "CPU run: greedy tokens per request", lower=1)
  alphas: Tuple[float, ...] = configs.flag((0.6, 0.9), "paper run: per-token acceptance",
                                           lower=0.0, upper=1.0)
  paper_rate: float = configs.flag(2.5, "paper run: arrival rate (req/s)", lower=0.01)
  num_requests: int = configs.flag(200, "paper run: requests", lower=10)
  kv_fraction: float = configs.flag(1.0, "paper run: this x the deployment's KV budget",
                                    lower=0.01, upper=1.0)
  seed: int = configs.flag(0, "workload / stream seed", lower=0)
  out: str = configs.flag("results/speculative_blocks", "output directory")


def cpu_run(f: Config, k: int) -> Dict:
  """The shipped model serving experiments.speculative's repetitive prompts, counted."""
  from experiments import speculative as spec_cpu  # pylint: disable=g-import-not-at-top
  from paged_jax import models  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  cf = spec_cpu.Config(ks=(k,), requests=f.cpu_requests, gen=f.cpu_gen, seed=f.seed)
  engine = spec_cpu._engine(cf, models.load_hf_checkpoint(models.DEFAULT_CHECKPOINT), k)  # pylint: disable=protected-access
  tally = instrument(engine)
  sp = SamplingParams(max_tokens=f.cpu_gen, temperature=0.0)
  for prompt in spec_cpu.workload(cf, "repetitive"):
    engine.add_request(prompt, sp)
  while engine.has_unfinished():   # step() is what `instrument` counts
    engine.step()
  m = engine.metrics()
  return dict(run="cpu", k=k, alpha=None, tally=dataclasses.asdict(tally),
              **tally.summary(), acceptance=m["spec_accepted_tokens"] / max(1, m["spec_draft_tokens"]))


def paper_run(f: Config, k: int, alpha: float) -> Dict:
  """One paper-scale point (experiments.speculative_scale's setting), counted."""
  from experiments import speculative_scale  # pylint: disable=g-import-not-at-top
  sf = speculative_scale.Config(num_requests=f.num_requests, seed=f.seed, full_drafts=True,
                                kv_fraction=f.kv_fraction)
  tallies, setup = [], speculative_scale.Setup(sf)
  p = setup.point(k, alpha, f.paper_rate, on_engine=lambda e: tallies.append(instrument(e)))
  tally = tallies[-1]
  s = tally.summary()
  model = setup.setting.as_dict()
  bw = model["gpu"]["hbm_bandwidth"] * model["efficiency"]["elementwise_bandwidth"]["value"]
  step_s = setup.clock.device_s / max(1, setup.clock.num_steps)   # model s a device step
  return dict(run="paper", k=k, alpha=alpha, tally=dataclasses.asdict(tally), **s,
              rate=f.paper_rate, preemptions=p["preemptions"], model_step_s=step_s,
              pop_s=POP_BYTES / bw, saved_pop_s_per_step=s["saved_pops_per_step"] * POP_BYTES / bw,
              # 'keep' holds rows_lost rows a step: the same share of the batch's tokens
              kept_cost_s_per_step=s["rows_lost_share"] * step_s)


def run(f: Config) -> Dict:
  rows = [cpu_run(f, k) for k in common.progress(f.ks, total=len(f.ks))]
  todo = [(k, a) for k in f.ks for a in f.alphas]
  rows += [paper_run(f, k, a) for k, a in common.progress(todo, total=len(todo))]
  return {"rows": rows, "pop_bytes": POP_BYTES}


def summary_rows(result: Dict):
  sci = lambda x: "-" if x is None else f"{x:.2g}"
  return [(r["run"], r["k"], "-" if r["alpha"] is None else r["alpha"], r["drafting_share"],
           r["freed_per_step"], f"{r['saved_pops_per_step']:.3f} ({r['saved_next_per_step']:.3f})",
           r["kept_blocks_per_step"], f"{r['rows_lost']:.3f} ({100 * r['rows_lost_share']:.2f}%)",
           sci(r.get("saved_pop_s_per_step")), sci(r.get("kept_cost_s_per_step")),
           r["tally"]["mismatched_steps"]) for r in result["rows"]]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "speculative_blocks.json", summary_rows(result), HEADERS)


if __name__ == "__main__":
  common.run_app(main, Config)
