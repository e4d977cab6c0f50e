"""The device-time model's FLOPs and bytes beside XLA's cost analysis of the compiled step.

    row = measure(CostCase("llama-3-8b", "decode", target="h200"))
    row["perf_model"]["flops"], row["compiled"]["flops"], row["compiled"]["declared"]["flops"]

A case is one forward pass of a paper-scale catalog model (`paged_jax.perf.catalog`:
the Llama-style ones; OPT has no implementation here) with `layers` of its layers, the
model's real vocabulary and layer shapes, bf16 pages: `rows` sequences, each either a
whole prompt of `context` tokens (prefill) or one new token at `context` tokens (decode),
the block tables exactly `context` tokens wide and a pool of `pool_scale` times the
blocks the rows use. The forward (`LlamaForCausalLM.apply`, the attention "auto" picks for
the target: Mosaic GPU on sm_90, Triton on sm_80, the TPU kernels on a TPU) is compiled
deviceless (`pallas_kernels.deviceless.target`, `pallas_kernels.tpu.compile_target`) and
XLA's cost analysis read:

  * TPU v5e / v6e: `compiled.cost_analysis()`; the Pallas kernels' `pl.CostEstimate`s
    are inside it (Mosaic TPU passes them to XLA).
  * GPU (A100 / H100 / H200): the compile-only GPU client implements no cost analysis
    (`cost_analysis()` is None on jax 0.10, an error on 0.11), so XLA's HloCostAnalysis
    is run on the compiled (optimized) GPU module through the CPU client. The Triton and
    Mosaic GPU lowerings drop the kernels' estimates: the kernels count zero there, and
    `declared` (the estimates, summed from the traced program) is added beside.

The model side: `DeviceTimeModel.counts` of the same step (`StepShape`), the catalog
model cut to `layers` layers. Units: FLOPs and bytes per step (one pass), per chip.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp

from paged_jax import config as pj_config
from paged_jax.perf import catalog
from paged_jax.perf.roofline import DeviceTimeModel
from paged_jax.perf.specs import ModelSpec
from paged_jax.perf.step import StepShape

# A small Llama-style model for tests (the catalog's are paper-scale).
TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                 head_dim=64, ffn_size=512, vocab_size=512, max_context=512,
                 source="paged_jax.bench.cost_analysis test shapes")

GPU_TARGETS = ("a100", "h100", "h200")
TPU_TARGETS = ("v5e", "v6e")
TARGETS = GPU_TARGETS + TPU_TARGETS
PHASES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class CostCase:
  """One compiled forward pass.

  Attributes:
    model: a Llama-style catalog.MODELS name. phase: "prefill" | "decode".
    target: TARGETS. layers: decoder layers compiled (the model's shapes otherwise).
    rows: sequences. context: prefill: each prompt's tokens; decode: each row's context
      after its new token. block_size: tokens per page. pool_scale: pool blocks / the
      blocks the rows use (XLA charges some pool-wide work; 2 shows how much).
  """
  model: str = "llama-3-8b"
  phase: str = "decode"
  target: str = "h200"
  layers: int = 2
  rows: int = 8
  context: int = 2048
  block_size: int = 16
  pool_scale: int = 1

  def __post_init__(self):
    if self.phase not in PHASES:
      raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
    if self.target not in TARGETS:
      raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
    pj_config.check_int("layers", self.layers, 1)
    pj_config.check_int("rows", self.rows, 1)
    pj_config.check_int("pool_scale", self.pool_scale, 1)
    if self.context % self.block_size:
      raise ValueError(f"context={self.context} must be a multiple of block_size="
                       f"{self.block_size}")

  @property
  def name(self) -> str:
    return (f"{self.model}:{self.phase}:{self.target}:L{self.layers}:R{self.rows}"
            f":C{self.context}" + ("" if self.pool_scale == 1 else f":pool{self.pool_scale}"))

  @property
  def tokens(self) -> int:
    return self.rows * (self.context if self.phase == "prefill" else 1)

  @property
  def dtype(self) -> str:
    """The model's dtype; bfloat16 for a float16 model on a TPU (its kernels take bf16 or
    f32; the same bytes per element)."""
    spec = TINY if self.model == TINY.name else catalog.model_spec(self.model)
    return ("bfloat16" if spec.dtype == "float16" and self.target in TPU_TARGETS
            else spec.dtype)

  def spec(self):
    """The catalog model cut to `layers` layers (in `dtype`)."""
    spec = TINY if self.model == TINY.name else catalog.model_spec(self.model)
    return dataclasses.replace(spec, num_layers=self.layers, dtype=self.dtype)

  def model_config(self) -> pj_config.ModelConfig:
    s = self.spec()
    if not s.gated_mlp or s.linear_bias or s.learned_positions or s.norm_vectors != 1:
      raise ValueError(f"{self.model} is not a Llama-style decoder (no implementation here)")
    return pj_config.ModelConfig(
        dtype=self.dtype, vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.ffn_size,
        num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim, tie_word_embeddings=s.tie_word_embeddings,
        max_position_embeddings=max(s.max_context, self.context))

  def cache_config(self) -> pj_config.CacheConfig:
    pages = self.context // self.block_size
    return self.model_config().cache_config(
        num_blocks=self.pool_scale * self.rows * pages, block_size=self.block_size,
        max_seqs=self.rows, max_blocks_per_seq=pages, enable_prefix_caching=False)

  def step(self) -> StepShape:
    if self.phase == "prefill":
      return StepShape.prefill([self.context] * self.rows, block_size=self.block_size)
    return StepShape.decode([self.context] * self.rows, block_size=self.block_size)


def model_counts(case: CostCase) -> Dict[str, float]:
  """The device-time model's FLOPs / bytes of the case's step (`DeviceTimeModel.counts`),
  plus "flops" and "bytes" (weights + activations + K/V: what the forward moves; the
  sampler's logits bytes are not in the compiled forward and stay apart)."""
  counts = DeviceTimeModel(model=case.spec(), gpu=catalog.gpu_spec("h200")).counts(
      case.step())
  counts["flops"] = counts["linear_flops"] + counts["attention_flops"]
  counts["bytes"] = counts["weight_bytes"] + counts["activation_bytes"] + counts["kv_bytes"]
  return counts


def _device(target: str):
  if target in GPU_TARGETS:
    from pallas_kernels.deviceless import target as gt  # pylint: disable=g-import-not-at-top
    return gt.gpu_device(target)
  from pallas_kernels.tpu import compile_target as tt  # pylint: disable=g-import-not-at-top
  return tt.tpu_devices(target)[0]


def forward_and_args(case: CostCase):
  """(jitted forward with the pages donated, ShapeDtypeStruct args on the target,
  the attention backend "auto" chose for the target)."""
  from paged_jax import kv_cache  # pylint: disable=g-import-not-at-top
  from paged_jax.attention import AttentionMetadata  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import compile as engine_compile  # pylint: disable=g-import-not-at-top
  from paged_jax.models import llama  # pylint: disable=g-import-not-at-top
  cfg, cache = case.model_config(), case.cache_config()
  sharding = jax.sharding.SingleDeviceSharding(_device(case.target))
  backend = engine_compile.step_backend("auto", cfg, cache, sharding)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
  place = lambda tree: jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
  params = place(jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0))))
  pages = place(jax.eval_shape(lambda: kv_cache.init(cache)))
  t, r = case.tokens, case.rows
  meta = AttentionMetadata(
      slot_mapping=i32(t), block_tables=i32(r, cache.max_blocks_per_seq), kv_lens=i32(r),
      cu_q_lens=i32(r + 1), num_seqs=i32(), logits_indices=i32(r),
      decode_only=case.phase == "decode")
  model = llama.LlamaForCausalLM(cfg, attention_backend=backend)
  return jax.jit(model.apply, donate_argnums=(3,)), (params, i32(t), i32(t), pages, meta), backend


def _xla_cost(compiled) -> tuple:
  """(XLA's cost analysis dict, how it was obtained)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if cost:
    return dict(cost), "compiled.cost_analysis()"
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  from jax.extend import backend as jex_backend  # pylint: disable=g-import-not-at-top
  module = compiled.runtime_executable().hlo_modules()[0]
  return (dict(_jax.hlo_module_cost_analysis(jex_backend.get_backend("cpu"), module)),
          "HloCostAnalysis of the compiled module via the CPU client (the compile-only "
          "GPU client has none)")


def _compile(fn, args, target: str):
  import contextlib  # pylint: disable=g-import-not-at-top
  context = contextlib.nullcontext()
  if target in GPU_TARGETS:
    from pallas_kernels.deviceless import target as gt  # pylint: disable=g-import-not-at-top
    context = gt.gpu_target_context(_device(target))
  with context:
    return fn.trace(*args).lower().compile()


def gather_charge(case: CostCase) -> float:
  """Bytes XLA's cost analysis charges the embedding lookup of the case's tokens, compiled
  alone for the target: a gather is charged its whole operand (the table), not the rows
  it reads, so this is the table's bytes where the forward reads `tokens` rows."""
  s = case.spec()
  sharding = jax.sharding.SingleDeviceSharding(_device(case.target))
  table = jax.ShapeDtypeStruct((s.vocab_size, s.hidden_size), jnp.dtype(s.dtype),
                               sharding=sharding)
  ids = jax.ShapeDtypeStruct((case.tokens,), jnp.int32, sharding=sharding)
  cost, _ = _xla_cost(_compile(jax.jit(lambda t, i: t[i]), (table, ids), case.target))
  return float(cost.get("bytes accessed", 0.0))


_RESULT = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\](\{[^}]*\})? "
                     r"(copy-done|slice-done|custom-call)\(")


def vmem_prefetch_bytes(hlo: str) -> int:
  """Bytes an optimized TPU module copies into VMEM (memory space S(1)) ahead of their use
  (async copy-done / slice-done and what a ConcatBitcast reassembles): XLA's cost analysis
  charges these copies on top of the HBM reads of what they copy. 0 off TPU."""
  total = 0
  for line in hlo.splitlines():
    m = _RESULT.match(line)
    if not m or "S(1)" not in (m[3] or "") or m[1] not in _ITEMSIZE:
      continue
    if m[4] == "custom-call" and 'custom_call_target="ConcatBitcast"' not in line:
      continue
    total += _ITEMSIZE[m[1]] * math.prod(int(d) for d in m[2].split(",") if d)
  return total


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}


def compiled_counts(case: CostCase) -> Dict[str, Any]:
  """Compiles the case's forward for its target; XLA's flops / bytes / transcendentals,
  the kernels' declared costs (`pallas_kernels.common.declared_cost`), compile seconds."""
  import contextlib  # pylint: disable=g-import-not-at-top
  from pallas_kernels import common  # pylint: disable=g-import-not-at-top
  fn, args, backend = forward_and_args(case)
  context = contextlib.nullcontext()
  if case.target in GPU_TARGETS:
    from pallas_kernels.deviceless import target as gt  # pylint: disable=g-import-not-at-top
    context = gt.gpu_target_context(_device(case.target))
  t0 = time.perf_counter()
  with context:
    declared = common.declared_cost(jax.make_jaxpr(fn)(*args))
  compiled = _compile(fn, args, case.target)
  compile_s = time.perf_counter() - t0
  cost, how = _xla_cost(compiled)
  return dict(backend=backend, how=how, compile_s=round(compile_s, 1),
              vmem_prefetch_bytes=vmem_prefetch_bytes(compiled.as_text()),
              flops=float(cost.get("flops", 0.0)),
              bytes=float(cost.get("bytes accessed", 0.0)),
              transcendentals=float(cost.get("transcendentals", 0.0)),
              kernels_seen=case.target in TPU_TARGETS, declared=declared)


def measure(case: CostCase) -> Dict[str, Any]:
  """One row: the case, the model's counts, the compiled counts and their ratios.

  "compiled_total_*": XLA's figure plus the declared kernel costs where XLA cannot see
  them (GPU), XLA's alone where it can (TPU). `pool_bytes`: the K/V pool (all layers);
  `gather_charge`: what XLA charges the embedding lookup (`gather_charge`)."""
  model = model_counts(case)
  compiled = compiled_counts(case)
  extra = compiled["declared"] if not compiled["kernels_seen"] else None
  total_flops = compiled["flops"] + (extra["flops"] if extra else 0)
  total_bytes = compiled["bytes"] + (extra["bytes_accessed"] if extra else 0)
  return dict(case=case.name, **dataclasses.asdict(case), tokens=case.tokens, perf_model=model,
              compiled=compiled, compiled_total_flops=total_flops,
              compiled_total_bytes=total_bytes, pool_bytes=case.cache_config().kv_cache_bytes,
              gather_charge=gather_charge(case),
              flops_ratio=_ratio(total_flops, model["flops"]))


def _ratio(a, b):
  return round(float(a) / float(b), 4) if b else None


def pool_slope(row: Dict[str, Any], bigger: Dict[str, Any]) -> float:
  """Bytes XLA charges per byte of K/V pool: two rows of one case at pool_scale 1 and 2
  (2.0: each layer's whole K and V pool read and written by the in-place K/V write)."""
  return ((bigger["compiled_total_bytes"] - row["compiled_total_bytes"])
          / (bigger["pool_bytes"] - row["pool_bytes"]))


def explain(row: Dict[str, Any], slope: float) -> Dict[str, Any]:
  """The row split into the kernels (declared) and the rest (XLA's own), each beside the
  model's part: FLOPs (linear vs XLA's rest; attention vs the kernels') and bytes (weights
  + activations vs XLA's rest net of its whole-operand charges; K/V vs the kernels').

  XLA's rest is charged `slope` x the pool where the K/V write is an XLA scatter (GPU; the
  TPU write is a kernel with its own estimate), the whole table for the embedding lookup
  (`gather_charge`) and, on TPU, the weights it prefetches into VMEM once more
  (`vmem_prefetch_bytes`); the net adds back what the program really moves there (the
  embedding rows, and the new tokens' K/V where XLA writes them)."""
  s = CostCase(**{k: row[k] for k in _CASE_FIELDS}).spec()
  c, m, d = row["compiled"], row["perf_model"], row["compiled"]["declared"]
  rest_flops = c["flops"] - (d["flops"] if c["kernels_seen"] else 0)
  rest_bytes = c["bytes"] - (d["bytes_accessed"] if c["kernels_seen"] else 0)
  real = row["tokens"] * s.hidden_size * s.dtype_bytes
  if slope > 0.5:
    real += row["tokens"] * s.kv_bytes_per_token()
  charges = slope * row["pool_bytes"] + row["gather_charge"] + c["vmem_prefetch_bytes"]
  net = rest_bytes - charges + real
  model_rest = m["weight_bytes"] + m["activation_bytes"]
  return dict(pool_slope=round(slope, 4), rest_flops=rest_flops, rest_bytes=rest_bytes,
              whole_operand_charges=charges, rest_net_bytes=net,
              linear_flops_ratio=_ratio(rest_flops, m["linear_flops"]),
              attention_flops_ratio=_ratio(d["flops"], m["attention_flops"]),
              rest_bytes_ratio=_ratio(net, model_rest),
              kernel_bytes_ratio=_ratio(d["bytes_accessed"], m["kv_bytes"]),
              total_bytes_ratio=_ratio(row["compiled_total_bytes"], m["bytes"]))


_CASE_FIELDS = tuple(f.name for f in dataclasses.fields(CostCase))
