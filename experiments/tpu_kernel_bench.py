r"""Our TPU paged-attention kernels against JAX's, side by side on one TPU.

    python -m experiments.tpu_kernel_bench --out=DIR                 # on a TPU host
    python -m experiments.tpu_kernel_bench --dry_run --out=DIR       # CPU: interpreted, tiny

Scenarios (Llama-3-8B 32/8 x 128 by default, bf16, random pages, shuffled block tables):
  decode  `--batch` sequences, one query each at `--context` tokens: our decode kernel,
          our ragged kernel on the same rows, JAX's ragged paged attention (its tuned
          block sizes, its combined K/V page layout holding the same values) and JAX's
          paged decode kernel (head-major pages like ours).
  mixed   a 256-token step: 4 prefill chunks of 48 over `--context`-token prefixes and 64
          decodes: our ragged kernel vs JAX's RPA.
Per method: median microseconds per call (calls interleaved round-robin), K/V GB/s (the
bytes the call must read over its time), % of the chip's spec HBM bandwidth, speed-up over
JAX's RPA, and the largest difference from JAX's RPA output (a correctness cross-check on
the device). --dry_run runs the kernels in the TPU interpreter on CPU at tiny sizes to
check the script; its timings mean nothing, and JAX's RPA is skipped there (it does not
run in the interpreter; pallas_kernels/tpu/jax_baselines.py).
"""

from __future__ import annotations

import functools

import dataclasses
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import configs

MODELS = {"llama8b": (32, 8, 128), "gemma": (16, 8, 256)}
CHIPS = {"TPU v5 lite": "v5e", "TPU v6 lite": "v6e", "TPU v5p": "v5p", "TPU v5": "v5p",
         "TPU v4": "v4"}


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.tpu_kernel_bench."""
  out: str = configs.flag("results/tpu_kernel_bench", "output directory")
  dry_run: bool = configs.flag(False, "CPU: TPU interpreter, tiny sizes, 1 repeat")
  scenarios: Tuple[str, ...] = configs.flag(("decode", "mixed"), "decode and/or mixed",
                                            choices=("decode", "mixed"))
  model: str = configs.flag("llama8b", "head shapes", choices=tuple(MODELS))
  batch: Tuple[int, ...] = configs.flag((8, 64, 256), "decode batch sizes", lower=1)
  context: int = configs.flag(4096, "tokens per sequence (decode) / prefix (mixed)", lower=1)
  block_size: Tuple[int, ...] = configs.flag((16, 64), "tokens per page", lower=1)
  repeats: int = configs.flag(20, "timed rounds", lower=1)
  calls: int = configs.flag(5, "calls per round", lower=1)


def _chip():
  kind = jax.devices()[0].device_kind
  return next((c for k, c in CHIPS.items() if kind.startswith(k)), None), kind


def _inputs(rng, *, seqs, hq, hkv, d, bs, context, tokens):
  """(q, k, v, tables, kv_lens, cu, num): `seqs` = [(q_len, kv_len)]; random pages."""
  pages_per_seq = -(-context // bs)
  nb = len(seqs) * pages_per_seq
  k = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((hkv, nb, bs, d)), jnp.bfloat16)
  tables = jnp.asarray(rng.permutation(nb).reshape(len(seqs), pages_per_seq), jnp.int32)
  cu = np.concatenate([[0], np.cumsum([ql for ql, _ in seqs])]).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((tokens, hq, d)), jnp.bfloat16)
  kv_lens = jnp.asarray([kl for _, kl in seqs], jnp.int32)
  return q, k, v, tables, kv_lens, jnp.asarray(cu), jnp.int32(len(seqs))


def _methods(x, *, decode, interpret, chip):
  """{name: (jitted fn, args)} for one scenario."""
  from pallas_kernels import tpu  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tpu import jax_baselines as jb  # pylint: disable=g-import-not-at-top
  q, k, v, tables, kv_lens, cu, num = x
  bs, pages = k.shape[2], tables.shape[1]
  out = {"ours_ragged": (jax.jit(functools.partial(tpu.ragged_paged_attention,
                                                   interpret=interpret)),
                         (q, k, v, tables, kv_lens, cu, num))}
  if decode:
    out["ours_decode"] = (jax.jit(functools.partial(tpu.paged_attention, interpret=interpret)),
                          (q, k, v, tables, kv_lens))
    ppcb = max(1, min(pages, 128 // bs))
    out["jax_decode"] = (jax.jit(functools.partial(jb.jax_decode,
                                                   pages_per_compute_block=ppcb)),
                         (q, k, v, tables, kv_lens))
  if not interpret:
    bkv, bq = jb.jax_rpa_block_sizes(chip, q.dtype, k.dtype, q.shape[1], k.shape[0],
                                     q.shape[2], bs, q.shape[0], pages)
    kv = jb.combined_pages(k, v)
    fn = functools.partial(jb.jax_ragged, num_kv_pages_per_block=bkv,
                           num_queries_per_block=bq, vmem_limit_bytes=64 * 2**20)
    out["jax_rpa"] = (jax.jit(lambda *a: fn(*a[:7], kv_pages=a[7])),
                      (q, k, v, tables, kv_lens, cu, num, kv))
  return out


def _run(name, x, *, decode, config, chip, peak):
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  interpret = pltpu.InterpretParams() if config.dry_run else False
  methods = _methods(x, decode=decode, interpret=interpret, chip=chip)
  if config.dry_run:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      times = common.time_interleaved(methods, 1, 1)
  else:
    times = common.time_interleaved(methods, config.repeats, config.calls)
  _, k, _, _, kv_lens, _, _ = x
  per_token = k.shape[0] * 2 * k.shape[3] * k.dtype.itemsize
  kv_bytes = int(np.sum(np.asarray(kv_lens))) * per_token
  ref = None
  if "jax_rpa" in methods and "error" not in times["jax_rpa"]:
    fn, args = methods["jax_rpa"]
    ref = np.asarray(fn(*args), np.float32)
  rows = []
  for m, t in times.items():
    row = {"scenario": name, "method": m, "kv_bytes": kv_bytes, **t}
    if "median_s" in t:
      row["us"] = t["median_s"] * 1e6
      row["kv_GBps"] = kv_bytes / t["median_s"] / 1e9
      row["pct_hbm_peak"] = 100 * kv_bytes / t["median_s"] / peak if peak else None
      if ref is not None:
        fn, args = methods[m]
        got = np.asarray(fn(*args), np.float32)[:ref.shape[0]]
        row["max_abs_diff_vs_jax_rpa"] = float(np.max(np.abs(got - ref)))
    rows.append(row)
  base = next((r["us"] for r in rows if r["method"] == "jax_rpa" and "us" in r), None)
  for r in rows:
    r["speedup_vs_jax_rpa"] = base / r["us"] if base and "us" in r else None
  return rows


def main(config, out):
  from pallas_kernels.tpu import compile_target as ct  # pylint: disable=g-import-not-at-top
  chip, kind = _chip()
  if not config.dry_run and chip is None:
    raise ValueError(f"no TPU here (device kind {kind!r}): run with --dry_run on CPU")
  peak = ct.HBM_BYTES_PER_S.get(chip) if chip else None
  hq, hkv, d = MODELS[config.model]
  batches = list(config.batch)
  block_sizes = list(config.block_size)
  context = config.context
  if config.dry_run:
    hq, hkv, batches, block_sizes, context = 8, 2, [3], [16], 40
  rng = np.random.default_rng(0)
  rows = []
  todo = [(s, bs, b) for s in config.scenarios for bs in block_sizes
          for b in (batches if s == "decode" else [0])]
  for scenario, bs, batch in common.progress(todo, desc="scenarios"):
    if scenario == "decode":
      seqs, tokens = [(1, context)] * batch, batch
      name = f"decode:B{batch}:ctx{context}:bs{bs}"
    else:
      chunk, n_dec = (48, 64) if not config.dry_run else (5, 2)
      seqs = [(chunk, context + chunk)] * 4 + [(1, context)] * n_dec
      tokens = 256 if not config.dry_run else 4 * chunk + n_dec
      name = f"mixed:4x{chunk}+{n_dec}dec:ctx{context}:bs{bs}"
    x = _inputs(rng, seqs=seqs, hq=hq, hkv=hkv, d=d, bs=bs,
                context=max(kl for _, kl in seqs), tokens=tokens)
    rows += _run(name, x, decode=scenario == "decode", config=config, chip=chip,
                 peak=peak)
  result = dict(common.run_metadata(config), device_kind=kind, chip=chip,
                hbm_peak_bytes_per_s=peak, rows=rows,
                note="dry run: interpreted on CPU, timings meaningless"
                if config.dry_run else None)
  path = common.write_json(out / "tpu_kernel_bench.json", result)
  print(common.table([[r["scenario"], r["method"], r.get("us"), r.get("kv_GBps"),
                       r.get("pct_hbm_peak"), r.get("speedup_vs_jax_rpa"),
                       r.get("max_abs_diff_vs_jax_rpa"), r.get("error")] for r in rows],
                     headers=["scenario", "method", "us", "K/V GB/s", "% HBM peak",
                              "x JAX RPA", "max |diff|", "error"]))
  print(f"-> {path}")


if __name__ == "__main__":
  common.run_app(main, Config)
