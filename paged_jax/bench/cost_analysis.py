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
import time
from typing import Any, Dict

import jax
import jax.numpy as jnp

from paged_jax import config as pj_config
from paged_jax.perf import catalog
from paged_jax.perf.roofline import DeviceTimeModel
from paged_jax.perf.step import StepShape

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

  def spec(self):
    """The catalog model cut to `layers` layers."""
    return dataclasses.replace(catalog.model_spec(self.model), num_layers=self.layers)

  def model_config(self) -> pj_config.ModelConfig:
    s = self.spec()
    if not s.gated_mlp or s.linear_bias or s.learned_positions or s.norm_vectors != 1:
      raise ValueError(f"{self.model} is not a Llama-style decoder (no implementation here)")
    return pj_config.ModelConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.ffn_size,
        num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim, tie_word_embeddings=s.tie_word_embeddings, dtype=s.dtype,
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
  plus "flops" and "bytes" (weights + K/V: what the forward moves; the sampler's logits
  bytes are not in the compiled forward and stay apart)."""
  counts = DeviceTimeModel(model=case.spec(), gpu=catalog.gpu_spec("h200")).counts(
      case.step())
  counts["flops"] = counts["linear_flops"] + counts["attention_flops"]
  counts["bytes"] = counts["weight_bytes"] + counts["kv_bytes"]
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
    compiled = fn.trace(*args).lower().compile()
  compile_s = time.perf_counter() - t0
  cost, how = _xla_cost(compiled)
  return dict(backend=backend, how=how, compile_s=round(compile_s, 1),
              flops=float(cost.get("flops", 0.0)),
              bytes=float(cost.get("bytes accessed", 0.0)),
              transcendentals=float(cost.get("transcendentals", 0.0)),
              kernels_seen=case.target in TPU_TARGETS, declared=declared)


def measure(case: CostCase) -> Dict[str, Any]:
  """One row: the case, the model's counts, the compiled counts and their ratios.

  "compiled_total_*": XLA's figure plus the declared kernel costs where XLA cannot see
  them (GPU), XLA's alone where it can (TPU)."""
  model = model_counts(case)
  compiled = compiled_counts(case)
  extra = compiled["declared"] if not compiled["kernels_seen"] else None
  total_flops = compiled["flops"] + (extra["flops"] if extra else 0)
  total_bytes = compiled["bytes"] + (extra["bytes_accessed"] if extra else 0)
  ratio = lambda a, b: round(a / b, 4) if b else None
  return dict(case=case.name, **dataclasses.asdict(case), tokens=case.tokens, perf_model=model,
              compiled=compiled, compiled_total_flops=total_flops,
              compiled_total_bytes=total_bytes,
              flops_ratio=ratio(total_flops, model["flops"]),
              bytes_ratio=ratio(total_bytes, model["bytes"]),
              attention_flops_ratio=ratio(compiled["declared"]["flops"],
                                          model["attention_flops"]),
              non_attention_flops_ratio=ratio(
                  total_flops - compiled["declared"]["flops"], model["linear_flops"]))
