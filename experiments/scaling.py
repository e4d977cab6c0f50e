r"""Tensor-parallel memory scaling of the paged KV cache (simulated devices on CPU).

    python -m experiments.scaling --tp=1,2,4,8 --kv_mib_per_device=1 \
        --num_requests=96 --out=results/scaling

For each tp, on a mesh of tp simulated CPU devices (this module sets
XLA_FLAGS=--xla_force_host_platform_device_count=--num_devices before JAX starts):

  kv_bytes_per_device   MEASURED: bytes of the KV pages' shards on each device
                        (addressable shards of the engine's real state), for a
                        pool sized from a FIXED per-device budget.
  num_blocks            blocks that budget buys: tp times the tp=1 pool, since a
                        device holds 1/tp of every block (its KV heads).
  fixed_pool_bytes      MEASURED per-device bytes of one fixed pool (the tp=1
                        pool) split tp ways: 1/tp of it.
  fit_full_length       COMPUTED: requests of a long (1000-request) stream, in
                        order, whose full prompt + output blocks fit the pool at once.
  peak_running          MEASURED: most requests running at once in the real
                        tensor-parallel Engine serving the stream (all queued at
                        t=0, greedy, outputs capped at --max_output).
  step_time_ratio       MEASURED: median time of one jitted tensor-parallel decode
                        forward (--decode_batch sequences) over tp=1's, the tp
                        variants timed round-robin in this run. CPU "devices" here are threads sharing
                        this machine's cores, so this ratio says little about
                        accelerators; the memory figures are the result.

Also writes computed rows for a production shape (--prod_*: Llama-3-8B-like,
32 layers, 8 KV heads, head_dim 128, bf16) at --prod_gib_per_device.

Writes DIR/scaling.json and DIR/scaling.png; prints a table.
"""

from __future__ import annotations

import os
import dataclasses
import re
import sys
from typing import Dict, Optional, Tuple

from experiments import configs


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.scaling."""
  tp: Tuple[int, ...] = configs.flag((1, 2, 4, 8), "tensor-parallel sizes", lower=1)
  num_devices: int = configs.flag(8, "simulated CPU devices (>= max tp)", lower=1)
  kv_mib_per_device: float = configs.flag(1.0, "KV page budget per device, MiB (measured "
                                          "model)", lower=0.0, lower_open=True)
  block_size: int = configs.flag(16, "tokens per KV block", lower=1)
  workload: str = configs.flag("alpaca", "synthetic request stream",
                               choices=("alpaca", "sharegpt"))
  num_requests: int = configs.flag(96, "requests served per tp", lower=1)
  max_len: int = configs.flag(256, "context limit of the stream (prompt + output)", lower=2)
  max_output: int = configs.flag(48, "cap on generated tokens per request", lower=1)
  max_seqs: int = configs.flag(128, "engine sequence slots (above the block-bound "
                               "concurrency)", lower=1)
  decode_batch: int = configs.flag(8, "sequences in the timed decode forward", lower=1)
  timing_iters: int = configs.flag(30, "timed forward calls per tp (median reported)", lower=1)
  serve: bool = configs.flag(True, "serve the stream with the real engine (peak_running)")
  prod_gib_per_device: float = configs.flag(16.0, "KV budget per device for the computed rows",
                                            lower=0.0, lower_open=True)
  out: str = configs.flag("results/scaling", "output directory")


def _force_devices(argv) -> None:
  """Sets the CPU device count from --num_devices before JAX initializes."""
  n = 8
  for a in argv:
    m = re.match(r"--num_devices=(\d+)$", a)
    if m:
      n = int(m.group(1))
  flags_env = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                     os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags_env} --xla_force_host_platform_device_count={n}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
  _force_devices(sys.argv)

# pylint: disable=g-import-not-at-top,wrong-import-position
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import provenance
from paged_jax.attention import AttentionMetadata
from paged_jax.bench import timing
from paged_jax.bench import workloads
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.distributed import (cache_config_for_device_budget, make_mesh, make_tp_engine,
                                   per_device_bytes)
from paged_jax.engine import SamplingParams
from paged_jax.models import llama

MODEL = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=16, num_kv_heads=8, head_dim=16, max_position_embeddings=1024)
PROD = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                   num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                   dtype="bfloat16")


def fit_full_length(requests, cache: CacheConfig) -> int:
  """Requests (in order) whose full-length blocks fit the pool together."""
  used = 0
  for i, r in enumerate(requests):
    used += cache.blocks_for(r.total_len)
    if used > cache.num_blocks:
      return i
  return len(requests)


def serve(engine, requests) -> dict:
  """Serves `requests` (all at t = 0, greedy) on `engine`; {"peak_running" (most requests
  running after a step), "engine_steps", "preemptions", "generated_tokens",
  "serve_seconds"}."""
  for r in requests:
    engine.add_request([int(t) for t in r.prompt_token_ids],
                       SamplingParams(max_tokens=r.output_len, temperature=0.0))
  peak, steps, t0 = 0, 0, time.perf_counter()
  while engine.has_unfinished():
    engine.step()
    peak = max(peak, engine.last_step.num_running_groups)
    steps += 1
  engine.flush()
  return dict(peak_running=peak, engine_steps=steps, preemptions=engine.num_preemptions,
              generated_tokens=int(engine.stats["generated_tokens"]),
              serve_seconds=time.perf_counter() - t0)


def decode_call(tp_model, params, cache: CacheConfig, batch: int, vocab_size: int):
  """A compiled, warmed-up decode forward: `batch` sequences at context 4 blocks, 1 token each.

  Returns a no-argument callable that runs one step and waits for it.
  """
  ctx = 4 * cache.block_size
  per_seq = cache.blocks_for(ctx)
  tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq) % cache.num_blocks
  slots = tables[:, -1] * cache.block_size + (ctx - 1) % cache.block_size
  meta = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                           kv_lens=jnp.full((batch,), ctx, jnp.int32),
                           cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
                           num_seqs=jnp.asarray(batch, jnp.int32),
                           logits_indices=jnp.arange(batch, dtype=jnp.int32))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab_size, batch), jnp.int32)
  positions = jnp.full((batch,), ctx - 1, jnp.int32)
  step = jax.jit(tp_model.apply, donate_argnums=(3,))
  state = {"pages": tp_model.init_pages(cache)}

  def run():
    logits, state["pages"] = step(params, tokens, positions, state["pages"], meta)
    logits.block_until_ready()

  run()   # compile + warm up
  return run


def budget_rows(model_config: ModelConfig, tps, gib: float, block_size: int) -> list:
  """Computed rows of `model_config` at `gib` GiB of KV per device, per tp: KV bytes per
  token per device, blocks, tokens and full-context sequences the budget holds."""
  rows = []
  for tp in tps:
    cache = cache_config_for_device_budget(model_config, tp, int(gib * 2**30),
                                           block_size=block_size, max_seqs=256,
                                           dtype=model_config.dtype)
    rows.append(dict(tp=tp, kv_bytes_per_token_per_device=cache.kv_bytes_per_token // tp,
                     num_blocks=cache.num_blocks, tokens=cache.num_slots,
                     full_context_seqs=cache.num_slots // model_config.max_position_embeddings))
  return rows


def run(f: Optional[Config] = None) -> Dict:
  """Rows per tp (measured), the production shape's computed rows, and the run's settings,
  for settings `f` (default `Config()`)."""
  f = f or Config()
  tps = list(f.tp)
  if max(tps) > jax.device_count():
    raise ValueError(f"--tp holds {max(tps)} but only {jax.device_count()} devices; raise "
                     "--num_devices")
  budget = int(f.kv_mib_per_device * 2**20)
  params = llama.init_params(MODEL, jax.random.key(0))
  stream = workloads.synthetic(f.workload, f.num_requests, seed=0,
                               max_len=f.max_len, vocab_size=MODEL.vocab_size)
  stream = [workloads.Request(r.request_id, r.prompt_token_ids,
                              min(r.output_len, f.max_output)) for r in stream]
  long_stream = workloads.synthetic(f.workload, 1000, seed=0, max_len=f.max_len,
                                    vocab_size=MODEL.vocab_size)
  long_stream = [workloads.Request(r.request_id, r.prompt_token_ids,
                                   min(r.output_len, f.max_output)) for r in long_stream]
  base_cache = None
  rows, calls = [], {}
  for tp in common.progress(tps, desc="tp"):
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp], model_config=MODEL)
    cache = cache_config_for_device_budget(MODEL, tp, budget, block_size=f.block_size,
                                           max_seqs=f.max_seqs, max_model_len=f.max_len)
    base_cache = base_cache or cache
    engine = make_tp_engine(MODEL, params, cache, mesh=mesh, attention_backend="reference",
                            max_num_batched_tokens=2 * f.max_seqs)
    kv = per_device_bytes(engine.state.pages)
    tp_model = engine.tp_model
    fixed = per_device_bytes(tp_model.init_pages(base_cache))
    row = dict(tp=tp, devices=len(kv), num_blocks=cache.num_blocks, kv_tokens=cache.num_slots,
               kv_bytes_per_device=max(kv.values()), kv_bytes_per_device_min=min(kv.values()),
               kv_bytes_total=sum(kv.values()), fixed_pool_bytes_per_device=max(fixed.values()),
               fit_full_length=fit_full_length(long_stream, cache))
    calls[tp] = decode_call(tp_model, engine.params, cache, f.decode_batch,
                                       MODEL.vocab_size)
    if f.serve:
      row.update(serve(engine, stream))
    rows.append(row)
  # Round-robin over tp so load drifts hit every tp alike; one forward per sample.
  timings = timing.time_interleaved({tp: (call, ()) for tp, call in calls.items()},
                                    f.timing_iters, calls=1)
  failed = {tp: t["error"] for tp, t in timings.items() if "error" in t}
  if failed:
    raise RuntimeError(f"timed decode forward failed: {failed}")
  for r in rows:
    r["step_seconds"] = timings[r["tp"]]["median_s"]
  t1 = rows[0]["step_seconds"]
  for r in rows:
    r["step_time_ratio"] = r["step_seconds"] / t1
  result = dict(
      **provenance.run_metadata(f),
      devices="CPU, simulated devices (XLA host platform) sharing this machine's cores",
      jax_version=jax.__version__, model=MODEL.__dict__, workload=f.workload,
      num_requests=f.num_requests, max_output=f.max_output,
      kv_mib_per_device=f.kv_mib_per_device, block_size=f.block_size,
      rows=rows, production_shape=dict(
          model=PROD.__dict__, gib_per_device=f.prod_gib_per_device,
          rows=budget_rows(PROD, tps, f.prod_gib_per_device, f.block_size)),
      note=("step_time_ratio: CPU 'devices' share the host's cores, so it does not predict "
            "accelerator speed; memory figures are the result."))
  return result


def main(f: Config, out):
  """Runs with settings `f` into `out` (the `common.run_app` main)."""
  result = run(f)
  rows = result["rows"]
  common.write_json(out / "scaling.json", result)
  _plot(rows, out / "scaling.png")
  headers = ["tp", "KV MiB/device", "blocks", "fixed-pool MiB/device", "fit full-length",
             "peak running", "preemptions", "step time / tp=1"]
  print(common.table([[r["tp"], r["kv_bytes_per_device"] / 2**20, r["num_blocks"],
                       r["fixed_pool_bytes_per_device"] / 2**20, r["fit_full_length"],
                       r.get("peak_running", "-"), r.get("preemptions", "-"),
                       r["step_time_ratio"]] for r in rows], headers))
  print(common.table([[r["tp"], r["kv_bytes_per_token_per_device"], r["num_blocks"], r["tokens"],
                       r["full_context_seqs"]] for r in result["production_shape"]["rows"]],
                     ["tp", "KV bytes/token/device", "blocks", "tokens", "8K-context seqs"]))
  print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")


def _plot(rows, path):
  plt = common.pyplot()
  tps = [r["tp"] for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  axes[0].plot(tps, [r["fixed_pool_bytes_per_device"] / 2**20 for r in rows], "o-",
               label="fixed pool (tp=1 size)")
  axes[0].plot(tps, [r["kv_bytes_per_device"] / 2**20 for r in rows], "s--",
               label="fixed per-device budget")
  axes[0].set(xlabel="tp", ylabel="KV MiB per device", xscale="log", xticks=tps,
              xticklabels=tps, title="KV bytes per device (measured)")
  axes[0].legend(fontsize=8)
  axes[1].plot(tps, [r["fit_full_length"] for r in rows], "o-", label="fit full length")
  if "peak_running" in rows[0]:
    axes[1].plot(tps, [r["peak_running"] for r in rows], "s--", label="engine peak running")
  axes[1].set(xlabel="tp", ylabel="concurrent requests", xscale="log", xticks=tps,
              xticklabels=tps, title="Concurrency at a fixed per-device budget")
  axes[1].legend(fontsize=8)
  axes[2].bar([str(t) for t in tps], [r["step_time_ratio"] for r in rows])
  axes[2].set(xlabel="tp", ylabel="decode step time / tp=1",
              title="Step time (CPU threads: not indicative)")
  from matplotlib.ticker import NullFormatter
  for ax in axes[:2]:
    ax.xaxis.set_minor_formatter(NullFormatter())
  common.save_png(fig, path)


if __name__ == "__main__":
  common.run_app(main, Config)
