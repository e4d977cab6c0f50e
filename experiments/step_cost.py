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

A decode step's time is measured by difference, so prefill and warm-up drop out: per
configuration, generate `--short` then `--long` tokens per sequence (same prompts,
compiled beforehand) and divide the difference of wall seconds (and of the engine's
device seconds: the jitted call until its outputs are on the host) by the difference
of decode steps. Configurations alternate `--repeats` times; medians.
Writes OUT/step_cost.json and prints a table.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, Sequence

import numpy as np

from experiments import common
from paged_jax.bench import engines
from paged_jax.config import check_int


def _decode_step_s(engine, num_live: int, short: int, long: int, seed: int) -> Dict[str, float]:
  """Seconds per decode step with `num_live` sequences: (long run - short run) / steps."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, 256, 16).tolist() for _ in range(num_live)]
  out = {}
  for n in (short, long):
    engine.timing.clear()
    steps0 = engine.stats["steps"]
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))
    out[n] = (time.perf_counter() - t0, engine.timing["device_s"], engine.stats["steps"] - steps0)
  steps = out[long][2] - out[short][2]
  return {"step_s": (out[long][0] - out[short][0]) / steps,
          "device_s": (out[long][1] - out[short][1]) / steps, "steps": steps}


def run(max_seqs: Sequence[int] = (4, 128), live: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), *,
        short: int = 8, long: int = 40, repeats: int = 5, seed: int = 0) -> Dict:
  """Decode seconds per step per configuration (see module doc)."""
  for name, vals, lo in (("max_seqs", max_seqs, 1), ("live", live, 1)):
    if not vals:
      raise ValueError(f"{name} must list at least one value")
    for v in vals:
      check_int(name, v, lo)
  check_int("short", short, 2)
  check_int("long", long, short + 1, 200)
  check_int("repeats", repeats, 1)
  biggest = max(max_seqs)
  if max(live) > biggest:
    raise ValueError(f"live must be <= the largest max_seqs ({biggest}), got {max(live)}")
  budget = 16 * -(-(biggest * (16 + long)) // 16)        # every live sequence fits
  engines = {ms: engines.make_engine(block_size=16, kv_budget_tokens=max(budget, 256),
                                     max_seqs=ms) for ms in sorted(set(max_seqs))}
  configs = [("padding", ms, 1) for ms in sorted(engines)]
  configs += [("per_row", biggest, n) for n in sorted(set(live)) if n > 1]
  for _, ms, n in configs:              # compile every shape the timed runs use
    _decode_step_s(engines[ms], n, short, long, seed)
  samples = {c: [] for c in configs}
  for _ in range(repeats):              # interleaved: load hits every config alike
    for c in configs:
      samples[c].append(_decode_step_s(engines[c[1]], c[2], short, long, seed))
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
  return result


HEADERS = ["reading", "max_seqs", "live rows", "decode step ms", "device ms"]


def summary_rows(result: Dict):
  return [[r["reading"], r["max_seqs"], r["live"], r["step_ms"], r["device_ms"]]
          for r in result["rows"]]


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_list("max_seqs", ["4", "128"], "engine row capacities (one live sequence each)")
  flags.DEFINE_list("live", ["1", "2", "4", "8", "16", "32", "64"],
                    "live sequences on the largest max_seqs engine")
  flags.DEFINE_integer("short", 8, "tokens of the short run")
  flags.DEFINE_integer("long", 40, "tokens of the long run")
  flags.DEFINE_integer("repeats", 5, "interleaved repetitions (medians)")
  flags.DEFINE_integer("seed", 0, "prompt seed")
  flags.DEFINE_string("out", "results/step_cost", "output directory")


def main(f, out):
  """Runs with the parsed flags `f` into directory `out` (the `common.run_app` main)."""
  t0 = time.perf_counter()
  result = run([int(x) for x in f["max_seqs"].value], [int(x) for x in f["live"].value],
               short=f["short"].value, long=f["long"].value, repeats=f["repeats"].value,
               seed=f["seed"].value)
  result["seconds"] = time.perf_counter() - t0
  result.update(common.run_metadata(f))
  print(common.table(summary_rows(result), HEADERS))
  print(f"one live sequence, max_seqs {result['rows'][0]['max_seqs']} -> "
        f"{max(int(x) for x in f['max_seqs'].value)}: {result['padding_ratio']:.2f}x "
        f"(target <= 1.5x)")
  if "ms_per_extra_row" in result:
    print(f"each extra live row adds {result['ms_per_extra_row']:.3f} ms to a decode step")
  if out is not None:
    print(f"wrote {common.write_json(out / 'step_cost.json', result)}")


if __name__ == "__main__":
  common.run_app(main, _define_flags)
