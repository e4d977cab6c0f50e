r"""The compute floor of a generation workload on this machine: how fast ANY engine
could run it if it did nothing but the model's matrix multiplies at the rate this
CPU sustains for them. An engine-vs-engine ratio cannot exceed
(peer seconds) / (floor seconds), whatever the engine does.

    floor = compute_floor(model_config, prompt_lens, max_new_tokens, token_batches=(64, 256))
    floor["floor_s"], floor["gemm_gflops"]["jax"][64], floor["workload_gflop"]

FLOPs (multiply-adds x 2), counted for the fewest tokens any engine must compute:
every prompt token once, then each generated token but the last fed back once.
  * dense: 2 x (q, k, v, o, gate, up, down projections + lm_head) weights per token;
  * attention: 4 x heads x head_dim x (context length) per token per layer (QK^T and
    PV over the causal prefix).
GEMM rate: the model's projection chain (the same shapes, float32) on a [T, hidden]
activation, jitted in JAX and in torch (when installed), the best of `repeats` calls,
for each T in `token_batches` (decode-sized and prefill-sized batches).
`attention_cost` times, beside it, the attention this platform's engine runs per layer
(decode and mixed steps), which the floor leaves out: where the engine's time goes
that no GEMM accounts for. `kernel_floor` turns those per-layer times into the time
the engine's own kernels need for the workload with perfect batching: the bound its
attention and GEMMs set, before any padding, partial batch or host work.
"""

from __future__ import annotations

import time
from typing import Dict, Sequence

import numpy as np


def _projection_shapes(c) -> list:
  """(in, out) of every matmul of one forward token, in order (all layers + lm_head)."""
  hd = c.head_dim or c.hidden_size // c.num_heads
  q, kv = c.num_heads * hd, c.num_kv_heads * hd
  layer = [(c.hidden_size, q + 2 * kv), (q, c.hidden_size),
           (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size)]
  return layer * c.num_layers + [(c.hidden_size, c.vocab_size)]


def workload_flops(c, prompt_lens: Sequence[int], max_new_tokens: int) -> Dict[str, float]:
  """FLOPs of the fewest tokens an engine must compute for this workload."""
  dense_per_token = 2 * sum(i * o for i, o in _projection_shapes(c))
  hd = c.head_dim or c.hidden_size // c.num_heads
  tokens, attn = 0, 0.0
  for p in prompt_lens:
    n = p + max_new_tokens - 1          # tokens fed through the model
    tokens += n
    attn += 4.0 * c.num_heads * hd * c.num_layers * n * (n + 1) / 2   # sum of contexts 1..n
  return {"tokens": tokens, "dense": float(dense_per_token) * tokens, "attention": attn,
          "total": float(dense_per_token) * tokens + attn}


def _weights_for(shapes, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((i, o), np.float32) * 0.02 for i, o in shapes]


def _weights(c, seed: int = 0):
  return _weights_for(_projection_shapes(c), seed)


def _chain_jax(ws, t: int, repeats: int) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  @jax.jit
  def chain(ws, x):
    acc = jnp.zeros((), jnp.float32)
    for w in ws:   # each projection reads an activation of its own input width
      y = x[:, :w.shape[0]] @ w
      acc = acc + y[0, 0]
    return acc

  width = max(w.shape[0] for w in ws)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((t, width), np.float32))
  ws = [jnp.asarray(w) for w in ws]
  chain(ws, x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    chain(ws, x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return best


def _chain_torch(ws, t: int, repeats: int, threads: int) -> float:
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  rng = np.random.default_rng(1)
  xs = {w.shape[0]: torch.from_numpy(rng.standard_normal((t, w.shape[0]), np.float32))
        for w in ws}   # contiguous activations, one per input width
  tw = [torch.from_numpy(w) for w in ws]
  best = float("inf")
  with torch.inference_mode():
    for _ in range(repeats + 1):
      t0 = time.perf_counter()
      for w in tw:
        torch.mm(xs[w.shape[0]], w)
      best = min(best, time.perf_counter() - t0)
  return best


def attention_cost(c, *, rows: int, kv_len: int, block_size: int, num_tokens: int,
                   repeats: int = 5) -> Dict[str, float]:
  """Milliseconds per layer of the attention the engine runs on this platform
  (`attention_backend="auto"`), best of `repeats`, next to the same step's projection
  GEMMs (one layer): a decode step of `rows` rows over `kv_len` cached tokens each, and a
  mixed step of `num_tokens` new tokens spread evenly over those rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from paged_jax import attention  # pylint: disable=g-import-not-at-top
  hd = c.head_dim or c.hidden_size // c.num_heads
  width = -(-kv_len // block_size)
  num_blocks = rows * width
  rng = np.random.default_rng(2)
  pages = [jnp.asarray(rng.standard_normal((c.num_kv_heads, num_blocks, block_size, hd),
                                           np.float32)) for _ in range(2)]
  tables = jnp.asarray(rng.permutation(num_blocks).reshape(rows, width), jnp.int32)
  lens = jnp.full((rows,), kv_len, jnp.int32)
  q_dec = jnp.asarray(rng.standard_normal((rows, c.num_heads, hd), np.float32))
  q_mix = jnp.asarray(rng.standard_normal((num_tokens, c.num_heads, hd), np.float32))
  per_row = num_tokens // rows
  cu = jnp.asarray(np.arange(rows + 1) * per_row, jnp.int32)
  decode = jax.jit(lambda q, k, v, t, n: attention.paged_attention(q, k, v, t, n))
  mixed = jax.jit(lambda q, k, v, t, n, cu: attention.ragged_paged_attention(
      q, k, v, t, n, cu, rows))

  def best(fn, *args):
    jax.block_until_ready(fn(*args))
    out = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      out = min(out, time.perf_counter() - t0)
    return out * 1e3

  layer = _projection_shapes(c)[:4]
  return {"backend": attention.resolve_backend("auto"), "rows": rows, "kv_len": kv_len,
          "num_tokens": num_tokens,
          "decode_ms_per_layer": best(decode, q_dec, *pages, tables, lens),
          "mixed_ms_per_layer": best(mixed, q_mix, *pages, tables, lens, cu),
          "decode_gemm_ms_per_layer": _chain_jax(_weights_for(layer), rows, repeats) * 1e3,
          "mixed_gemm_ms_per_layer": _chain_jax(_weights_for(layer), num_tokens, repeats) * 1e3}


def kernel_floor(attention: Dict[str, float], num_layers: int, prompt_lens: Sequence[int],
                 max_new_tokens: int) -> Dict[str, float]:
  """Seconds the engine's kernels need for the workload if every prompt token ran in a
  full mixed step of `attention["num_tokens"]` tokens and every fed-back token in a
  full decode step of `attention["rows"]` rows, at the per-layer attention + projection
  GEMM times `attention_cost` measured (lm_head, sampling and host work left out).

  Returns {"prefill_s", "decode_s", "kernel_floor_s"}. No engine built on these kernels
  runs faster on this machine; the distance from `floor_s` to here is the kernels'
  (attention's K/V traffic, GEMM efficiency at these batch sizes), the distance from
  here to a measured run is batching (padding, ramp-up and drain) and host work.
  """
  prompt_tokens = sum(prompt_lens)
  decode_tokens = len(prompt_lens) * (max_new_tokens - 1)   # each fed back once, not the last
  per_mixed_token = ((attention["mixed_ms_per_layer"] + attention["mixed_gemm_ms_per_layer"])
                     / attention["num_tokens"])
  per_decode_token = ((attention["decode_ms_per_layer"] + attention["decode_gemm_ms_per_layer"])
                      / attention["rows"])
  prefill_s = num_layers * prompt_tokens * per_mixed_token / 1e3
  decode_s = num_layers * decode_tokens * per_decode_token / 1e3
  return {"prefill_s": prefill_s, "decode_s": decode_s, "kernel_floor_s": prefill_s + decode_s}


def compute_floor(c, prompt_lens: Sequence[int], max_new_tokens: int, *,
                  token_batches: Sequence[int] = (64, 256), repeats: int = 5,
                  torch_threads: int = 0) -> Dict:
  """The workload's FLOPs, the measured GEMM rates and the floor time (see module doc).

  `floor_s` uses the fastest measured rate of any library and batch: a lower bound on
  any engine's time on this machine (the floor ignores attention's memory traffic,
  sampling and all host work)."""
  import os  # pylint: disable=g-import-not-at-top
  flops = workload_flops(c, prompt_lens, max_new_tokens)
  ws = _weights(c)
  per_token = 2.0 * sum(w.size for w in ws)
  rates = {"jax": {}}
  for t in token_batches:
    rates["jax"][t] = per_token * t / _chain_jax(ws, t, repeats) / 1e9
  try:
    __import__("torch")
    rates["torch"] = {t: per_token * t / _chain_torch(ws, t, repeats,
                                                      torch_threads or os.cpu_count()) / 1e9
                      for t in token_batches}
  except ImportError:
    pass
  best = max(r for lib in rates.values() for r in lib.values())
  return {"workload_gflop": flops["total"] / 1e9, "dense_gflop": flops["dense"] / 1e9,
          "attention_gflop": flops["attention"] / 1e9, "tokens_computed": flops["tokens"],
          "gemm_gflops": {lib: {str(t): r for t, r in v.items()} for lib, v in rates.items()},
          "best_gemm_gflops": best, "floor_s": flops["total"] / 1e9 / best}
