r"""Paged decode attention vs the same attention on a contiguous cache, side by side.

    python -m experiments.kernel_bench --out=results/kernel_bench            # CPU or GPU
    python -m experiments.kernel_bench --batch=64 --context=4096 --block_size=16 --out=DIR

On CPU (jax.default_backend() != "gpu"): the reference path (pallas_kernels/reference.py)
on the paged cache, i.e. gather pages through a randomly permuted block table then attend,
vs `contiguous_decode_attention` on a contiguous cache of the same content; the ratio is
the price of paging for the reference path.

On GPU: the Pallas paged kernel (pallas_kernels.paged_attention, backend "auto": Mosaic
GPU on Hopper where it applies; the Triton kernel is also timed pinned, kernel_triton_paged,
column triton/ours) against, in the same run and on the same shapes,
  kernel_contiguous  the same kernel with an identity block table (pages in order): the
                     "paged costs <= 5% over contiguous" comparison;
  jax_paged          jax.experimental.pallas.ops.gpu.paged_attention (JAX's Triton op, same
                     [Hkv, NB, bs, D] page layout and the same permuted table);
  jax_decode         jax.experimental.pallas.ops.gpu.decode_attention on a contiguous
                     head-major cache [B, Hkv, L, D] (no transpose inside the timing);
  dense              jax.nn.dot_product_attention on a contiguous [B, L, Hkv, D] cache
                     (cuDNN when it accepts the shapes, else XLA).
Bytes of K/V actually needed (lengths * Hkv * D * 2 * itemsize) are counted first; achieved
bandwidth is those bytes over the median time, also as a fraction of the device's measured
copy bandwidth (elementwise x * 2 over a 2 GiB array: read + write).

Timing: each call is warmed up (compile + 2 runs); then `--repeats` samples, each the wall
time of `--calls_per_sample` back-to-back asynchronous calls (block_until_ready on the last)
divided by the calls; the median is reported (experiments.common.time_interleaved).
Writes DIR/kernel_bench.json and prints a table.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import platform
import time
from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import configs
import pallas_kernels
from pallas_kernels import reference

@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.kernel_bench."""
  out: str = configs.flag("results/kernel_bench", "output directory")
  batch: Optional[Tuple[int, ...]] = configs.flag(None, "batch sizes (default: CPU 1,8; GPU "
                                                  "1,8,64,256)", lower=1)
  context: Optional[Tuple[int, ...]] = configs.flag(None, "tokens per sequence (default: CPU "
                                                    "512,2048; GPU 512,4096,32768)", lower=1)
  block_size: Tuple[int, ...] = configs.flag((16, 128), "KV-cache block sizes", lower=1)
  num_q_heads: int = configs.flag(32, "query heads", lower=1)
  num_kv_heads: int = configs.flag(8, "KV heads", lower=1)
  head_dim: int = configs.flag(128, "features per head", lower=1)
  dtype: Optional[str] = configs.flag(None, "q / page dtype (default: CPU float32, GPU bfloat16)")
  repeats: Optional[int] = configs.flag(None, "timing samples per method (default CPU 5, GPU 10)",
                                        lower=1)
  calls_per_sample: Optional[int] = configs.flag(None, "calls per sample (default CPU 1, GPU 5)",
                                                 lower=1)
  max_gib: float = configs.flag(100.0, "device memory budget (GiB): configurations whose "
                                "contiguous copies would exceed it time the paged methods only",
                                lower=0.0, lower_open=True)
  seed: int = configs.flag(0, "PRNG seed")


def _ints(values, default):
  return [int(x) for x in (values if values is not None else default)]


def make_inputs(key, batch, context, block_size, hq, hkv, d, dtype):
  """Random paged cache (all sequences full to `context`), permuted + identity tables."""
  pages_per_seq = context // block_size
  num_blocks = batch * pages_per_seq
  kq, kk, kv, kp = jax.random.split(key, 4)
  q = jax.random.normal(kq, (batch, hq, d), dtype)
  k_pages = jax.random.normal(kk, (hkv, num_blocks, block_size, d), dtype)
  v_pages = jax.random.normal(kv, (hkv, num_blocks, block_size, d), dtype)
  perm = jax.random.permutation(kp, num_blocks).astype(jnp.int32)
  tables = perm.reshape(batch, pages_per_seq)
  identity = jnp.arange(num_blocks, dtype=jnp.int32).reshape(batch, pages_per_seq)
  lengths = jnp.full((batch,), context, jnp.int32)
  return q, k_pages, v_pages, tables, identity, lengths


def contiguous_head_major(pages, tables):
  """[Hkv, NB, bs, D] + tables [B, P] -> [B, Hkv, P * bs, D] with the same content."""
  hkv, _, bs, d = pages.shape
  b, p = tables.shape
  return jnp.swapaxes(pages[:, tables].reshape(hkv, b, p * bs, d), 0, 1)


def kv_bytes(lengths, hkv, d, dtype) -> int:
  return int(np.sum(np.asarray(lengths))) * hkv * d * 2 * jnp.dtype(dtype).itemsize


def bench_cpu(cfg, inputs, repeats, calls) -> Dict[str, dict]:
  q, k_pages, v_pages, tables, _, lengths = inputs
  k_c = contiguous_head_major(k_pages, tables)
  v_c = contiguous_head_major(v_pages, tables)
  paged = jax.jit(reference.paged_attention_reference)
  contig = jax.jit(reference.contiguous_decode_attention)
  out_p = paged(q, k_pages, v_pages, tables, lengths)
  out_c = contig(q, k_c, v_c, lengths)
  err = float(jnp.linalg.norm((out_p - out_c).astype(jnp.float32)) /
              jnp.linalg.norm(out_c.astype(jnp.float32)))
  res = common.time_interleaved({
      "reference_paged": (paged, (q, k_pages, v_pages, tables, lengths)),
      "reference_contiguous": (contig, (q, k_c, v_c, lengths))}, repeats, calls)
  res["reference_paged"]["rel_err_vs_contiguous"] = err
  return res


def _jax_paged_op():
  try:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged  # pylint: disable=g-import-not-at-top
    return jax_paged.paged_attention
  except ImportError:
    return None


def _jax_decode_op():
  try:
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  unbatched = getattr(jax_decode, "decode_attn_unbatched", None)
  if unbatched is None:
    return None

  def run(q, k_c, v_c, lengths):
    # q [B, Hq, D], k_c/v_c [B, Hkv, L, D]: vmap over batch and KV head, as gqa() does,
    # but on a head-major cache so no transpose is timed.
    b, hq, d = q.shape
    hkv = k_c.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    kv_len = jnp.broadcast_to(lengths[:, None], (b, hkv))
    inner = functools.partial(unbatched, sm_scale=1 / math.sqrt(d), block_h=16, block_k=128,
                              k_splits=16, num_warps=None, num_stages=2, grid=None,
                              interpret=False, debug=False, return_residuals=False,
                              normalize_output=True)
    o = jax.vmap(jax.vmap(inner))(qg, k_c, v_c, None, kv_len)
    return o.reshape(b, hq, d)
  return run


def _pow2_divisor(n: int, cap: int) -> int:
  x = 1
  while x * 2 <= cap and n % (x * 2) == 0:
    x *= 2
  return x


def bench_gpu(cfg, inputs, repeats, calls) -> Dict[str, dict]:
  q, k_pages, v_pages, tables, identity, lengths = inputs
  fns: Dict[str, tuple] = {}
  extra: Dict[str, dict] = {}
  ours = jax.jit(pallas_kernels.paged_attention)
  fns["kernel_paged"] = (ours, (q, k_pages, v_pages, tables, lengths))
  fns["kernel_contiguous"] = (ours, (q, k_pages, v_pages, identity, lengths))
  if hasattr(pallas_kernels, "GPU_BACKENDS"):
    # "auto" may pick Mosaic GPU on Hopper: time the Triton kernel too, pinned.
    triton = jax.jit(functools.partial(pallas_kernels.paged_attention, gpu_backend="triton"))
    fns["kernel_triton_paged"] = (triton, (q, k_pages, v_pages, tables, lengths))
  jax_paged = _jax_paged_op()
  if jax_paged is not None:
    p = tables.shape[1]
    k_splits = _pow2_divisor(p, 16)
    ppcb = _pow2_divisor(p // k_splits, max(1, 128 // cfg["block_size"]))
    fns["jax_paged"] = (jax.jit(functools.partial(jax_paged, k_splits=k_splits,
                                                  pages_per_compute_block=ppcb)),
                        (q, k_pages, v_pages, tables, lengths))
    extra["jax_paged"] = {"k_splits": k_splits, "pages_per_compute_block": ppcb}
  if not cfg["contiguous_baselines"]:
    return _timed(fns, extra, repeats, calls)
  # Contiguous caches hold the same content as the pages (gathered once, outside timing).
  k_c = contiguous_head_major(k_pages, tables)
  v_c = contiguous_head_major(v_pages, tables)
  jax_decode = _jax_decode_op()
  if jax_decode is not None:
    fns["jax_decode"] = (jax.jit(jax_decode), (q, k_c, v_c, lengths))
  k_bl = jnp.swapaxes(k_c, 1, 2)  # [B, L, Hkv, D]
  v_bl = jnp.swapaxes(v_c, 1, 2)
  if jax_decode is None:
    del k_c, v_c
  for impl in ("cudnn", "xla"):
    f = jax.jit(lambda q, k, v, n, impl=impl: jax.nn.dot_product_attention(
        q[:, None], k, v, key_value_seq_lengths=n, implementation=impl)[:, 0])
    try:
      jax.block_until_ready(f(q, k_bl, v_bl, lengths))
    except Exception as e:  # pylint: disable=broad-except
      extra.setdefault("dense", {})[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
      continue
    fns["dense"] = (f, (q, k_bl, v_bl, lengths))
    extra.setdefault("dense", {})["implementation"] = impl
    break
  return _timed(fns, extra, repeats, calls)


def _timed(fns, extra, repeats, calls):
  res = common.time_interleaved(fns, repeats, calls)
  for name, info in extra.items():
    res.setdefault(name, {}).update(info)
  return res


def correctness_check(on_gpu: bool) -> float:
  """Kernel (compiled on GPU, interpreted on CPU) vs the reference on a small poisoned case."""
  key = jax.random.PRNGKey(1)
  q, k, v, tables, _, _ = make_inputs(key, 4, 256, 16, 8, 2, 128, jnp.bfloat16)
  lengths = jnp.array([0, 1, 17, 256], jnp.int32)
  out = pallas_kernels.paged_attention(q, k, v, tables, lengths, interpret=not on_gpu)
  want = reference.paged_attention_reference(q, k, v, tables, lengths)
  diff = (out.astype(jnp.float32) - want.astype(jnp.float32))
  return float(jnp.linalg.norm(diff) / jnp.linalg.norm(want.astype(jnp.float32)))


def main(f: Config, out):
  """Runs with settings `f` into `out` (the `common.run_app` main)."""
  on_gpu = jax.default_backend() == "gpu"
  batches = _ints(f.batch, [1, 8, 64, 256] if on_gpu else [1, 8])
  contexts = _ints(f.context, [512, 4096, 32768] if on_gpu else [512, 2048])
  block_sizes = _ints(f.block_size, [16, 128])
  dtype = jnp.dtype(f.dtype or ("bfloat16" if on_gpu else "float32"))
  repeats = f.repeats or (10 if on_gpu else 5)
  calls = f.calls_per_sample or (5 if on_gpu else 1)
  hq, hkv, d = f.num_q_heads, f.num_kv_heads, f.head_dim
  out_dir = out

  meta = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
          "jax": jax.__version__, "python": platform.python_version(),
          "machine": platform.machine(), "dtype": dtype.name, "num_q_heads": hq,
          "num_kv_heads": hkv, "head_dim": d, "repeats": repeats,
          "calls_per_sample": calls, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                            time.gmtime())}
  meta["kernel_rel_err_bf16"] = correctness_check(on_gpu)
  if on_gpu:
    meta["copy_bandwidth_GBps"] = common.copy_bandwidth(repeats, calls) / 1e9
  results: List[dict] = []
  configs = list(itertools.product(batches, contexts, block_sizes))
  key = jax.random.PRNGKey(f.seed)
  for batch, context, bs in common.progress(configs, desc="configs"):
    if context % bs:
      continue
    cfg = {"batch": batch, "context": context, "block_size": bs}
    one_copy_gib = 2 * batch * context * hkv * d * dtype.itemsize / 2**30  # K + V once
    # Pages, then (GPU) two contiguous layouts plus a gather temporary.
    if one_copy_gib > f.max_gib:
      results.append({**cfg, "skipped": f"needs ~{one_copy_gib:.0f} GiB > --max_gib"})
      continue
    cfg["contiguous_baselines"] = (not on_gpu) or 4 * one_copy_gib <= f.max_gib
    inputs = make_inputs(jax.random.fold_in(key, len(results)), batch, context, bs, hq, hkv,
                         d, dtype)
    cfg["kv_bytes"] = kv_bytes(inputs[-1], hkv, d, dtype)
    timings = (bench_gpu if on_gpu else bench_cpu)(cfg, inputs, repeats, calls)
    for name, t in timings.items():
      if "median_s" in t:
        t["GBps"] = cfg["kv_bytes"] / t["median_s"] / 1e9
        if on_gpu:
          t["fraction_of_copy_bw"] = t["GBps"] / meta["copy_bandwidth_GBps"]
    results.append({**cfg, "timings": timings})
    del inputs

  rows = []
  for r in results:
    if "timings" not in r:
      continue
    t = r["timings"]
    med = lambda n: t.get(n, {}).get("median_s", float("nan")) * 1e3
    if on_gpu:
      rows.append([r["batch"], r["context"], r["block_size"], med("kernel_paged"),
                   t["kernel_paged"]["GBps"], t["kernel_paged"]["fraction_of_copy_bw"],
                   med("kernel_paged") / med("kernel_contiguous"),
                   med("jax_paged") / med("kernel_paged"), med("dense") / med("kernel_paged"),
                   med("kernel_triton_paged") / med("kernel_paged")])
    else:
      rows.append([r["batch"], r["context"], r["block_size"], med("reference_paged"),
                   med("reference_contiguous"),
                   med("reference_paged") / med("reference_contiguous")])
  headers = (["batch", "context", "bs", "paged ms", "GB/s", "frac copy bw",
              "paged/contig", "jax_paged/ours", "dense/ours", "triton/ours"] if on_gpu else
             ["batch", "context", "bs", "ref paged ms", "ref contig ms", "paged/contig"])
  path = common.write_json(out_dir / "kernel_bench.json", {"meta": meta, "results": results})
  print(common.table(rows, headers))
  print(f"kernel rel err (bf16, vs reference): {meta['kernel_rel_err_bf16']:.2e}")
  print(f"wrote {path}")


if __name__ == "__main__":
  # One runner for every experiment: one-line errors for bad flags and bad values.
  common.run_app(main, Config)
