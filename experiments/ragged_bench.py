r"""Ragged paged attention (mixed prefill + decode) vs contiguous baselines, side by side.

    python -m experiments.ragged_bench --out=results/ragged_bench        # GPU or CPU
    python -m experiments.ragged_bench --dry_run --out=/tmp/rb           # tiny, interpreted

Scenarios (GPU defaults: 32 query / 8 KV heads, head_dim 128, bf16, block sizes 16, 128):
  decode64     64 sequences x 1 new token, context 4096
  decode8_32k  8 sequences x 1 new token, context 32768 (split-K)
  prefill2k    1 sequence x 2048 new tokens, no prefix (causal self-attention)
  chunk4x512   4 sequences x 512 new tokens after a 3584-token prefix (chunked prefill)
  mixed        64 decode rows (context 2048) + 2 chunks of 512 after a 1536 prefix
Methods, on the same content in the same run:
  ragged_paged       pallas_kernels.ragged_paged_attention, randomly permuted block table
  ragged_contiguous  the same kernel, pages laid out in order (identity table): the cost
                     of paging itself
  decode_kernel      pallas_kernels.paged_attention (decode scenarios)
  ragged_<variant>   knob variants of the kernel (SWEEP, with --sweep) on a few scenarios
  dense              jax.nn.dot_product_attention on a contiguous [S, L, Hkv, D] cache with
                     the causal-with-offset mask (uniform scenarios; cuDNN when it accepts
                     the call, else XLA)
Reported: median time; K/V bytes the attention needs (kv_len * Hkv * D * 2 * itemsize over
sequences) over that time, also as a fraction of the measured copy bandwidth; attention
TFLOP/s (4 * D * visible query-key pairs * Hq). Timing and copy bandwidth come from
experiments.common (warm-up, interleaved samples, median), as in kernel_bench. On CPU
(or --dry_run) sizes shrink and the kernel runs interpreted.
Flags are defined only when run as a script (from `Config`), so importing this module (the
lowering tests read its scenarios) next to other experiments cannot clash on --seed / --out.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import time
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import configs
import pallas_kernels
from pallas_kernels import reference

@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.ragged_bench."""
  out: str = configs.flag("results/ragged_bench", "output directory")
  scenarios: Optional[Tuple[str, ...]] = configs.flag(None, "subset of scenario names "
                                                      "(default: all)")
  dry_run: bool = configs.flag(False, "tiny sizes, interpreted kernel (checks the script on CPU)")
  block_size: Tuple[int, ...] = configs.flag((16, 128), "KV-cache block sizes", lower=1)
  num_q_heads: int = configs.flag(32, "query heads (GPU)", lower=1)
  num_kv_heads: int = configs.flag(8, "KV heads (GPU)", lower=1)
  head_dim: int = configs.flag(128, "features per head (GPU)", lower=1)
  dtype: Optional[str] = configs.flag(None, "q / page dtype (default: GPU bfloat16, CPU float32)")
  repeats: Optional[int] = configs.flag(None, "timing samples per method (default GPU 10, CPU 3)",
                                        lower=1)
  calls_per_sample: Optional[int] = configs.flag(None, "calls per sample (default GPU 5, CPU 1)",
                                                 lower=1)
  seed: int = configs.flag(0, "PRNG seed")
  sweep: bool = configs.flag(True, "also time knob variants (SWEEP) on SWEEP_SCENARIOS at the "
                             "first block size")


# Knob variants timed beside the defaults (to pick defaults from GPU measurements).
SWEEP = {
    "ragged_tk128_w8": dict(kv_per_tile=128, num_warps=8),
    "ragged_tk32": dict(kv_per_tile=32),
    "ragged_stages3": dict(num_stages=3),
    "ragged_one_launch": dict(single_launch=True),  # decode rows in prefill-sized tiles
}
SWEEP_SCENARIOS = ("decode64", "prefill2k", "mixed")

# name -> list of (number of sequences, new tokens each, context after this step).
GPU_SCENARIOS = {
    "decode64": [(64, 1, 4096)],
    "decode8_32k": [(8, 1, 32768)],
    "prefill2k": [(1, 2048, 2048)],
    "chunk4x512": [(4, 512, 4096)],
    "mixed": [(64, 1, 2048), (2, 512, 2048)],
}
CPU_SCENARIOS = {
    "decode64": [(8, 1, 256)],
    "decode8_32k": [(2, 1, 1024)],
    "prefill2k": [(1, 128, 128)],
    "chunk4x512": [(2, 32, 256)],
    "mixed": [(8, 1, 128), (1, 32, 128)],
}
GPU_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def _expand(groups):
  return [(q, ctx) for n, q, ctx in groups for _ in range(n)]


def lowering_configs() -> List[dict]:
  """The GPU scenarios as shapes (tests/cuda_lowering_ragged_test.py lowers each)."""
  cfgs = []
  for name, groups in GPU_SCENARIOS.items():
    seqs = _expand(groups)
    for bs in (16, 128):
      cfgs.append(dict(name=f"{name}_bs{bs}", num_tokens=sum(q for q, _ in seqs),
                       num_seqs=len(seqs), block_size=bs,
                       pages_per_seq=max(-(-c // bs) for _, c in seqs), **GPU_HEADS))
  return cfgs


def make_inputs(key, seqs, block_size, hq, hkv, d, dtype):
  """Random ragged batch; permuted tables and an in-order copy of the same content."""
  pages = [-(-ctx // block_size) for _, ctx in seqs]
  num_blocks, pages_per_seq = sum(pages), max(pages)
  kq, kk, kv, kp = jax.random.split(key, 4)
  num_tokens = sum(q for q, _ in seqs)
  q = jax.random.normal(kq, (num_tokens, hq, d), jnp.float32).astype(dtype)
  k_pages = jax.random.normal(kk, (hkv, num_blocks, block_size, d), jnp.float32).astype(dtype)
  v_pages = jax.random.normal(kv, (hkv, num_blocks, block_size, d), jnp.float32).astype(dtype)
  perm = np.asarray(jax.random.permutation(kp, num_blocks))
  tables = np.full((len(seqs), pages_per_seq), -1, np.int32)
  identity = np.full_like(tables, -1)
  start = 0
  for i, n in enumerate(pages):
    tables[i, :n] = perm[start:start + n]
    identity[i, :n] = np.arange(start, start + n)
    start += n
  # In-order pages: contiguous[:, j] holds what the permuted table maps logical page j to.
  k_contig, v_contig = k_pages[:, perm], v_pages[:, perm]
  cu = np.concatenate([[0], np.cumsum([q_len for q_len, _ in seqs])]).astype(np.int32)
  kv_lens = np.array([ctx for _, ctx in seqs], np.int32)
  common_args = (jnp.asarray(kv_lens), jnp.asarray(cu), jnp.int32(len(seqs)))
  paged = (q, k_pages, v_pages, jnp.asarray(tables)) + common_args
  contiguous = (q, k_contig, v_contig, jnp.asarray(identity)) + common_args
  return paged, contiguous


def dense_inputs(contiguous, seqs):
  """Uniform batches only: ([S, Tq, Hq, D], [S, L, Hkv, D] x2, mask [S, 1, Tq, L])."""
  q, k_c, v_c = contiguous[:3]
  num_seqs, (q_len, ctx) = len(seqs), seqs[0]
  hkv, _, bs, d = k_c.shape
  length = -(-ctx // bs) * bs
  k = jnp.swapaxes(k_c.reshape(hkv, num_seqs, length, d), 0, 1).swapaxes(1, 2)
  v = jnp.swapaxes(v_c.reshape(hkv, num_seqs, length, d), 0, 1).swapaxes(1, 2)
  qd = q.reshape(num_seqs, q_len, q.shape[1], d)
  q_pos = ctx - q_len + jnp.arange(q_len)
  key_pos = jnp.arange(length)
  mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < ctx)
  return qd, k, v, jnp.broadcast_to(mask, (num_seqs, 1, q_len, length))


def work(seqs, hq, hkv, d, itemsize):
  kv_bytes = sum(ctx for _, ctx in seqs) * hkv * d * 2 * itemsize
  pairs = sum(sum(ctx - q_len + 1 + t for t in range(q_len)) for q_len, ctx in seqs)
  return kv_bytes, 4 * d * pairs * hq


def _variant(knobs, interpret):
  knobs = dict(knobs)
  if knobs.pop("single_launch", False):
    knobs["short_q_per_tile"] = knobs["q_per_tile"] = None  # resolved below

  def f(*args):
    kw = dict(knobs)
    if "q_per_tile" in kw:  # one launch: short tiles as large as the prefill tiles
      from pallas_kernels.triton import tuning  # pylint: disable=g-import-not-at-top
      group = args[0].shape[1] // args[1].shape[0]
      kw["q_per_tile"] = kw["short_q_per_tile"] = tuning.default_q_per_tile(group)[0]
    return pallas_kernels.ragged_paged_attention(*args, interpret=interpret, **kw)
  return jax.jit(f)


def bench_scenario(name, seqs, bs, cfg, interpret, repeats, calls, key, sweep=False):
  paged, contiguous = make_inputs(key, seqs, bs, cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"])
  kernel = jax.jit(functools.partial(pallas_kernels.ragged_paged_attention,
                                     interpret=interpret))
  fns = {"ragged_paged": (kernel, paged), "ragged_contiguous": (kernel, contiguous)}
  if sweep:
    for variant, knobs in SWEEP.items():
      fns[variant] = (_variant(knobs, interpret), paged)
  checks = {}
  out = kernel(*paged)
  ref_out = jax.jit(reference.ragged_paged_attention_reference)(*paged) if interpret else None
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  rel = lambda a, b: float(np.linalg.norm(f32(a) - f32(b)) / np.linalg.norm(f32(b)))
  checks["paged_vs_contiguous_rel_err"] = rel(out, kernel(*contiguous))
  if ref_out is not None:
    checks["kernel_vs_reference_rel_err"] = rel(out, ref_out)
  if all(q_len == 1 for q_len, _ in seqs) and pallas_kernels.paged_attention is not None:
    dec = jax.jit(functools.partial(pallas_kernels.paged_attention, interpret=interpret))
    dec_args = (paged[0], paged[1], paged[2], paged[3], paged[4])
    fns["decode_kernel"] = (dec, dec_args)
    checks["decode_kernel_vs_ragged_rel_err"] = rel(dec(*dec_args), out)
  if len(set(seqs)) == 1:
    qd, k, v, mask = dense_inputs(contiguous, seqs)
    for impl in ("cudnn", "xla"):
      f = jax.jit(lambda q, k, v, m, impl=impl: jax.nn.dot_product_attention(
          q, k, v, mask=m, implementation=impl))
      try:
        dense_out = f(qd, k, v, mask)
      except Exception as e:  # pylint: disable=broad-except
        checks[f"dense_{impl}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        continue
      fns["dense"] = (f, (qd, k, v, mask))
      checks["dense_impl"] = impl
      checks["dense_vs_ragged_rel_err"] = rel(dense_out.reshape(out.shape), out)
      break
  timings = common.time_interleaved(fns, repeats, calls)
  kv_bytes, flops = work(seqs, cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"].itemsize)
  for t in timings.values():
    if "median_s" in t:
      t["GBps"] = kv_bytes / t["median_s"] / 1e9
      t["TFLOPs"] = flops / t["median_s"] / 1e12
      if cfg.get("copy_GBps"):
        t["fraction_of_copy_bw"] = t["GBps"] / cfg["copy_GBps"]
  return {"scenario": name, "block_size": bs, "num_seqs": len(seqs),
          "num_tokens": sum(q for q, _ in seqs), "kv_bytes": kv_bytes, "flops": flops,
          "checks": checks, "timings": timings}


def main(f: Config, out):
  """Runs with settings `f` into `out` (the `common.run_app` main)."""
  on_gpu = jax.default_backend() == "gpu" and not f.dry_run
  interpret = not on_gpu
  scenarios = GPU_SCENARIOS if on_gpu else CPU_SCENARIOS
  names = f.scenarios or list(scenarios)
  unknown = sorted(set(names) - set(scenarios))
  if unknown:
    raise ValueError(f"--scenarios: unknown {unknown}; choose from {sorted(scenarios)}")
  heads = (dict(hq=f.num_q_heads, hkv=f.num_kv_heads, d=f.head_dim) if on_gpu
           else dict(hq=4, hkv=2, d=64))
  dtype = jnp.dtype(f.dtype or ("bfloat16" if on_gpu else "float32"))
  block_sizes = [int(b) for b in f.block_size]
  repeats = f.repeats or (10 if on_gpu else 3)
  calls = f.calls_per_sample or (5 if on_gpu else 1)
  out_dir = out
  cfg = {**heads, "dtype": dtype}
  meta = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
          "jax": jax.__version__, "python": platform.python_version(), "interpret": interpret,
          "dtype": dtype.name, **heads, "repeats": repeats, "calls_per_sample": calls,
          "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
  if on_gpu:
    cfg["copy_GBps"] = meta["copy_bandwidth_GBps"] = common.copy_bandwidth(repeats, calls) / 1e9
  key = jax.random.PRNGKey(f.seed)
  runs = [(n, bs) for n in names for bs in block_sizes]
  results = []
  for i, (name, bs) in enumerate(common.progress(runs, desc="scenarios")):
    try:
      sweep = f.sweep and bs == block_sizes[0] and name in SWEEP_SCENARIOS
      results.append(bench_scenario(name, _expand(scenarios[name]), bs, cfg, interpret,
                                    repeats, calls, jax.random.fold_in(key, i), sweep=sweep))
    except Exception as e:  # pylint: disable=broad-except
      results.append({"scenario": name, "block_size": bs,
                      "error": f"{type(e).__name__}: {str(e)[:300]}"})
    # Rewritten after every scenario: a run cut short by a timeout keeps what it measured.
    path = common.write_json(out_dir / "ragged_bench.json", {"meta": meta, "results": results})
  rows = []
  for r in results:
    if "error" in r:
      rows.append([r["scenario"], r["block_size"], "ERROR", r["error"][:40], "", "", "", "", ""])
      continue
    t = r["timings"]
    ms = lambda n: t.get(n, {}).get("median_s", float("nan")) * 1e3
    ours = t.get("ragged_paged", {})
    rows.append([r["scenario"], r["block_size"], ms("ragged_paged"), ours.get("GBps"),
                 ours.get("fraction_of_copy_bw", float("nan")), ours.get("TFLOPs"),
                 ms("ragged_paged") / ms("ragged_contiguous"),
                 ms("dense") / ms("ragged_paged"), ms("decode_kernel") / ms("ragged_paged")])
  print(common.table(rows, ["scenario", "bs", "ms", "GB/s", "frac bw", "TFLOP/s",
                            "paged/contig", "dense/ours", "decode/ours"]))
  sweep_rows = []
  for r in results:
    t = r.get("timings", {})
    base = t.get("ragged_paged", {}).get("median_s")
    if base and any(v in t for v in SWEEP):
      sweep_rows.append([r["scenario"], r["block_size"]] + [
          t.get(v, {}).get("median_s", float("nan")) / base for v in SWEEP])
  if sweep_rows:
    print("variant time / default time:")
    print(common.table(sweep_rows, ["scenario", "bs"] + [v[len("ragged_"):] for v in SWEEP]))
  print(f"wrote {path}")


if __name__ == "__main__":
  # One runner for every experiment: one-line errors for bad flags and bad values.
  common.run_app(main, Config)
