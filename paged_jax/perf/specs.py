"""What the device-time model knows about a GPU, a model and their efficiencies.

Plain frozen dataclasses with derived sizes (parameter counts, weight and K/V bytes). The
named instances and every number's source live in `catalog.py`; this module holds no
hardware or model figures of its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

from paged_jax import config as pj_config


def dtype_bytes(dtype: str) -> int:
  """Bytes per element of a dtype name from `paged_jax.config.PAGE_DTYPES`."""
  if dtype not in pj_config.PAGE_DTYPES:
    raise ValueError(f"dtype must be one of {tuple(pj_config.PAGE_DTYPES)}, got {dtype!r}")
  return pj_config.PAGE_DTYPES[dtype].itemsize


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """One accelerator's peaks (vendor datasheet figures, dense, no sparsity).

  Attributes:
    name: catalog name, e.g. "a100-40gb".
    hbm_bytes: device memory in bytes (what the driver reports as total).
    hbm_bandwidth: peak HBM bandwidth, bytes/s.
    tensor_flops: peak dense 16-bit (bf16/fp16) tensor-core FLOP/s.
    nvlink_bandwidth: NVLink bandwidth per GPU per direction, bytes/s (what a ring
      all-reduce's bus bandwidth is bounded by).
    pcie_bandwidth: host link bandwidth per direction, bytes/s (swap traffic).
    source: where the figures come from.
  """

  name: str
  hbm_bytes: int
  hbm_bandwidth: float
  tensor_flops: float
  nvlink_bandwidth: float
  pcie_bandwidth: float
  source: str = ""

  def __post_init__(self):
    for field in ("hbm_bytes", "hbm_bandwidth", "tensor_flops", "nvlink_bandwidth",
                  "pcie_bandwidth"):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"GpuSpec.{field} must be a finite number > 0, got {value!r}")

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A decoder-only transformer's shapes, enough to count its weights, FLOPs and K/V.

  Attributes:
    name: catalog name, e.g. "opt-13b".
    num_layers, hidden_size, num_heads, num_kv_heads, head_dim: as in the model's config.
    ffn_size: MLP hidden width (OPT `ffn_dim`, Llama `intermediate_size`).
    vocab_size: rows of the embedding / lm_head.
    gated_mlp: three MLP matrices (SwiGLU: gate, up, down) instead of two (fc1, fc2).
    linear_bias: every projection carries a bias (OPT).
    norm_vectors: vectors per norm: 2 for LayerNorm (scale, bias), 1 for RMSNorm.
    learned_positions: rows of a learned position table (OPT: max positions + 2), 0 for RoPE.
    tie_word_embeddings: the lm_head is the embedding matrix.
    dtype: weight / activation dtype name (bytes per element from paged_jax.config).
    max_context: longest context the model serves (tokens).
    reported_params: the parameter count the model's publisher states (None: none).
    source: where the shapes come from.
    norms_per_layer: norms in each layer (2: pre-attention and pre-MLP; Gemma-2's
      sandwich norms: 4).
    sliding_window: tokens a sliding-window layer's query sees, itself included (None:
      every layer attends to the whole context).
    sliding_layers: indices of the sliding-window layers (empty unless `sliding_window`;
      Gemma-2: every even layer, Mistral-7B v0.1: all of them). Their attention reads and
      computes over at most the window (a kernel that skips the blocks outside it, as
      FlashAttention's `window_size` does), and hybrid KV (`budget.pool_config`) gives
      their K/V a pool of their own.
  """

  name: str
  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_size: int
  vocab_size: int
  gated_mlp: bool = True
  linear_bias: bool = False
  norm_vectors: int = 1
  learned_positions: int = 0
  tie_word_embeddings: bool = False
  dtype: str = "bfloat16"
  max_context: int = 2048
  reported_params: Optional[float] = None
  source: str = ""
  norms_per_layer: int = 2
  sliding_window: Optional[int] = None
  sliding_layers: Tuple[int, ...] = ()

  def __post_init__(self):
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "ffn_size", "vocab_size", "max_context"):
      pj_config.check_int(f"ModelSpec.{field}", getattr(self, field), 1)
    pj_config.check_int("ModelSpec.learned_positions", self.learned_positions, 0)
    pj_config.check_int("ModelSpec.norms_per_layer", self.norms_per_layer, 0)
    layers = tuple(int(i) for i in self.sliding_layers)
    object.__setattr__(self, "sliding_layers", layers)
    if (self.sliding_window is None) != (not layers):
      raise ValueError(f"ModelSpec.sliding_window and sliding_layers must be set together, "
                       f"got {self.sliding_window} and {list(layers)}")
    if layers:
      pj_config.check_int("ModelSpec.sliding_window", self.sliding_window, 1)
      if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= self.num_layers:
        raise ValueError(f"ModelSpec.sliding_layers must be sorted distinct indices in "
                         f"[0, {self.num_layers}), got {list(layers)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelSpec.num_kv_heads must divide num_heads={self.num_heads}, "
                       f"got {self.num_kv_heads}")
    dtype_bytes(self.dtype)

  @classmethod
  def from_model_config(cls, cfg: pj_config.ModelConfig, name: str = "model-config",
                        source: str = "paged_jax.config.ModelConfig") -> "ModelSpec":
    """The shapes of any `ModelConfig` (a Llama-style decoder: SwiGLU MLP, RMSNorm, RoPE).

    Families with biases on q/k/v (Qwen2) read `attention_bias` when the config has it.
    """
    window = cfg.sliding_window if cfg.sliding_layers else None
    return cls(
        sliding_window=window, sliding_layers=cfg.sliding_layers,
        norms_per_layer=4 if getattr(cfg, "sandwich_norms", False) else 2,
        name=name, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        ffn_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, gated_mlp=True,
        linear_bias=bool(getattr(cfg, "attention_bias", False)), norm_vectors=1,
        tie_word_embeddings=cfg.tie_word_embeddings, dtype=cfg.dtype,
        max_context=cfg.max_position_embeddings, source=source)

  # ---- layer kinds ----

  @property
  def num_sliding_layers(self) -> int:
    return len(self.sliding_layers)

  @property
  def num_full_layers(self) -> int:
    """Layers that attend to the whole context."""
    return self.num_layers - self.num_sliding_layers

  # ---- sizes (parameters) ----

  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  @property
  def layer_matmul_params(self) -> int:
    """Weights of one layer's projections (q, k, v, o and the MLP), biases excluded."""
    h = self.hidden_size
    attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
    mlp = (3 if self.gated_mlp else 2) * h * self.ffn_size
    return attn + mlp

  @property
  def layer_params(self) -> int:
    """Every parameter of one layer: projections, their biases (if any), its norms."""
    bias = 0
    if self.linear_bias:
      bias = self.q_size + 2 * self.kv_size + self.hidden_size   # q, k, v, o
      bias += (2 if self.gated_mlp else 1) * self.ffn_size + self.hidden_size
    return (self.layer_matmul_params + bias
            + self.norms_per_layer * self.norm_vectors * self.hidden_size)

  @property
  def lm_head_params(self) -> int:
    return self.vocab_size * self.hidden_size

  @property
  def param_count(self) -> int:
    """All parameters: embeddings (and learned positions), layers, final norm, lm_head."""
    embed = self.vocab_size * self.hidden_size + self.learned_positions * self.hidden_size
    head = 0 if self.tie_word_embeddings else self.lm_head_params
    return (embed + self.num_layers * self.layer_params + self.norm_vectors * self.hidden_size
            + head)

  @property
  def dtype_bytes(self) -> int:
    return dtype_bytes(self.dtype)

  @property
  def weight_bytes(self) -> int:
    """Bytes the weights occupy in device memory."""
    return self.param_count * self.dtype_bytes

  @property
  def weight_bytes_per_pass(self) -> int:
    """Bytes one forward pass reads: every layer, the final norm and the lm_head (the
    embedding table is gathered a row per token, not read whole)."""
    read = self.num_layers * self.layer_params + self.norm_vectors * self.hidden_size
    return (read + self.lm_head_params) * self.dtype_bytes

  def activation_bytes_per_token(self, tp: int = 1) -> int:
    """HBM bytes one token's activations move in one forward pass, all layers, per GPU.

    Per layer, each GEMM reads its input and writes its output once and each elementwise
    step between GEMMs is one fused kernel (a read and a write): input norm (h in, h out);
    q, k, v GEMMs (h in each, q + 2 kv out); RoPE (q + kv in and out); the K/V write (2 kv
    in); attention (q in, q out); o-proj (q in, h out); residual add + post norm (2h in,
    2h out); MLP GEMMs (h in each, ffn out each: 2 gated, 1 not); activation (the GEMM
    outputs in, ffn out); down (ffn in, h out); residual add (2h in, h out). Under tensor
    parallelism the q / kv / ffn activations are split tp ways, the hidden ones are not.
    Checked against XLA's cost analysis of the compiled forward (experiments.cost_analysis).
    """
    h, gate = self.hidden_size, 2 if self.gated_mlp else 1
    hidden = (10 + gate + 4) * h
    split = 6 * self.q_size + 6 * self.kv_size + (2 * gate + 2) * self.ffn_size
    return self.num_layers * (hidden + split // tp) * self.dtype_bytes

  def kv_bytes_per_token(self, kv_dtype: Optional[str] = None) -> int:
    """K plus V bytes of one token over all layers, as paged_jax.config.CacheConfig counts
    them (int8 / fp8 pages add an f32 scale per head)."""
    cache = pj_config.CacheConfig(num_blocks=1, num_layers=self.num_layers,
                                  num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                  dtype=kv_dtype or self.dtype)
    return cache.kv_bytes_per_token

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(param_count=self.param_count, weight_bytes=self.weight_bytes,
               kv_bytes_per_token=self.kv_bytes_per_token())
    return out


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Fractions of peak a step's parts reach, and the fixed latencies; `fit.py` fits them.

  Attributes:
    linear_flops: projections and lm_head, of `GpuSpec.tensor_flops` (compute-bound side).
    weight_bandwidth: weight reads, of `GpuSpec.hbm_bandwidth` (memory-bound side).
    attention_flops: attention score / value products, of the tensor-core peak.
    kv_bandwidth: K/V page reads and writes by the paged attention kernels, of HBM peak.
    elementwise_bandwidth: sampler logits and copy-on-write block copies, of HBM peak.
    pcie: swap traffic, of `GpuSpec.pcie_bandwidth`.
    nvlink: all-reduce traffic, of `GpuSpec.nvlink_bandwidth`.
    pass_overhead_s: fixed seconds per forward pass (launches, host sync, scheduling).
    allreduce_latency_s: fixed seconds per all-reduce (tp > 1).
    swap_copy_latency_s: fixed seconds per host<->device copy (one per block, layer, K/V).
    row_host_s: host seconds per row of a step (a prefill chunk or a decode sequence): the
      engine's scheduling, input packing and output update for it, serial with the
      device (one host sync per step). 0 unless fitted (catalog.EFFICIENCY_SOURCES).
    source: where these values come from (the catalog's defaults, or a fit).
  """

  linear_flops: float
  weight_bandwidth: float
  attention_flops: float
  kv_bandwidth: float
  elementwise_bandwidth: float
  pcie: float
  nvlink: float
  pass_overhead_s: float
  allreduce_latency_s: float
  swap_copy_latency_s: float
  row_host_s: float = 0.0
  source: str = ""

  FRACTIONS = ("linear_flops", "weight_bandwidth", "attention_flops", "kv_bandwidth",
               "elementwise_bandwidth", "pcie", "nvlink")
  LATENCIES = ("pass_overhead_s", "allreduce_latency_s", "swap_copy_latency_s", "row_host_s")

  def __post_init__(self):
    for field in self.FRACTIONS:
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"Efficiency.{field} must be a finite number > 0, got {value!r}")
    for field in self.LATENCIES:
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"Efficiency.{field} must be a finite number >= 0, got {value!r}")

  def replace(self, **changes: Any) -> "Efficiency":
    return dataclasses.replace(self, **changes)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)
