"""Helpers shared by the deviceless H200 compile tests (gpu_compile_model_test,
draft_model_compile_test): the Llama-8B-shaped model and pools they compile, and the
readers of XLA's optimized HLO that find pool-sized copies and host readbacks.

A Bazel py_test holds its own file and tests/BUILD's test_support, so tests share code
through this module, never by importing each other.
"""

import glob
import re
import tempfile

import numpy as np

import jax.numpy as jnp

from pallas_kernels.deviceless import target as ct
from paged_jax.config import ModelConfig

# Llama-3-8B layer shapes, 2 layers, a small vocabulary (the LM head is not under test).
LLAMA8B_2L = ModelConfig(vocab_size=1024, hidden_size=4096, intermediate_size=14336,
                         num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128,
                         dtype="bfloat16")
# 512 MiB per layer per K/V.
CACHE_512M = LLAMA8B_2L.cache_config(num_blocks=16384, block_size=16, max_seqs=8,
                                     max_blocks_per_seq=256, dtype="bfloat16")
# A pool-sized buffer is anything >= this fraction of one layer's K (or V) pool.
FRACTION = 16

_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<dtype>[a-z]\w*)"
                        r"\[(?P<dims>[\d,]*)\]\S* (?P<op>[\w\-]+)\(")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def layer_pool_bytes(cache) -> int:
  """Bytes of one layer's K (or V) pages."""
  return (cache.num_kv_heads * cache.num_blocks * cache.block_size * cache.head_dim
          * jnp.dtype(cache.dtype).itemsize)


def _hlo_copies(dump_dir: str, min_bytes: int) -> list:
  """Copies and slice fusions in the optimized HLO whose result has >= min_bytes."""
  found = []
  for path in glob.glob(f"{dump_dir}/*gpu_after_optimizations.txt"):
    for line in open(path):
      m = _HLO_INSTR.match(line)
      if not m or m["dtype"] not in _BYTES:
        continue
      nbytes = int(np.prod([int(d) for d in m["dims"].split(",") if d])) * _BYTES[m["dtype"]]
      slice_fusion = m["op"] == "fusion" and "slice" in m["name"] and "update" not in m["name"]
      if nbytes >= min_bytes and (m["op"] in ("copy", "slice", "dynamic-slice")
                                  or slice_fusion):
        found.append(f"{m['name']} ({m['op']}, {nbytes} B)")
  return found


def pool_copy_findings(jitted, args, cache, *, pool_bytes_donated: int = 0,
                       keep_hlo: bool = False, **step_kw) -> tuple:
  """Compiles for sm_90; returns (report, [what is pool-sized]) (empty: no pool copy),
  plus the optimized HLO text when `keep_hlo`.

  Pool-sized: temp bytes, a launch whose threads cover >= 1/FRACTION of a layer's pool
  elements (a kernel sweeping the pool), an HLO copy/slice of that size, or (when
  `pool_bytes_donated`) donated pages that the outputs do not alias (copied into new ones).
  `step_kw`: static keywords of `jitted` (a step variant).
  """
  threshold = layer_pool_bytes(cache) // FRACTION
  elements = threshold // jnp.dtype(cache.dtype).itemsize
  with tempfile.TemporaryDirectory() as dump:
    report = ct.compile_report(jitted, *args, dump_dir=dump, **step_kw)
    findings = [f"HLO copy {c}" for c in _hlo_copies(dump, threshold)]
    hlo = "".join(open(p).read() for p in glob.glob(f"{dump}/*gpu_after_optimizations.txt"))
  if report.temp_bytes >= threshold:
    findings.append(f"temp buffers {report.temp_bytes} B >= {threshold} B")
  for l in report.launches:
    threads = int(np.prod(l.grid)) * int(np.prod(l.threads))
    if threads >= elements:
      findings.append(f"launch {l.name} grid {l.grid} x {l.threads} covers the pool")
  if pool_bytes_donated and report.alias_bytes < pool_bytes_donated:
    findings.append(f"outputs alias {report.alias_bytes} B of {pool_bytes_donated} B pages")
  return (report, findings, hlo) if keep_hlo else (report, findings)


# Prefix caching off: the step these tests were written for. With it (the default since
# issue 38) the compiled step has while loops without a known trip count and conditionals
# (the prefix cache's lookup and eviction), each a host readback on GPU: an open finding.
CACHE_4G = LLAMA8B_2L.cache_config(num_blocks=32768, block_size=16, max_seqs=8,
                                   max_blocks_per_seq=256, dtype="bfloat16",
                                   enable_prefix_caching=False)


_WHILE = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .* while\(.*op_name=\"(?P<op>[^\"]*)\"")
_COND = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = .* conditional\(.*op_name=\"(?P<op>[^\"]*)\"")


def host_readbacks(hlo: str) -> dict:
  """Loops and branches whose XLA GPU thunk copies a predicate to the host and blocks.

  XLA's WhileThunk without a `known_trip_count` copies the condition result to the host
  and calls BlockHostUntilDone every iteration; every ConditionalThunk does the same for
  its branch index (xla/backends/gpu/runtime/{while,conditional}_thunk.cc).
  Returns {"while": [op names], "conditional": [op names]}.
  """
  out = {"while": [], "conditional": []}
  for line in hlo.splitlines():
    if (m := _WHILE.match(line)) and "known_trip_count" not in line:
      out["while"].append(m["op"])
    elif (m := _COND.match(line)):
      out["conditional"].append(m["op"])
  return out
