"""Tensor-parallel paged forward: the decoder run per shard under `shard_map`.

    mesh = make_mesh(tp=4)
    tp_model = TensorParallelDecoder(model_config, mesh)
    params = tp_model.shard_params(params)            # Megatron-style placement
    pages = tp_model.init_pages(cache_config)         # born sharded by KV head
    logits, pages = jax.jit(tp_model.apply)(params, tokens, positions, pages, meta)

`apply` has the signature of `DecoderForCausalLM.apply`, so it drops into the
engine's jitted step (`engine.step.make_step(apply_fn)`): the step stays one
program, with the block manager replicated and the model sharded inside it.

Inside `shard_map` every device runs the very same `DecoderForCausalLM` code (any family:
Llama, Qwen2/2.5, Qwen3, Mistral, Gemma-2/3) on its local shards, built from a per-shard
config (num_heads / tp query heads, num_kv_heads / tp KV heads, intermediate_size / tp MLP
features; head_dim and every family field unchanged): it projects its heads (adding its
slice of the q/k/v biases, normalising each head with the replicated q_norm / k_norm),
writes their K/V into its slice of the pages (`kv_cache.write`), runs
`attention.attention_from_metadata` on its KV heads only with the layer's own sliding
window, soft cap and scale (all per head, so per shard), and multiplies by its rows of
o_proj. The row-parallel layers (`o_proj`, `down_proj`) then yield partial sums; a Flax
method interceptor all-reduces (`lax.psum` over `tp`) their outputs, the one collective per
attention and per MLP of Megatron-LM (Shoeybi et al., 2019, arXiv:1909.08053), and adds
their bias (when the family has one) once, after the sum: each shard's Dense sees a zero
bias. Embedding (with Gemma's multiplier), norms, LM head (tied or not) and the final soft
cap are replicated. Logits come out replicated; numerics differ from one device only by the
summation order of those all-reduces.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import kv_cache
from paged_jax.attention import AttentionMetadata
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.distributed import sharding
from paged_jax.distributed.mesh import TP_AXIS, tp_size, validate_tp
from paged_jax.models.decoder import DecoderForCausalLM


def shard_map(f, *, mesh: Mesh, in_specs, out_specs):
  """`jax.shard_map` where it exists (jax >= 0.6), else the experimental one.

  Replication checking is off: the attention kernel (a `pallas_call` on GPU)
  need not carry varying-axis types; correctness is tested against one device.
  """
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
  from jax.experimental.shard_map import shard_map as legacy  # pylint: disable=g-import-not-at-top
  return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def local_model_config(config: ModelConfig, tp: int) -> ModelConfig:
  """The per-shard config: heads and MLP width divided by `tp` (validated)."""
  validate_tp(config, tp)
  return dataclasses.replace(
      config, num_heads=config.num_heads // tp, num_kv_heads=config.num_kv_heads // tp,
      intermediate_size=config.intermediate_size // tp, head_dim=config.head_dim)


class TensorParallelDecoder:
  """`DecoderForCausalLM` (any family) split over a mesh's `tp` axis.

  Attributes:
    config: the full model's ModelConfig.
    mesh: a mesh with a `tp` axis (1-D, from `make_mesh(tp=...)` or `dp_submeshes`).
    tp: shards.
    local_config: the per-shard ModelConfig.
    attention_backend: passed to the model ("auto": Pallas on GPU, else the CPU custom calls).
  """

  def __init__(self, config: ModelConfig, mesh: Mesh, *, attention_backend: str = "auto"):
    if set(mesh.axis_names) != {TP_AXIS}:
      raise ValueError(
          f"{type(self).__name__} needs a 1-D ('{TP_AXIS}',) mesh, got axes "
          f"{tuple(mesh.axis_names)}; split a (dp, tp) mesh with dp_submeshes()")
    self.config = config
    self.mesh = mesh
    self.tp = tp_size(mesh)
    self.local_config = local_model_config(config, self.tp)
    self.attention_backend = attention_backend
    self._local_model = DecoderForCausalLM(self.local_config,
                                           attention_backend=attention_backend)

  # Placement ---------------------------------------------------------------------------

  def shard_params(self, params):
    """Places a full params tree Megatron-style on the mesh."""
    return sharding.shard_params(params, self.mesh)

  def init_pages(self, cache_config: CacheConfig, *, abstract: bool = False
                 ) -> kv_cache.KVPages:
    """Zero pages created directly in their sharded layout (never whole on one device);
    int8 / fp8 scales as scale rows where the mesh runs the TPU kernels. `abstract`: only
    their ShapeDtypeStructs (unplaced)."""
    validate_tp(self.config, self.tp, cache_config)
    rows = kv_cache.scale_rows_for(self.attention_backend, NamedSharding(self.mesh, P()))
    init = lambda: kv_cache.init(cache_config, scale_rows=rows)
    shapes = jax.eval_shape(init)
    if abstract:
      return shapes
    out = sharding.named(self.mesh, sharding.kv_pages_specs(shapes))
    return jax.jit(init, out_shardings=out)()

  def shard_pages(self, pages: kv_cache.KVPages) -> kv_cache.KVPages:
    """Places existing pages on the mesh, split by KV head."""
    return sharding.shard_kv_pages(pages, self.mesh)

  def replicate(self, tree):
    """Replicates `tree` (block-manager state, metadata) on the mesh."""
    return sharding.replicate(tree, self.mesh)

  # Forward -----------------------------------------------------------------------------

  def apply(self, params, tokens: jax.Array, positions: jax.Array, kv_pages: kv_cache.KVPages,
            meta: AttentionMetadata) -> Tuple[jax.Array, kv_cache.KVPages]:
    """Same contract as `DecoderForCausalLM.apply`; call it inside `jax.jit`.

    Args:
      params: the FULL params tree (sharded or not: shard_map splits it per
        `sharding.param_specs`; pass `shard_params(params)` to avoid moving it).
      tokens, positions: i32[T], replicated.
      kv_pages: KVPages split by KV head (`init_pages` / `shard_pages`).
      meta: AttentionMetadata, replicated.
    Returns:
      (f32[S, vocab] logits, replicated; new KVPages, still split by KV head).
    """
    page_specs = sharding.kv_pages_specs(kv_pages)
    num_layers = self.config.num_layers

    def local_forward(local_params, local_tokens, local_positions, local_pages, local_meta):
      local_params, row_biases = _zero_row_parallel_biases(local_params)
      reductions, biased = [], []

      def allreduce_row_parallel(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        module = context.module
        if (context.method_name == "__call__" and isinstance(module, nn.Dense)
            and module.name in sharding.ROW_PARALLEL):
          reductions.append(module.name)
          out = lax.psum(out, TP_AXIS)
          bias = row_biases.get(tuple(module.path))
          if bias is not None:   # once, after the sum (the Dense added a zero bias)
            biased.append(module.name)
            out = out + bias.astype(out.dtype)
        return out

      with nn.intercept_methods(allreduce_row_parallel):
        logits, new_pages = self._local_model.apply(
            local_params, local_tokens, local_positions, local_pages, local_meta)
      if len(reductions) != 2 * num_layers or len(biased) != len(row_biases):
        # A renamed projection would otherwise silently give wrong (un-reduced) outputs.
        raise RuntimeError(
            f"expected {2 * num_layers} row-parallel all-reduces ({sharding.ROW_PARALLEL} per "
            f"layer) adding {len(row_biases)} biases, intercepted {len(reductions)} adding "
            f"{len(biased)}: the model's module names changed")
      return logits, new_pages

    sharded = shard_map(
        local_forward, mesh=self.mesh,
        in_specs=(sharding.param_specs(params), P(), P(), page_specs, P()),
        out_specs=(P(), page_specs))
    return sharded(params, tokens, positions, kv_pages, meta)


# The first family's name, kept for existing callers.
TensorParallelLlama = TensorParallelDecoder


def _zero_row_parallel_biases(params):
  """(params with o_proj / down_proj biases zeroed, {module path: bias}).

  A row-parallel layer's per-shard output is a partial sum; its bias belongs to the sum,
  so each shard's Dense gets zeros (adding 0 is exact) and the interceptor adds the bias
  once after the psum. Module paths are Flax's (`module.path`, without the "params"
  collection), e.g. ("model", "layers_0", "self_attn", "o_proj").
  """
  biases = {}

  def strip(path, x):
    names = sharding.path_names(path)
    if not sharding.is_row_parallel_bias(names):
      return x
    biases[names[1:-1]] = x
    return jnp.zeros_like(x)

  return jax.tree_util.tree_map_with_path(strip, params), biases


def cache_config_for_device_budget(model_config: ModelConfig, tp: int,
                                   kv_bytes_per_device: int, **kwargs) -> CacheConfig:
  """CacheConfig whose pages fill `kv_bytes_per_device` on each of `tp` devices.

  Each device holds 1/tp of every block (its KV heads), so the pool gets tp
  times the blocks one device could hold. kwargs go to
  `CacheConfig.from_memory_budget` (block_size, max_seqs, max_model_len, dtype).
  """
  validate_tp(model_config, tp)
  return CacheConfig.from_memory_budget(model_config, kv_budget_bytes=kv_bytes_per_device * tp,
                                        **kwargs)


def num_params_per_device(params_sharded: Any) -> dict:
  """{device: parameter bytes held} for a placed params tree."""
  return sharding.per_device_bytes(params_sharded)
