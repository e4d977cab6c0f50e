"""KvBudget: the KV cache a set of GPUs leaves after the weights, as the paper's Table 1.

Per GPU: `gpu_memory_utilization` of its memory (vLLM's default 0.9), less its shard of the
weights and a reserve for activations; the K/V slots are what that holds at the GPU's share
of a token's K/V bytes. Under tensor parallelism every GPU holds every token's K/V for its
own heads, so the slots of one GPU are the slots of the replica.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

from paged_jax import config as pj_config
from paged_jax.perf import catalog
from paged_jax.perf.specs import GpuSpec, ModelSpec


@dataclasses.dataclass(frozen=True)
class KvBudget:
  """KV memory of one model replica on `tp` GPUs.

  Attributes:
    model, gpu: catalog names (or the specs' names).
    tp: GPUs of the replica.
    gpu_memory_utilization: fraction of each GPU's memory the engine may use.
    total_bytes: memory of all `tp` GPUs.
    weight_bytes: the model's weights (all GPUs together).
    reserve_bytes: held back per GPU for activations and workspace.
    kv_bytes: K/V memory of all GPUs together.
    kv_bytes_per_token: one token's K/V over all GPUs (replicated heads counted again).
    kv_slots: tokens the K/V memory holds.
  """

  model: str
  gpu: str
  tp: int
  gpu_memory_utilization: float
  total_bytes: int
  weight_bytes: int
  reserve_bytes: int
  kv_bytes: int
  kv_bytes_per_token: int
  kv_slots: int

  def num_blocks(self, block_size: int) -> int:
    """Whole KV blocks of `block_size` tokens the budget holds."""
    pj_config.check_block_size(block_size)
    return self.kv_slots // block_size

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def kv_budget(model: Union[str, ModelSpec, pj_config.ModelConfig],
              gpu: Union[str, GpuSpec], *, tp: int = 1, kv_dtype: Optional[str] = None,
              gpu_memory_utilization: float = catalog.GPU_MEMORY_UTILIZATION,
              reserve_bytes: int = 0) -> KvBudget:
  """The KV budget `tp` GPUs of kind `gpu` leave after `model`'s weights.

  Raises a one-line ValueError when the weights leave no room for one token per GPU.
  """
  spec, dev = catalog.model_spec(model), catalog.gpu_spec(gpu)
  pj_config.check_int("tp", tp, 1, 1024)
  if spec.num_heads % tp:
    raise ValueError(f"tp must divide {spec.name}'s num_heads={spec.num_heads}, got {tp}")
  pj_config.check_int("reserve_bytes", reserve_bytes, 0)
  if not 0.0 < gpu_memory_utilization <= 1.0:
    raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
  usable = gpu_memory_utilization * dev.hbm_bytes
  weights = spec.weight_bytes / tp
  kv_heads = math.ceil(spec.num_kv_heads / tp)
  per_token = spec.kv_bytes_per_token(kv_dtype) * kv_heads / spec.num_kv_heads
  kv_per_gpu = usable - weights - reserve_bytes
  if kv_per_gpu < per_token:
    raise ValueError(
        f"{spec.name} leaves no KV memory on {tp} x {dev.name}: {weights / 1e9:.1f} GB of "
        f"weights per GPU + {reserve_bytes / 1e9:.1f} GB reserve > {usable / 1e9:.1f} GB "
        f"usable ({gpu_memory_utilization:g} of {dev.hbm_bytes / 1e9:.1f} GB); use more GPUs "
        f"(tp) or a larger GPU")
  slots = int(kv_per_gpu // per_token)
  return KvBudget(
      model=spec.name, gpu=dev.name, tp=tp, gpu_memory_utilization=gpu_memory_utilization,
      total_bytes=tp * dev.hbm_bytes, weight_bytes=spec.weight_bytes,
      reserve_bytes=reserve_bytes, kv_bytes=int(tp * kv_per_gpu),
      kv_bytes_per_token=int(round(tp * per_token)), kv_slots=slots)


def kv_shapes(model: Union[str, ModelSpec], tp: int = 1) -> pj_config.ModelConfig:
  """A ModelConfig with ONE GPU's share of `model`'s K/V shapes (its layers, the GPU's KV
  heads, head_dim, sliding window and which layers slide; nothing else of the model), for
  paged_jax's own pool sizing (`pool_config`)."""
  spec = catalog.model_spec(model)
  pj_config.check_int("tp", tp, 1, 1024)
  heads = math.ceil(spec.num_kv_heads / tp)
  types = None
  if spec.sliding_layers:
    slide = set(spec.sliding_layers)
    types = tuple("sliding_attention" if i in slide else "full_attention"
                  for i in range(spec.num_layers))
  return pj_config.ModelConfig(
      vocab_size=1, hidden_size=heads * spec.head_dim, intermediate_size=1,
      num_layers=spec.num_layers, num_heads=heads, num_kv_heads=heads,
      head_dim=spec.head_dim, max_position_embeddings=spec.max_context, dtype=spec.dtype,
      sliding_window=spec.sliding_window, layer_types=types)


def pool_config(model: Union[str, ModelSpec], budget: KvBudget, *, block_size: int,
                max_seqs: int, max_len: int, max_num_batched_tokens: int, hybrid_kv: bool,
                kv_dtype: Optional[str] = None) -> pj_config.CacheConfig:
  """The engine's KV pools for `model` in `budget`'s K/V memory (one GPU's share of it),
  sized by `pool_sizing.from_memory_budget`, as an engine sizes its own (`kv_shapes`).

  hybrid_kv False: one pool for every layer (`num_blocks` = the budget's whole blocks).
  True: both pools from the budget, the sliding-window layers' at
  `pool_sizing.sliding_pool_blocks` for `max_seqs` sequences and `max_num_batched_tokens` a
  step (the size the engine requires: every slot's window, or the main pool's blocks if
  fewer), the full-attention layers' (`num_blocks`) from the rest. Needs a model with both kinds of layer (one-line
  ValueError otherwise, or when the sliding pool leaves no block for the full layers).
  The returned CacheConfig's `num_blocks` / `num_sliding_blocks` are what the stand-in
  engine's pools get; its layer shapes are the real model's."""
  spec = catalog.model_spec(model)
  shapes = kv_shapes(spec, budget.tp)
  return pj_config.CacheConfig.from_memory_budget(
      shapes, block_size=block_size, kv_budget_bytes=int(budget.kv_bytes // budget.tp),
      max_seqs=max_seqs, max_model_len=max_len, dtype=kv_dtype or "auto",
      hybrid_kv=bool(hybrid_kv), max_num_batched_tokens=max_num_batched_tokens)
