r"""Decode step cost against live work, side by side in one process (issue 12's first target).

    python -m experiments.step_cost --max_seqs=4,128 --live=1,2,4,8,16,32,64 \
        --out=experiments/results/step_cost

Two readings on the shipped tiny model, greedy, block size 16:
  padding   one live sequence decoding on engines with each `--max_seqs` (the row
            capacity vLLM would capture up to 256 of): with shape buckets a step costs
            what is live, so the ratio (largest / smallest max_seqs) should be near 1;
  per row   `live` sequences decoding together on the engine with the largest
            max_seqs: how a step's time grows with its live rows on this machine.
            On a GPU in the memory-bound regime it barely grows (the serving sweep's
            step clock); on this CPU it grows about linearly, which is what makes the
            wall-clock serving runs differ from the step-clock ones.
  width     the per-row reading's largest `live` again, on an engine that runs every step
            at the widest block table (`EngineOptions.width_buckets=False`): the
            sequences' own width bucket is the smallest, so the ratio (width / per row)
            is what the width buckets save a step. The CPU kernels visit keys up to each
            sequence's length, so it should be near 1 there, and the engine keeps one
            width on CPU (`buckets.attention_reads_width`).

A decode step's time is measured by difference, so prefill and warm-up drop out: per
configuration, generate `--short` then `--long` tokens per sequence (same prompts,
compiled beforehand) and divide the difference of wall seconds (and of the engine's
device seconds: the jitted call until its outputs are on the host) by the difference
of decode steps. Configurations alternate `--repeats` times; medians.
Writes OUT/step_cost.json and prints a table.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Dict, Optional, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import engines
from paged_jax.bench import step_costs


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.step_cost."""
  max_seqs: Tuple[int, ...] = configs.flag((4, 128), "engine row capacities (one live sequence "
                                           "each)", lower=1)
  live: Tuple[int, ...] = configs.flag((1, 2, 4, 8, 16, 32, 64), "live sequences on the largest "
                                       "max_seqs engine", lower=1)
  short: int = configs.flag(8, "tokens of the short run", lower=2)
  long: int = configs.flag(40, "tokens of the long run", lower=3, upper=200)
  repeats: int = configs.flag(5, "interleaved repetitions (medians)", lower=1)
  seed: int = configs.flag(0, "prompt seed")
  out: str = configs.flag("results/step_cost", "output directory")

  def check(self) -> None:
    for name in ("max_seqs", "live"):
      if not getattr(self, name):
        raise ValueError(f"--{name} must list at least one value")
    if self.long <= self.short:
      raise ValueError(f"--long must be > --short={self.short}, got {self.long}")
    if max(self.live) > max(self.max_seqs):
      raise ValueError(f"--live must be <= the largest --max_seqs ({max(self.max_seqs)}), "
                       f"got {max(self.live)}")


def run(f: Optional[Config] = None) -> Dict:
  """Decode seconds per step per configuration (see module doc) for settings `f`."""
  f = f or Config()
  max_seqs, live, short, long, repeats, seed = (f.max_seqs, f.live, f.short, f.long, f.repeats,
                                                f.seed)
  biggest = max(max_seqs)
  budget = 16 * -(-(biggest * (16 + long)) // 16)        # every live sequence fits
  make = lambda ms, **kw: engines.make_engine(block_size=16, kv_budget_tokens=max(budget, 256),
                                              max_seqs=ms, **kw)
  pool = {("buckets", ms): make(ms, width_buckets=True) for ms in sorted(set(max_seqs))}
  pool[("one_width", biggest)] = make(biggest, width_buckets=False)
  readings = [("padding", ms, 1) for ms in sorted(set(max_seqs))]
  readings += [("per_row", biggest, n) for n in sorted(set(live)) if n > 1]
  readings += [("width", biggest, max(live))]
  engine_of = lambda kind, ms: pool[("one_width" if kind == "width" else "buckets", ms)]
  for kind, ms, n in readings:          # compile every shape the timed runs use
    step_costs.decode_step_seconds(engine_of(kind, ms), n, short, long, seed)
  samples = {c: [] for c in readings}
  for _ in range(repeats):              # interleaved: load hits every config alike
    for c in readings:
      samples[c].append(step_costs.decode_step_seconds(engine_of(c[0], c[1]), c[2], short,
                                                       long, seed))
  rows = []
  for (kind, ms, n), xs in samples.items():
    rows.append({"reading": kind, "max_seqs": ms, "live": n,
                 "step_ms": 1e3 * statistics.median(x["step_s"] for x in xs),
                 "device_ms": 1e3 * statistics.median(x["device_s"] for x in xs),
                 "decode_steps": xs[0]["steps"]})
  pad = [r for r in rows if r["reading"] == "padding"]
  result = {"rows": rows,
            "padding_ratio": pad[-1]["step_ms"] / pad[0]["step_ms"],
            "padding_target": "<= 1.5 (one live sequence, largest max_seqs over smallest)"}
  one = next(r for r in pad if r["max_seqs"] == biggest)
  per_row = [r for r in rows if r["reading"] == "per_row"]
  if per_row:
    top = per_row[-1]
    result["ms_per_extra_row"] = (top["step_ms"] - one["step_ms"]) / (top["live"] - 1)
  wide = next(r for r in rows if r["reading"] == "width")
  same = next((r for r in rows if r["reading"] in ("per_row", "padding")
               and r["max_seqs"] == biggest and r["live"] == wide["live"]), None)
  if same is not None:
    result["width_ratio"] = wide["step_ms"] / same["step_ms"]
  return result


HEADERS = ["reading", "max_seqs", "live rows", "decode step ms", "device ms"]


def summary_rows(result: Dict):
  return [[r["reading"], r["max_seqs"], r["live"], r["step_ms"], r["device_ms"]]
          for r in result["rows"]]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  t0 = time.perf_counter()
  result = run(f)
  result["seconds"] = time.perf_counter() - t0
  result.update(provenance.run_metadata(f))
  print(common.table(summary_rows(result), HEADERS))
  print(f"one live sequence, max_seqs {result['rows'][0]['max_seqs']} -> "
        f"{max(f.max_seqs)}: {result['padding_ratio']:.2f}x "
        f"(target <= 1.5x)")
  if "width_ratio" in result:
    print(f"every step at the widest block table / width buckets: {result['width_ratio']:.2f}x")
  if "ms_per_extra_row" in result:
    print(f"each extra live row adds {result['ms_per_extra_row']:.3f} ms to a decode step")
  if out is not None:
    print(f"wrote {common.write_json(out / 'step_cost.json', result)}")


if __name__ == "__main__":
  common.run_app(main, Config)
