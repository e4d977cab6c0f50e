r"""The prefix cache's host tier at paper scale on the device-time model (issue 40, point
4(c)): TTFT and max request rate at the SLO, device-only caching vs a host tier of 1x,
4x, 16x the device pool, on multi-turn chats.

    python -m experiments.host_tier_scale --out=experiments/results/host_tier_scale

Deployment: `--model` on one `--gpu` (default OPT-13B on an A100-40GB, the paper's
Table 1 pair and its KV budget), the real engine with the stand-in forward on virtual
time (`paged_jax.bench.paper_scale`), prefix caching on in every system. Workload
(`paged_jax.bench.multi_turn`): `--conversations` chats, each turn's prompt the whole
history (earlier prompts and the engine's answers), chats starting as a Poisson process
and each next turn arriving an exponential think time (`--think_s` mean) after the
previous answer; "sharegpt-real" (the real ShareGPT V3 trace's multi-turn conversations,
cl100k lengths, cut at the 2,048-token context) when its optional extra is installed,
else "synthetic" (`--workload=auto` records which ran). A rate is requests (turns) per
second: chats start at rate / mean turns.

Time: each step costs the device-time model's seconds for what it computed
(`perf.DeviceTimeModel`), plus the host tier's copies (`multi_turn.TierTransfers`:
promotions host -> device before the step, blocks new to the host downloaded beside it;
bytes / (the catalog's `pcie_bandwidth` x the `pcie` efficiency), `perf.roofline`).
`--serial_stores` charges the downloads after the step instead (a bound on overlap).

Method: the SLO is `--slo_factor` x the unloaded normalized latency (device-only, a few
chats at a low rate: `--unloaded_conversations`, `--unloaded_rate`), the paper's Fig. 12
rule. Each system's max rate at the SLO is found by `rate_search.bracket_and_bisect` from
`--start_rate` (up x1.5 while under, down while over, then bisection; at most
`--max_points` rates) and read off by `latency.max_rate_at_slo` (interpolated; censored
">= X" when no rate tried missed it). Every system's first point is at `--start_rate`,
and with `--ttft_rate` every system also serves the stream at that rate (a load
device-only sustains): TTFT p50 / p99 and prompt tokens computed are reported at both,
each one load for all systems. Writes OUT/host_tier_scale.json (flags, versions, machine,
the stream's sizes). `--systems` runs some systems only and `--merge` joins such runs
(and a `--search=false --ttft_rate=R` run) into one result.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Callable, Dict, List, Optional

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax.bench import latency
from paged_jax.bench import multi_turn
from paged_jax.bench import paper_scale
from paged_jax.bench import rate_search
from paged_jax.bench import sharegpt_trace

# vLLM's published range for CPU KV offloading (vLLM blog, "Inside vLLM's New KV
# Offloading Connector", blog.vllm.ai, 2026-01-08: the OffloadingConnector of vLLM 0.11,
# asynchronous DMA copies, H100s): 2-22x faster TTFT for prompts reloaded from CPU memory
# instead of recomputed, up to 9x throughput for concurrent requests.
VLLM_TTFT_RANGE = (2.0, 22.0)
VLLM_THROUGHPUT_MAX = 9.0

HEADERS = ("system", "host blocks", "max rate at SLO (req/s)", "vs device-only",
           "TTFT p50 / p99 (ms), moderate load", "TTFT p50 / p99 speed-up",
           "TTFT p50 / p99 (ms), start rate", "TTFT p50 / p99 speed-up, start rate",
           "prompt tok computed", "host hits (tok)", "blocks in / out", "host tier s",
           "vLLM blog")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.host_tier_scale."""
  model: str = configs.flag("opt-13b", "catalog model")
  gpu: str = configs.flag("a100-40gb", "catalog GPU")
  workload: str = configs.flag("auto", "multi-turn stream (auto: sharegpt-real when its "
                               "extra is installed, else synthetic)",
                               choices=("auto", "sharegpt-real", "synthetic"))
  conversations: int = configs.flag(32, "chats per point", lower=1, upper=4096)
  think_s: float = configs.flag(15.0, "mean think time before a chat's next turn (s)",
                                lower=0)
  max_turns: int = configs.flag(16, "turns per chat at most", lower=2, upper=64)
  synthetic_turns: int = configs.flag(4, "synthetic: turns per chat", lower=2, upper=64)
  synthetic_first: str = configs.flag("64,512", "synthetic: first prompt tokens (low,high)")
  synthetic_user: str = configs.flag("16,256", "synthetic: new user tokens a turn (low,high)")
  synthetic_output: str = configs.flag("64,384", "synthetic: answer tokens (low,high)")
  host_factors: str = configs.flag("1,4,16", "host tier sizes, x the device pool")
  start_rate: float = configs.flag(1.5, "first rate of every search (req/s)", lower=0,
                                   lower_open=True)
  slo_factor: float = configs.flag(3.0, "SLO: this x the unloaded latency", lower=1.0)
  unloaded_conversations: int = configs.flag(3, "chats of the unloaded point", lower=1)
  unloaded_rate: float = configs.flag(0.02, "rate of the unloaded point (req/s)", lower=0,
                                      lower_open=True)
  max_points: int = configs.flag(4, "rates measured per search", lower=2)
  rel_tol: float = configs.flag(0.15, "bisection stops at hi / lo <= 1 + this", lower=0,
                                lower_open=True)
  max_seqs: int = configs.flag(0, "sequence slots (0: 1.5x what the KV memory holds "
                               "for the stream's mean turn, as sweep.system_sizes)", lower=0)
  serial_stores: bool = configs.flag(False, "charge host-tier downloads after the step")
  ttft_rate: float = configs.flag(0.0, "also serve every system at this rate (req/s) for "
                                  "TTFT at a load device-only sustains; 0: none", lower=0)
  search: bool = configs.flag(True, "search each system's max rate at the SLO (False: "
                              "only the --ttft_rate point)")
  slo_s_per_token: float = configs.flag(0.0, "the SLO (s/token) of an earlier run of the "
                                        "same stream, to split a run (0: from the unloaded "
                                        "point)", lower=0)
  systems: str = configs.flag("", "run only these systems (comma-separated names, e.g. "
                              "device_only,host_1x; empty: all)")
  merge: str = configs.flag("", "instead of running: merge these result JSONs (comma-"
                            "separated paths, runs of one stream split by --systems)")
  seed: int = configs.flag(0, "stream seed", lower=0)
  out: str = configs.flag("results/host_tier_scale", "output directory")

  def check(self) -> None:
    self.factors  # pylint: disable=pointless-statement
    for name in ("synthetic_first", "synthetic_user", "synthetic_output"):
      _pair(getattr(self, name), name)

  @property
  def factors(self) -> List[float]:
    try:
      out = [float(x) for x in str(self.host_factors).split(",") if x.strip()]
    except ValueError:
      out = []
    if not out or any(not x > 0 for x in out):
      raise ValueError(f"--host_factors must be comma-separated numbers > 0, got "
                       f"{self.host_factors!r}")
    return out


def _pair(text: str, name: str):
  try:
    lo, hi = (int(x) for x in str(text).split(","))
  except ValueError:
    raise ValueError(f"--{name} must be two comma-separated ints, got {text!r}") from None
  if not 1 <= lo <= hi:
    raise ValueError(f"--{name} must be low,high with 1 <= low <= high, got {text!r}")
  return lo, hi


def workload_name(f: Config) -> str:
  """The stream that runs: `--workload`, or for auto sharegpt-real when available."""
  if f.workload == "auto":
    return "synthetic" if sharegpt_trace.available() else "sharegpt-real"
  if f.workload == "sharegpt-real" and sharegpt_trace.available():
    raise ValueError(sharegpt_trace.available())
  return f.workload


def stream_fn(f: Config, workload: str, max_len: int) -> Callable:
  """conversations, chat start rate -> the seeded stream (same draws at every rate)."""
  if workload == "sharegpt-real":
    return lambda n, rate: multi_turn.sharegpt(
        n, seed=f.seed, max_len=max_len, start_rate=rate, think_mean=f.think_s,
        max_turns=f.max_turns)
  first, user = _pair(f.synthetic_first, "synthetic_first"), _pair(f.synthetic_user,
                                                                   "synthetic_user")
  output = _pair(f.synthetic_output, "synthetic_output")
  longest = first[1] + (f.synthetic_turns - 1) * (user[1] + output[1]) + output[1]
  if longest > max_len:
    raise ValueError(f"the synthetic chats reach {longest} tokens, past the context "
                     f"{max_len}: lower --synthetic_turns or the lengths")
  return lambda n, rate: multi_turn.synthetic(
      n, f.synthetic_turns, first=first, user=user, output=output, start_rate=rate,
      think_mean=f.think_s, vocab=paper_scale.VOCAB_SIZE, seed=f.seed)


def run(f: Optional[Config] = None, checkpoint: Optional[Callable] = None) -> Dict:
  """The measurement (module docstring); `checkpoint(partial result)` after each system."""
  f = f or Config()
  setting = paper_scale.setting(f.model, f.gpu)
  bs = paper_scale.BLOCK_SIZE
  budget = setting.kv_budget_tokens(bs)
  device_blocks = budget // bs
  workload = workload_name(f)
  make_stream = stream_fn(f, workload, setting.max_len)
  stats = multi_turn.stream_stats(make_stream(f.conversations, 1.0))
  turns = stats["mean_turns"]
  held = stats["mean_prompt_len"] + stats["mean_output_len"] / 2 + bs / 2
  max_seqs = f.max_seqs or min(paper_scale.MAX_NUM_SEQS,
                               4 * math.ceil(1.5 * budget / held / 4))
  systems = {"device_only": 0, **{f"host_{x:g}x": int(round(x * device_blocks))
                                  for x in f.factors}}
  if f.systems:
    keep = [x.strip() for x in f.systems.split(",") if x.strip()]
    bad = [x for x in keep if x not in systems]
    if bad:
      raise ValueError(f"--systems must be among {', '.join(systems)}, got {bad}")
    systems = {k: v for k, v in systems.items() if k in keep}

  def point(host_blocks: int, rate: float, n: int) -> Dict:
    engine = setting.make_engine(block_size=bs, kv_budget_tokens=budget, max_seqs=max_seqs,
                                 prefix_caching=True, num_host_blocks=host_blocks)
    clock = multi_turn.transfer_clock(setting.device_model, engine,
                                      serial_stores=f.serial_stores)
    res = multi_turn.serve(engine, make_stream(n, rate / turns), clock)
    res["rate"] = rate
    return res

  norm = lambda p: p["summary"]["normalized_latency_s_per_token"]
  unloaded_point = None if f.slo_s_per_token else point(0, f.unloaded_rate,
                                                          f.unloaded_conversations)
  slo = f.slo_s_per_token or latency.slo_from_unloaded([norm(unloaded_point)],
                                                       f.slo_factor)
  result = {"setting": setting.as_dict(), "workload": workload, "stream": stats,
            "device_blocks": device_blocks, "max_seqs": max_seqs, "slo_s_per_token": slo,
            "unloaded_s_per_token": unloaded_point and norm(unloaded_point),
            "unloaded_point": unloaded_point and unloaded_point["summary"], "systems": {}}
  for name, host in common.progress(list(systems.items()), desc="systems"):
    entry = result["systems"][name] = dict(num_host_blocks=host,
                                           host_factor=host / device_blocks)
    if f.search:
      def seen(rate, lat, entry=entry):   # each point as it comes (a cut run keeps them)
        entry.setdefault("points_so_far", []).append([rate, lat])
        if checkpoint:
          checkpoint(result)
      entry.update(search(f, lambda rate, host=host: point(host, rate, f.conversations), slo,
                          seen))
    if f.ttft_rate:
      at = point(host, f.ttft_rate, f.conversations)
      entry.update(ttft_rate=f.ttft_rate, at_ttft_rate=_point_summary(at),
                   host_tier_s_at_ttft_rate=at["clock"]["by_part_s"]["host_tier"])
    if checkpoint:
      checkpoint(result)
  return compare(result)


def _point_summary(p: Dict) -> Dict:
  return {k: v for k, v in p.items() if k != "clock"}


def search(f: Config, serve_at: Callable[[float], Dict], slo: float,
           seen: Optional[Callable] = None) -> Dict:
  """One system's max rate at the SLO from `--start_rate` (module docstring), and its
  point at the start rate; `seen(rate, latency)` after each point."""
  runs: Dict[float, Dict] = {}

  def measure(rate: float) -> float:
    runs[rate] = serve_at(rate)
    lat = runs[rate]["summary"]["normalized_latency_s_per_token"]
    if seen:
      seen(rate, lat)
    return lat

  curve = rate_search.bracket_and_bisect(measure, f.start_rate, slo, rel_tol=f.rel_tol,
                                         max_points=f.max_points)
  found = latency.max_rate_at_slo([r for r, _ in curve], [v for _, v in curve], slo)
  at_start = runs[f.start_rate]
  return dict(found=found, max_rate=found["interpolated"] or found["swept"],
              censored=found["interpolated"] is None, curve=[list(x) for x in curve],
              at_start=_point_summary(at_start),
              host_tier_s=at_start["clock"]["by_part_s"]["host_tier"],
              device_s=at_start["clock"]["device_s"])


def compare(result: Dict) -> Dict:
  """Adds each system's ratios to device-only's (when it ran) and vLLM's range."""
  for r in result["systems"].values():   # a search cut short: what its points show
    if "max_rate" not in r and r.get("points_so_far"):
      pts = r["points_so_far"]
      found = latency.max_rate_at_slo([p[0] for p in pts], [p[1] for p in pts],
                                      result["slo_s_per_token"])
      r.update(found=found, max_rate=found["interpolated"] or found["swept"],
               censored=found["interpolated"] is None, curve=sorted(pts),
               search_cut_short=True)
      if not found["swept"]:         # every rate tried missed the SLO: only a bound
        r.update(max_rate=None, below=min(p[0] for p in pts))
  base = result["systems"].get("device_only")
  ttft = lambda r, at, q: r[at]["summary"][f"ttft_{q}_s"]
  for r in result["systems"].values() if base else ():
    if "max_rate" in r and "max_rate" in base:
      r["max_rate_vs_device_only"] = (r["max_rate"] / base["max_rate"]
                                      if base["max_rate"] and r["max_rate"] else None)
    for at, suffix in (("at_start", ""), ("at_ttft_rate", "_at_ttft_rate")):
      if at in r and at in base:
        for q in ("p50", "p99"):
          r[f"ttft_{q}_speedup{suffix}"] = ttft(base, at, q) / ttft(r, at, q)
  result["vllm_published"] = {
      "ttft_speedup": list(VLLM_TTFT_RANGE), "throughput_speedup_max": VLLM_THROUGHPUT_MAX,
      "source": "vLLM blog, 'Inside vLLM's New KV Offloading Connector' (blog.vllm.ai, "
                "2026-01-08): OffloadingConnector (vLLM 0.11), H100s"}
  return result


def merge(paths: List[str]) -> Dict:
  """One result from runs of the same stream and SLO split by `--systems` (ValueError
  when their stream, setting or SLO differ)."""
  docs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
  keys = ("workload", "stream", "device_blocks", "max_seqs", "slo_s_per_token")
  for d in docs[1:]:
    diff = [k for k in keys if d[k] != docs[0][k]]
    if diff:
      raise ValueError(f"--merge needs runs of one stream and SLO; {', '.join(diff)} differ")
  out = dict(docs[0], systems={}, merged_from=[
      {"path": str(p), "seconds": d.get("seconds"), "systems": list(d["systems"]),
       "flags": d.get("flags")} for p, d in zip(paths, docs)])
  order = ["device_only"] + sorted((k for d in docs for k in d["systems"]
                                    if k != "device_only"),
                                   key=lambda k: float(k[len("host_"):-1]))
  for k in dict.fromkeys(order):
    out["systems"][k] = {}
    for d in docs:   # a system's search and its TTFT point may come from two runs
      out["systems"][k].update(d["systems"].get(k, {}))
  return compare(out)


def summary_rows(result: Dict):
  """One row per system: the max rate; TTFT at the --ttft_rate point (moderate load) and
  at the start rate; tokens and copies at the former (else the latter); "-" where a part
  did not run."""
  def pair(r, at):
    if at not in r:
      return "-"
    t = r[at]["summary"]
    return f"{1000 * t['ttft_p50_s']:.0f} / {1000 * t['ttft_p99_s']:.0f}"

  def speedups(r, suffix):
    got = [r.get(f"ttft_{q}_speedup{suffix}") for q in ("p50", "p99")]
    return "-" if None in got else f"{got[0]:.2f} / {got[1]:.2f}"

  rows = []
  for name, r in result["systems"].items():
    rate = "-" if "max_rate" not in r else (
        f"< {r['below']:.3g}" if r.get("below") else
        f">= {r['max_rate']:.3g}" if r["censored"] else r["max_rate"])
    if r.get("search_cut_short"):
      rate = f"{rate} (cut: {len(r['curve'])} rate{'s' if len(r['curve']) > 1 else ''})"
    at = "at_ttft_rate" if "at_ttft_rate" in r else "at_start"
    s = r.get(at, {})
    vllm = "-" if name == "device_only" else (
        f"TTFT {VLLM_TTFT_RANGE[0]:g}-{VLLM_TTFT_RANGE[1]:g}x, throughput <= "
        f"{VLLM_THROUGHPUT_MAX:g}x")
    vs = r.get("max_rate_vs_device_only") or "-"
    if vs != "-" and r.get("censored"):
      vs = f">= {vs:.3g}"
    rows.append((name, r["num_host_blocks"], rate, vs,
                 pair(r, "at_ttft_rate"), speedups(r, "_at_ttft_rate"),
                 pair(r, "at_start"), speedups(r, ""),
                 s.get("prompt_tokens_computed", "-"), s.get("host_hit_tokens", "-"),
                 f"{s.get('host_in_blocks', 0)} / {s.get('host_out_blocks', 0)}",
                 r.get("host_tier_s_at_ttft_rate", r.get("host_tier_s", "-")), vllm))
  return rows


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  if f.merge:
    result = merge([x.strip() for x in f.merge.split(",") if x.strip()])
    result.update(merged_by=provenance.run_metadata(f))
    common.report(result, out, "host_tier_scale.json", summary_rows(result), HEADERS)
    return
  partial = (lambda r: common.write_json(out / "host_tier_scale.partial.json", r)) \
      if out is not None else None
  result = common.timed_result(lambda: run(f, partial), f)
  st = result["stream"]
  common.report(result, out, "host_tier_scale.json", summary_rows(result), HEADERS, [
      f"workload {result['workload']}: {st['conversations']} chats, {st['turns']} turns, "
      f"mean prompt {st['mean_prompt_len']:.0f} tok; device pool {result['device_blocks']} "
      f"blocks; SLO {1000 * result['slo_s_per_token']:.1f} ms/token; moderate load "
      f"{f.ttft_rate:g} req/s, start rate {f.start_rate:g} req/s"])
  if out is not None and (out / "host_tier_scale.partial.json").exists():
    (out / "host_tier_scale.partial.json").unlink()


if __name__ == "__main__":
  common.run_app(main, Config)
