r"""What prefix caching costs when every lookup misses (issue 26 pt 3), step by step.

    python -m experiments.prefix_miss --num_requests=32 --rounds=15 \
        --out=experiments/results/prefix_miss

The stream: `num_requests` prompts of `min_prompt`..`max_prompt` random tokens, `max_tokens`
greedy tokens each, all arriving at once, the shipped tiny model. Every prompt opens with
two tokens no other prompt of the run has (its index in the run), so no block of one
prompt equals a block of another, and the pool (`kv_budget_tokens`) holds every request
at once, so nothing is preempted and recomputed (a recomputed request would hit its own
blocks): the hit rate is 0, checked each round (RuntimeError otherwise). The caching
engine's cache fills over the rounds, so later rounds also pay its LRU evictions, as a
long-running server of a miss-only stream would.

Method: two engines, caching off and on, same budget; an untimed warm-up round compiles
the step shapes; then `rounds` rounds of fresh prompts (same lengths, so the same
schedule each round). In a round both engines get the requests and then step in
turns, one step of one engine then one of the other (who goes first alternates), until
both are done; outputs must be identical. Each `Engine.step` is timed in wall seconds
and in CPU seconds of this process (`time.process_time`: every thread, so the
jitted step's XLA threads too; a busy shared machine stretches wall time far more than
CPU time). Step k of a round does the same work in every round, so each engine's cost
of step k is the median over rounds of its time at step k; an engine's round cost is
the sum of those over its steps (an extra step caching takes counts in full). Reported:
on / off of that sum, in CPU and in wall seconds, and the steps of each. Target: CPU
on / off <= 1.03 (caching costs <= 3% on a miss).
Writes OUT/prefix_miss.json and prints a table (one row per clock).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Dict, List, Optional

import numpy as np

from experiments import common
from experiments import configs
from paged_jax.bench import prefix_serving

TARGET = 1.03   # step cost with caching on over off, every lookup a miss


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.prefix_miss."""
  num_requests: int = configs.flag(32, "requests per round", lower=1, upper=4096)
  min_prompt: int = configs.flag(40, "shortest prompt (tokens)", lower=2)
  max_prompt: int = configs.flag(200, "longest prompt (tokens)", lower=2, upper=900)
  max_tokens: int = configs.flag(32, "generated tokens per request", lower=1, upper=120)
  kv_budget_tokens: int = configs.flag(8192, "KV pool in token slots (holds every request: "
                                       "no preemption, so no self-hit)", lower=1024)
  block_size: int = configs.flag(16, "tokens per KV block", lower=1)
  max_seqs: int = configs.flag(64, "sequence slots", lower=1)
  max_num_batched_tokens: int = configs.flag(256, "tokens per step", lower=1)
  rounds: int = configs.flag(15, "timed rounds (per-step medians over them)", lower=1,
                             upper=60)
  seed: int = configs.flag(0, "prompt seed")
  out: str = configs.flag("results/prefix_miss", "output directory")

  def check(self) -> None:
    if self.max_prompt < self.min_prompt:
      raise ValueError(f"--max_prompt must be >= --min_prompt={self.min_prompt}, "
                       f"got {self.max_prompt}")
    configs.check_multiple(self, "kv_budget_tokens", "block_size")
    if (self.rounds + 1) * self.num_requests > 256 * 256:
      raise ValueError(f"--rounds x --num_requests must stay under 65,536 (each prompt's "
                       f"two opening tokens are unique), got {self.rounds} x "
                       f"{self.num_requests}")


def _round(engines: Dict, prompts, params, first: str) -> Dict:
  """Both engines serve `prompts`, stepping in turns (`first` steps first).

  Returns {name: {"cpu_s": [per step], "wall_s": [...], "device_s": [...], "outputs",
  "hit_tokens", "preemptions", "generated"}}.
  """
  res = {}
  for name, e in engines.items():
    ids = [e.add_request(p, params) for p in prompts]
    res[name] = {"ids": ids, "cpu_s": [], "wall_s": [], "device_s": [], "outs": {},
                 "hits0": e.stats["prefix_hit_tokens"], "pre0": e.num_preemptions}
  order = [first] + [n for n in engines if n != first]
  while any(e.has_unfinished() for e in engines.values()):
    for name in order:
      e, r = engines[name], res[name]
      if not e.has_unfinished():
        continue
      d0 = e.timing["device_s"]
      c0, w0 = time.process_time(), time.perf_counter()
      outs = e.step()
      r["wall_s"].append(time.perf_counter() - w0)
      r["cpu_s"].append(time.process_time() - c0)
      r["device_s"].append(e.timing["device_s"] - d0)
      for o in outs:
        r["outs"][o.request_id] = o.outputs[0]
    order.reverse()          # the other engine leads the next pair of steps
  for name, e in engines.items():
    r = res[name]
    r["outputs"] = [r["outs"][i] for i in r.pop("ids")]
    r.pop("outs")
    r["generated"] = sum(len(o) for o in r["outputs"])
    r["hit_tokens"] = e.stats["prefix_hit_tokens"] - r.pop("hits0")
    r["preemptions"] = e.num_preemptions - r.pop("pre0")
  return res


def _profile(rounds: List[Dict], key: str) -> List[float]:
  """Per step k: the median over rounds of the step's `key` seconds."""
  steps = len(rounds[0][key])
  if any(len(r[key]) != steps for r in rounds):
    raise RuntimeError(f"the schedule changed between rounds: steps "
                       f"{sorted({len(r[key]) for r in rounds})}")
  return [statistics.median(r[key][k] for r in rounds) for k in range(steps)]


def run(f: Optional[Config] = None) -> Dict:
  """The measurement for settings `f` (see module doc)."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  f = f or Config()
  kw = dict(block_size=f.block_size, kv_budget_tokens=f.kv_budget_tokens, max_seqs=f.max_seqs,
            max_len=1024, budget=f.max_num_batched_tokens)
  engines = {"off": prefix_serving.caching_engine(False, **kw),
             "on": prefix_serving.caching_engine(True, **kw)}
  lengths = np.random.default_rng(f.seed).integers(f.min_prompt, f.max_prompt + 1,
                                                   f.num_requests)

  def prompts(rnd):
    """Round `rnd`'s prompts (rnd = -1: the warm-up); each opens with its unique index."""
    rng = np.random.default_rng([f.seed, rnd + 1])
    out = []
    for i, n in enumerate(lengths):
      uid = (rnd + 1) * f.num_requests + i
      out.append([uid // 256, uid % 256] + rng.integers(0, 256, int(n) - 2).tolist())
    return out

  params = SamplingParams(max_tokens=f.max_tokens, temperature=0.0)
  _round(engines, prompts(-1), params, "off")        # compiles every step shape met
  per: Dict[str, List[Dict]] = {"off": [], "on": []}
  rows = []
  for r in common.progress(range(f.rounds), desc="rounds"):
    res = _round(engines, prompts(r), params, "off" if r % 2 == 0 else "on")
    if res["on"]["outputs"] != res["off"]["outputs"]:
      raise RuntimeError(f"round {r}: outputs differ with prefix caching on and off")
    for name in per:
      if res[name]["hit_tokens"] or res[name]["preemptions"]:
        raise RuntimeError(f"round {r}: the stream is not a pure miss: {name} got "
                           f"{res[name]['hit_tokens']} hit tokens, "
                           f"{res[name]['preemptions']} preemptions")
      res[name].pop("outputs")
      per[name].append(res[name])
    rows.append({"round": r, **{f"{k}_{name}": sum(res[name][k]) for name in per
                                for k in ("cpu_s", "wall_s", "device_s")},
                 "steps_off": len(res["off"]["cpu_s"]), "steps_on": len(res["on"]["cpu_s"]),
                 "generated_tokens": res["off"]["generated"]})
  prof = {name: {k: _profile(per[name], k) for k in ("cpu_s", "wall_s", "device_s")}
          for name in per}
  total = {name: {k: sum(v) for k, v in prof[name].items()} for name in per}
  ratio = {k: total["on"][k] / total["off"][k] for k in total["on"]}
  round_ratio = [row["cpu_s_on"] / row["cpu_s_off"] for row in rows]
  return {"rounds": rows, "step_profile": prof, "round_cost": total,
          "cpu_ratio": ratio["cpu_s"], "wall_ratio": ratio["wall_s"],
          "device_ratio": ratio["device_s"],
          "steps_off": len(prof["off"]["cpu_s"]), "steps_on": len(prof["on"]["cpu_s"]),
          "round_cpu_ratio_median": statistics.median(round_ratio),
          "round_cpu_ratio_range": [min(round_ratio), max(round_ratio)],
          "hit_tokens": 0, "prompt_tokens_per_round": int(lengths.sum()),
          "target_cpu_ratio": TARGET, "meets_target": ratio["cpu_s"] <= TARGET}


HEADERS = ["clock", "off ms / round", "on ms / round", "on / off", "steps off / on",
           "rounds", "hit tokens"]
_CLOCKS = (("cpu_s", "CPU (process)"), ("wall_s", "wall"), ("device_s", "device (wall)"))


def summary_rows(result: Dict):
  """One row per clock: the per-step-median round cost of each engine and their ratio."""
  c = result["round_cost"]
  return [[label, 1e3 * c["off"][k], 1e3 * c["on"][k], c["on"][k] / c["off"][k],
           f"{result['steps_off']}/{result['steps_on']}", len(result["rounds"]),
           result["hit_tokens"]] for k, label in _CLOCKS]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  result["load_average"] = list(os.getloadavg())
  lo, hi = result["round_cpu_ratio_range"]
  common.report(result, out, "prefix_miss.json", summary_rows(result), HEADERS, [
      f"caching on / off, every lookup a miss: CPU {result['cpu_ratio']:.3f}x (target <= "
      f"{TARGET}; {'met' if result['meets_target'] else 'NOT met'}), wall "
      f"{result['wall_ratio']:.3f}x, device {result['device_ratio']:.3f}x; per-round CPU "
      f"ratios {lo:.3f}-{hi:.3f} (median {result['round_cpu_ratio_median']:.3f}); load "
      f"average {result['load_average'][0]:.1f}"])


if __name__ == "__main__":
  common.run_app(main, Config)
