r"""The prefix cache's host tier on a multi-turn workload (issue 40, points 3 and 4(a, b)):
prompt tokens computed and time to first token with device-only caching and with a host
tier of 1x and 4x the device pool, on CPU.

    python -m experiments.host_tier --out=experiments/results/host_tier

The workload (seeded, synthetic): `conversations` chats of `turns` turns. A chat opens
with a `min_first`..`max_first`-token prompt; each later turn's prompt is the whole
history: the previous prompt, the model's answer to it (`max_tokens` greedy tokens) and
`min_user`..`max_user` new user tokens. Chats start as a Poisson process
(`start_rate` per engine step); a chat's next turn arrives an exponential think time
(`think_steps` mean) after its previous answer finished, so the turns of many chats
interleave and the device pool (`device_blocks`) alone loses earlier turns before their
chat comes back. Arrivals run on the step clock, so a system serves the same schedule in
its untimed and its timed pass (every step and exchange shape compiles in the first).
Answers feed later prompts: every system must produce the same outputs
(greedy; checked), so all serve the same prompts.

Method: for each system (device-only caching: `num_host_blocks=0`; device + host tier:
`host_factors` x the device pool), the shipped tiny model, one engine, the same workload
served twice: an untimed pass (compiles every step shape met; both tiers are then
reset) and the timed pass. TTFT = the wall seconds of the `Engine.step` calls from a
request's arrival to the one that returned its first token (host-tier exchanges
included; idle time, when nothing runs before the next arrival, is skipped), and the
same in CPU seconds of this process (`time.process_time`, every thread: less stretched
than wall time when other jobs share the machine). Reported per system: prompt tokens computed (prefill, `prefill_tokens`),
prompt tokens served from the device cache and from the host tier, TTFT p50 / p99 and
mean, steps, exchange calls (the host tier's one extra call, only on steps that evict or
bring blocks back), and wall seconds; the ratios to device-only.
Writes OUT/host_tier.json (flags, versions, machine) and prints a table. Point 4(c) of
the issue (paper scale on the device-time model) is not done here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, List, Optional

import numpy as np

from experiments import common
from experiments import configs


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.host_tier."""
  conversations: int = configs.flag(16, "chats", lower=1, upper=1024)
  turns: int = configs.flag(4, "turns per chat", lower=1, upper=32)
  min_first: int = configs.flag(64, "shortest first prompt (tokens)", lower=2)
  max_first: int = configs.flag(160, "longest first prompt (tokens)", lower=2)
  min_user: int = configs.flag(16, "fewest new user tokens per later turn", lower=1)
  max_user: int = configs.flag(48, "most new user tokens per later turn", lower=1)
  max_tokens: int = configs.flag(16, "answer tokens per turn (greedy)", lower=1, upper=256)
  start_rate: float = configs.flag(0.25, "chats started per engine step (Poisson)", lower=0,
                                   lower_open=True)
  think_steps: float = configs.flag(20.0, "mean think time before a chat's next turn "
                                    "(engine steps)", lower=0)
  block_size: int = configs.flag(16, "tokens per KV block", lower=1)
  device_blocks: int = configs.flag(48, "device KV pool (blocks)", lower=1)
  host_factors: str = configs.flag("1,4", "host tier sizes, as multiples of the device pool "
                                   "(comma-separated)")
  max_seqs: int = configs.flag(8, "sequence slots", lower=1)
  max_num_batched_tokens: int = configs.flag(128, "tokens per step", lower=1)
  seed: int = configs.flag(0, "workload seed")
  out: str = configs.flag("results/host_tier", "output directory")

  def check(self) -> None:
    if self.max_first < self.min_first or self.max_user < self.min_user:
      raise ValueError("--max_first / --max_user must be >= --min_first / --min_user")
    factors = self.factors
    if not factors or any(x <= 0 for x in factors):
      raise ValueError(f"--host_factors must be positive numbers, got {self.host_factors!r}")
    longest = self.max_first + (self.turns - 1) * (self.max_tokens + self.max_user) + \
        self.max_tokens
    if -(-longest // self.block_size) > self.device_blocks:
      raise ValueError(f"--device_blocks={self.device_blocks} cannot hold the longest chat "
                       f"({longest} tokens)")

  @property
  def factors(self) -> List[float]:
    try:
      return [float(x) for x in str(self.host_factors).split(",") if x.strip()]
    except ValueError:
      raise ValueError(f"--host_factors must be comma-separated numbers, got "
                       f"{self.host_factors!r}") from None

  @property
  def max_len(self) -> int:
    return self.max_first + (self.turns - 1) * (self.max_tokens + self.max_user) + \
        self.max_tokens


def make_engine(f: Config, num_host_blocks: int):
  """The tiny model's engine with prefix caching and a host tier of `num_host_blocks`."""
  from paged_jax.bench import engines  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  mc, params = engines.tiny_model()
  cc = mc.cache_config(block_size=f.block_size, num_blocks=f.device_blocks,
                       max_seqs=f.max_seqs, max_blocks_per_seq=-(-f.max_len // f.block_size),
                       enable_prefix_caching=True, num_host_blocks=num_host_blocks)
  return Engine(mc, params, cc, max_num_batched_tokens=f.max_num_batched_tokens)


class Chats:
  """The seeded workload (`bench.multi_turn.synthetic`'s draws): first prompts, user
  turns (entry 0 unused), start times and think times, in engine steps."""

  def __init__(self, f: Config, vocab: int):
    from paged_jax.bench import multi_turn  # pylint: disable=g-import-not-at-top
    convs = multi_turn.synthetic(
        f.conversations, f.turns, first=(f.min_first, f.max_first),
        user=(f.min_user, f.max_user), output=(f.max_tokens, f.max_tokens),
        start_rate=f.start_rate, think_mean=f.think_steps, vocab=vocab, seed=f.seed)
    self.first = [c.user[0].tolist() for c in convs]
    self.user = [[[]] + [u.tolist() for u in c.user[1:]] for c in convs]
    self.start = np.array([c.start for c in convs])
    self.think = np.array([c.think for c in convs])


def serve(engine, chats: Chats, f: Config) -> Dict:
  """Serves every chat to its end (see module doc); totals and TTFTs."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  params = SamplingParams(max_tokens=f.max_tokens, temperature=0.0)
  n = f.conversations
  history = [list(p) for p in chats.first]
  turn = [0] * n
  due = list(chats.start)                       # next arrival per chat, in steps (None: done)
  live: Dict = {}                               # request id -> (chat, arrival wall clock)
  ttft, outputs = [], [[] for _ in range(n)]
  s0, h0 = dict(engine.stats), engine.metrics()["prefix_host_hit_tokens"]
  calls0, pre0 = engine.host_stats["calls"], engine.num_preemptions
  step, clock, cpu, prompt_tokens = 0, 0.0, 0.0, 0
  while any(d is not None for d in due) or engine.has_unfinished():
    for c in range(n):
      if due[c] is not None and due[c] <= step:
        rid = engine.add_request(history[c], params)
        prompt_tokens += len(history[c])
        live[rid] = (c, clock, cpu)
        due[c] = None
    if not engine.has_unfinished():             # idle: the clock jumps to the next arrival
      step = int(np.ceil(min(d for d in due if d is not None)))
      continue
    t0, c0 = time.perf_counter(), time.process_time()
    done = engine.step()
    clock += time.perf_counter() - t0
    cpu += time.process_time() - c0
    step += 1
    for rid in engine.last_step.first_token_ids:
      ttft.append((clock - live[rid][1], cpu - live[rid][2]))
    for o in done:
      c = live.pop(o.request_id)[0]
      answer = list(o.outputs[0])
      outputs[c].append(answer)
      turn[c] += 1
      if turn[c] < f.turns:
        history[c] = history[c] + answer + chats.user[c][turn[c]]
        due[c] = step + chats.think[c, turn[c]]
  d = lambda k: engine.stats[k] - s0.get(k, 0)
  wall_ttft, cpu_ttft = np.asarray(ttft).T
  return {"prompt_tokens": prompt_tokens, "prompt_tokens_computed": d("prefill_tokens"),
          "hit_tokens": d("prefix_hit_tokens"),
          "host_hit_tokens": engine.metrics()["prefix_host_hit_tokens"] - h0,
          "ttft_p50_s": float(np.percentile(wall_ttft, 50)),
          "ttft_p99_s": float(np.percentile(wall_ttft, 99)),
          "ttft_mean_s": float(wall_ttft.mean()),
          "ttft_cpu_p50_s": float(np.percentile(cpu_ttft, 50)),
          "ttft_cpu_p99_s": float(np.percentile(cpu_ttft, 99)), "cpu_s": cpu,
          "requests": int(wall_ttft.size), "steps": step,
          "exchange_calls": engine.host_stats["calls"] - calls0,
          "preemptions": engine.num_preemptions - pre0, "wall_s": clock,
          "outputs": outputs}


def run(f: Optional[Config] = None) -> Dict:
  """The measurement for settings `f` (see module doc)."""
  f = f or Config()
  systems = {"device_only": 0, **{f"host_{x:g}x": int(round(x * f.device_blocks))
                                  for x in f.factors}}
  res, ref = {}, None
  for name, host in common.progress(list(systems.items()), desc="systems"):
    engine = make_engine(f, host)
    chats = Chats(f, engine.model_config.vocab_size)
    serve(engine, chats, f)                       # untimed: compiles the shapes met
    engine.reset_prefix_cache()
    r = serve(engine, chats, f)
    outs = r.pop("outputs")
    if ref is None:
      ref = outs
    elif outs != ref:
      raise RuntimeError(f"{name}: outputs differ from device-only caching")
    res[name] = dict(r, num_host_blocks=host)
  base = res["device_only"]
  for r in res.values():
    r["computed_vs_device_only"] = r["prompt_tokens_computed"] / base["prompt_tokens_computed"]
    r["ttft_p50_vs_device_only"] = r["ttft_p50_s"] / base["ttft_p50_s"]
    r["ttft_cpu_p50_vs_device_only"] = r["ttft_cpu_p50_s"] / base["ttft_cpu_p50_s"]
  return {"systems": res, "outputs_equal": True}


HEADERS = ["system", "host blocks", "prompt tok", "computed", "dev hits", "host hits",
           "TTFT p50 ms", "TTFT p99 ms", "CPU TTFT p50 ms", "CPU TTFT p99 ms", "steps",
           "exchanges", "preempt", "wall s", "CPU s"]


def summary_rows(result: Dict):
  return [[name, r["num_host_blocks"], r["prompt_tokens"], r["prompt_tokens_computed"],
           r["hit_tokens"] - r["host_hit_tokens"], r["host_hit_tokens"],
           1e3 * r["ttft_p50_s"], 1e3 * r["ttft_p99_s"], 1e3 * r["ttft_cpu_p50_s"],
           1e3 * r["ttft_cpu_p99_s"], r["steps"], r["exchange_calls"], r["preemptions"],
           r["wall_s"], r["cpu_s"]] for name, r in result["systems"].items()]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  result["load_average"] = list(os.getloadavg())
  common.report(result, out, "host_tier.json", summary_rows(result), HEADERS,
                [f"greedy outputs equal across systems; load average "
                 f"{result['load_average'][0]:.1f} (wall-clock TTFT on a shared machine)"])


if __name__ == "__main__":
  common.run_app(main, Config)
