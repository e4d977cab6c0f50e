r"""The shipped scheduling and eviction policies compared on one shared-prefix stream.

    python -m experiments.policies --model=opt-13b --gpu=a100-40gb --num_requests=1000 \
        --rates=8,12,16 --out=experiments/results/policies

The stream (seeded): every prompt is one shared system head (`--head_len` tokens), then
the few-shot body of one of `--num_tasks` tasks (lengths drawn in [--task_len_min,
--task_len_max]; task t chosen with Zipf weight 1 / (t + 1)^--zipf), then a ~30-token
question (`workloads.sample_lengths`, log-normal); outputs log-normal with mean
--output_mean; Poisson arrivals at each of --rates (`arrivals.arrival_times`); each request
gets a priority class uniform in [0, --num_priority_classes) (lower first under "priority").

At each rate, each (scheduling, eviction) pair of --scheduling x --eviction serves the
same stream on a fresh paper-scale engine (`paged_jax.bench.paper_scale`: the real Engine
with prefix caching on, the stand-in forward, the KV slots `--model` on `--gpu` leaves, vLLM v0.1's
2,560 tokens a step, `--max_seqs` slots) on the device-time model's virtual clock (`perf.ModelClock`, as
`serving_benchmark --clock=model`), fed online through an open gate
(`bench.serving.serve_online`). Scheduling: "fcfs", "priority", "shortest_prompt" (the key
`request.prompt_len`); eviction: `CacheConfig.eviction_policy` ("lru", "protect_shallow").

Per pair: prefix block hit rate, evictions, preemptions, throughput (requests/s and
generated tokens/s), TTFT p50 / p99, normalized latency (mean latency / output tokens),
and per priority class the normalized latency and TTFT p50 / p99.
Writes DIR/policies.json (rows, flags, versions, machine, device model).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Tuple

import numpy as np

from experiments import common
from experiments import configs
from paged_jax.bench import arrivals
from paged_jax.bench import latency
from paged_jax.bench import paper_scale
from paged_jax.bench import serving
from paged_jax.bench import workloads
from paged_jax.bench.baselines.gate import OpenGate
from paged_jax.eviction_policy import EVICTION_POLICIES

SCHEDULING = {"fcfs": "fcfs", "priority": "priority",
              "shortest_prompt": lambda request: request.prompt_len}


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.policies."""
  model: str = configs.flag("opt-13b", "model of the device-time model and KV budget")
  gpu: str = configs.flag("a100-40gb", "GPU of the device-time model and KV budget")
  scheduling: Tuple[str, ...] = configs.flag(tuple(SCHEDULING), "scheduling policies",
                                             choices=tuple(SCHEDULING))
  eviction: Tuple[str, ...] = configs.flag(tuple(EVICTION_POLICIES), "eviction policies",
                                           choices=tuple(EVICTION_POLICIES))
  num_requests: int = configs.flag(600, "requests in the stream", lower=1)
  rates: Tuple[float, ...] = configs.flag((8.0, 12.0, 16.0), "Poisson arrival rates (requests/s)",
                                         lower=0.0, lower_open=True)
  head_len: int = configs.flag(256, "tokens of the system head every prompt shares", lower=1)
  num_tasks: int = configs.flag(24, "task bodies (prefixes after the head)", lower=1)
  task_len_min: int = configs.flag(64, "shortest task body (tokens)", lower=1)
  task_len_max: int = configs.flag(1024, "longest task body (tokens)", lower=1)
  zipf: float = configs.flag(1.0, "task popularity: weight 1 / (t + 1)^zipf", lower=0.0)
  output_mean: float = configs.flag(64.0, "mean output tokens (log-normal)", lower=2.0)
  num_priority_classes: int = configs.flag(2, "priority classes (uniform)", lower=1)
  kv_budget_tokens: int = configs.flag(0, "KV slots (0: what --model on --gpu leaves)",
                                       lower=0)
  max_seqs: int = configs.flag(128, "sequence slots of the engine", lower=1)
  max_len: int = configs.flag(2048, "context (tokens a request may hold)", lower=16)
  block_size: int = configs.flag(16, "tokens per KV block", lower=1)
  seed: int = configs.flag(0, "stream seed")
  out: str = configs.flag("results/policies", "output directory")

  def check(self) -> None:
    if self.task_len_max < self.task_len_min:
      raise ValueError(f"--task_len_max must be >= --task_len_min={self.task_len_min}, "
                       f"got {self.task_len_max}")
    if self.head_len + self.task_len_max + 64 + 1 > self.max_len:
      raise ValueError(f"--head_len + --task_len_max + 64 must be < --max_len={self.max_len}, "
                       f"got {self.head_len} + {self.task_len_max} + 64")
    configs.check_multiple(self, "kv_budget_tokens", "block_size")


def stream(f: Config, rate: float) -> Tuple[List[workloads.Request], np.ndarray]:
  """(requests sorted by arrival, priority class i32[n] by request id); the same prompts,
  outputs and classes at every rate."""
  rng = np.random.default_rng([f.seed, 37])
  head = rng.integers(0, paper_scale.VOCAB_SIZE, f.head_len, dtype=np.int32)
  lens = rng.integers(f.task_len_min, f.task_len_max + 1, f.num_tasks)
  tasks = [rng.integers(0, paper_scale.VOCAB_SIZE, int(n), dtype=np.int32) for n in lens]
  w = 1.0 / np.arange(1, f.num_tasks + 1) ** f.zipf
  task = rng.choice(f.num_tasks, f.num_requests, p=w / w.sum())
  spec = workloads.DatasetSpec("policies", workloads.LengthSpec(30.0, 0.5),
                               workloads.LengthSpec(f.output_mean, 0.6))
  q_lens, out_lens = workloads.sample_lengths(spec, f.num_requests, seed=f.seed,
                                              max_len=f.max_len - f.head_len - f.task_len_max)
  q_lens = np.minimum(q_lens, 64)
  times = arrivals.arrival_times(rate, seed=f.seed, num_requests=f.num_requests)
  reqs = [workloads.Request(i, np.concatenate([head, tasks[task[i]], rng.integers(
              0, paper_scale.VOCAB_SIZE, int(q_lens[i]), dtype=np.int32)]),
                            int(out_lens[i]), float(times[i]))
          for i in range(f.num_requests)]
  prio = rng.integers(0, f.num_priority_classes, f.num_requests).astype(np.int32)
  return reqs, prio


class _WithPriority:
  """The engine as `serve_online` sees it, with each request's priority class passed to
  `add_request` (everything else is the engine's)."""

  def __init__(self, engine, priority: np.ndarray):
    self._engine, self._priority = engine, priority

  def add_request(self, prompt, params, request_id):
    return self._engine.add_request(prompt, params, request_id,
                                    priority=int(self._priority[request_id]))

  def __getattr__(self, name):
    return getattr(self._engine, name)


def _by_class(res: Dict, prio: np.ndarray, ids: np.ndarray) -> Dict[str, Dict]:
  out = {}
  for c in sorted(set(prio.tolist())):
    m = prio[ids] == c
    s = latency.summarize(res["arrival"][m], res["first_token"][m], res["finish"][m],
                          res["output_len"][m])
    out[str(c)] = {k: s[k] for k in ("requests", "normalized_latency_s_per_token",
                                     "ttft_p50_s", "ttft_p99_s")}
  return out


def run_pair(setting, f: Config, rate: float, scheduling: str, eviction: str) -> Dict:
  """One (scheduling, eviction) pair over the stream: a row of the result."""
  requests, prio = stream(f, rate)
  kv = f.kv_budget_tokens or setting.kv_budget_tokens(f.block_size)
  engine = setting.make_engine(block_size=f.block_size, kv_budget_tokens=kv,
                               max_seqs=f.max_seqs, max_len=f.max_len, prefix_caching=True,
                               max_num_batched_tokens=paper_scale.PAPER.max_num_batched_tokens,
                               max_beam_width=1, eviction_policy=eviction,
                               scheduling_policy=SCHEDULING[scheduling])
  res = serving.serve_online(_WithPriority(engine, prio), requests, OpenGate(),
                             clock=setting.clock(f.block_size))
  stats = engine.prefix_stats()
  s = res["summary"]
  ids = np.array([r.request_id for r in requests])
  return {"rate": rate, "scheduling": scheduling, "eviction": eviction,
          "kv_budget_tokens": kv,
          "hit_rate": stats["hit_rate"], "evictions": stats["evictions"],
          "hit_tokens": stats["hit_tokens"], "prefill_tokens": stats["prefill_tokens"],
          "preemptions": res["preemptions"], "steps": res["steps"],
          **{k: s[k] for k in ("throughput_req_s", "throughput_tok_s", "ttft_p50_s",
                               "ttft_p99_s", "normalized_latency_s_per_token",
                               "mean_latency_s", "makespan_s")},
          "by_priority": _by_class(res, prio, ids)}


def run(f: Optional[Config] = None) -> Dict:
  """Every (scheduling, eviction) pair of `f` over one stream; the result dict."""
  f = f or Config()
  setting = paper_scale.setting(f.model, f.gpu, max_len=f.max_len)
  rows = [run_pair(setting, f, rate, s, e)
          for rate, s, e in itertools.product(f.rates, f.scheduling, f.eviction)]
  requests, _ = stream(f, f.rates[0])
  prompt = np.array([r.prompt_len for r in requests])
  return {"experiment": "policies", "setting": setting.as_dict(), "rows": rows,
          "stream": {"requests": len(requests), "mean_prompt_len": float(prompt.mean()),
                     "mean_output_len": float(np.mean([r.output_len for r in requests]))}}


HEADERS = ["rate req/s", "scheduling", "eviction", "hit rate", "evictions", "preempt", "req/s",
           "tok/s", "TTFT p50 s", "TTFT p99 s", "norm. lat. s/tok", "class 0 norm. lat.",
           "class 1 norm. lat."]


def summary_rows(result: Dict) -> List[list]:
  """One table row per (scheduling, eviction) pair (rendered into docs/extending.md)."""
  def cls(r, c):
    b = r["by_priority"].get(str(c))
    return b["normalized_latency_s_per_token"] if b else "-"
  return [[r["rate"], r["scheduling"], r["eviction"], r["hit_rate"], r["evictions"],
           r["preemptions"], r["throughput_req_s"], r["throughput_tok_s"], r["ttft_p50_s"],
           r["ttft_p99_s"], r["normalized_latency_s_per_token"], cls(r, 0), cls(r, 1)]
          for r in result["rows"]]


def main(f: Config, out):
  """Runs with settings `f` and writes out/policies.json."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "policies.json", summary_rows(result), HEADERS)


if __name__ == "__main__":
  common.run_app(main, Config)
