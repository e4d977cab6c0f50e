"""Frozen, hashable configuration objects, validated on construction.

`CacheConfig` fixes every shape of the paged KV cache and of the block manager's
state, so it can be a static argument of `jax.jit`. `ModelConfig` describes a
decoder of any supported family (Llama, Qwen2/2.5, Qwen3, Mistral, Gemma-2, Gemma-3 text);
`ModelConfig.from_hf_config` reads a Hugging Face `config.json` dictionary (the per-family
translation lives in `hf_config.py`). How many blocks a pool gets (from a memory budget; hybrid
KV's sliding pool) is `pool_sizing.py`; the int checks and `cdiv` are `checks.py`.

Errors name the argument and the allowed range, and are raised before any device
work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np

from paged_jax import eviction_policy
from paged_jax import hf_config
from paged_jax import pool_sizing
# Re-exported: callers import these from config (`checks` is the floor under config).
from paged_jax.checks import cdiv, check_block_size, check_int  # pylint: disable=unused-import
from paged_jax.hf_config import parse_rope_scaling
from paged_jax.pool_sizing import (sliding_blocks_per_seq,  # pylint: disable=unused-import
                                   sliding_pool_blocks)

# Status codes returned per slot by every block-manager / engine op (int32).
OK = 0
OUT_OF_BLOCKS = 1
TOO_LONG = 2
INVALID = 3
STATUS_NAMES = {OK: "OK", OUT_OF_BLOCKS: "OUT_OF_BLOCKS", TOO_LONG: "TOO_LONG", INVALID: "INVALID"}

# K/V page dtypes by name (the one table in paged_jax; pallas_kernels keeps its own since it
# cannot import paged_jax). Quantized pages carry an f32 scale per token per head.
PAGE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
               "float16": np.dtype(np.float16), "int8": np.dtype(np.int8),
               "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
QUANTIZED_PAGE_DTYPES = ("int8", "float8_e4m3fn")
# Parameter / activation dtypes of a model (also the K/V page dtype it gets by default).
MODEL_DTYPES = ("float32", "bfloat16", "float16")


class OutOfBlocksError(RuntimeError):
  """Raised by host-side wrappers when the cache has too few free blocks."""


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Shapes of the paged KV cache and the block manager's state.

  Attributes:
    block_size: tokens per KV-cache block (a power of two, 1..1024).
    num_blocks: physical blocks in the pool (>= 1).
    max_seqs: sequence slots (rows of the block table, >= 1).
    max_blocks_per_seq: block-table columns; a sequence holds at most
      `max_blocks_per_seq * block_size` tokens.
    num_layers: decoder layers whose K/V live in the cache.
    num_kv_heads: K/V heads per layer.
    head_dim: features per head.
    dtype: K/V page dtype name: float32, bfloat16, float16, int8, float8_e4m3fn
      (int8/fp8 pages carry per-token scales).
    enable_prefix_caching: keep hashes and token ids of full blocks so later
      requests can reuse them. None (the default) is on, as in vLLM v1 (with hybrid KV
      too: `prefix_cache.sliding`); resolved to a bool on construction. Its cost when every lookup misses, and its gain when
      prompts share a prefix: docs/notes/prefix_cache_miss.md.
    eviction_policy: which cache-only block the prefix cache evicts first, a name in
      `eviction_policy.EVICTION_POLICIES`: "lru" (default) or "protect_shallow"
      (deepest blocks first, so shared prefix heads stay); docs/extending.md.
    sliding_layers: hybrid KV (off when empty): the sliding-window layers whose K/V live
      in a second pool of `num_sliding_blocks` blocks with its own block table, from
      which each sequence's blocks that slid out of its window return to that pool
      every step (`paged_jax.block_window`); the other layers keep every block in the
      main pool of `num_blocks`. Sorted layer indices; at least one layer stays full.
    sliding_window: tokens a sliding layer's query sees (itself included), >= 1; set
      iff `sliding_layers` is.
    num_sliding_blocks: blocks of the sliding pool (hybrid KV only; the engine needs
      `sliding_pool_blocks(...)`, at most `num_blocks`, so that pool never runs short).
    num_host_blocks: blocks of the prefix cache's host tier (0: none; needs prefix
      caching, without hybrid KV): blocks the device cache evicts are kept in host memory
      and come back on a later hit (`paged_jax.engine.tier`).
  """

  block_size: int = 16
  num_blocks: int = 256
  max_seqs: int = 8
  max_blocks_per_seq: int = 64
  num_layers: int = 1
  num_kv_heads: int = 1
  head_dim: int = 64
  dtype: str = "float32"
  enable_prefix_caching: Optional[bool] = None
  sliding_layers: Tuple[int, ...] = ()
  sliding_window: Optional[int] = None
  num_sliding_blocks: int = 0
  eviction_policy: str = "lru"
  num_host_blocks: int = 0

  def __post_init__(self):
    check_block_size(self.block_size)
    check_int("num_blocks", self.num_blocks, 1, 2**31 - 1)
    check_int("max_seqs", self.max_seqs, 1, 2**20)
    check_int("max_blocks_per_seq", self.max_blocks_per_seq, 1, 2**20)
    check_int("num_layers", self.num_layers, 1, 1024)
    check_int("num_kv_heads", self.num_kv_heads, 1, 1024)
    check_int("head_dim", self.head_dim, 1, 1024)
    if self.dtype not in PAGE_DTYPES:
      raise ValueError(f"dtype must be one of {tuple(PAGE_DTYPES)}, got {self.dtype!r}")
    eviction_policy.check(self.eviction_policy)
    if self.num_blocks * self.block_size > 2**31 - 1:
      # Flat cache slots (block * block_size + offset) are int32 inside jit.
      raise ValueError(
          f"num_blocks * block_size must be <= 2**31 - 1 (int32 cache slots), got "
          f"{self.num_blocks} * {self.block_size}")
    if self.max_seq_len > 2**30:
      raise ValueError(
          f"max_blocks_per_seq * block_size must be <= 2**30, got {self.max_seq_len}")
    if self.enable_prefix_caching is None:   # on by default, with hybrid KV too
      object.__setattr__(self, "enable_prefix_caching", True)
    elif not isinstance(self.enable_prefix_caching, bool):
      raise TypeError(f"enable_prefix_caching must be a bool or None, got "
                      f"{type(self.enable_prefix_caching).__name__}")
    # Hybrid KV fields: all set or all off (`pool_sizing.check_sliding_fields`).
    object.__setattr__(self, "sliding_layers", pool_sizing.check_sliding_fields(self))
    pool_sizing.check_host_blocks(self)

  @property
  def max_seq_len(self) -> int:
    """Most tokens one sequence can hold."""
    return self.max_blocks_per_seq * self.block_size

  @property
  def num_slots(self) -> int:
    """Token slots in the whole pool (`num_blocks * block_size`)."""
    return self.num_blocks * self.block_size

  @property
  def quantized(self) -> bool:
    return self.dtype in QUANTIZED_PAGE_DTYPES

  @property
  def kv_bytes_per_token(self) -> int:
    """Bytes of K plus V per cached token over all layers (scales included)."""
    elem = PAGE_DTYPES[self.dtype].itemsize
    per = 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem
    if self.quantized:
      per += 2 * self.num_layers * self.num_kv_heads * 4  # f32 scale per token per head
    return per

  @property
  def kv_cache_bytes(self) -> int:
    """Bytes of every K/V page (both pools with hybrid KV; scales included)."""
    per_layer_token = self.kv_bytes_per_token // self.num_layers
    full = (self.num_layers - len(self.sliding_layers)) * self.num_slots
    return per_layer_token * (full + len(self.sliding_layers) * self.num_sliding_blocks
                              * self.block_size)

  @property
  def hybrid(self) -> bool:
    """Hybrid KV is on: `sliding_layers` have a pool of their own."""
    return bool(self.sliding_layers)

  @property
  def full_layers(self) -> Tuple[int, ...]:
    """Layers whose K/V live in the main pool (every layer without hybrid KV)."""
    return tuple(i for i in range(self.num_layers) if i not in self.sliding_layers)

  def sliding_pool(self) -> "CacheConfig":
    """The sliding pool's shapes as a plain CacheConfig (its layers, its blocks)."""
    return dataclasses.replace(self, num_layers=len(self.sliding_layers),
                               num_blocks=self.num_sliding_blocks, sliding_layers=(),
                               sliding_window=None, num_sliding_blocks=0)

  def full_pool(self) -> "CacheConfig":
    """The main pool's shapes as a plain CacheConfig (the full-attention layers)."""
    return dataclasses.replace(self, num_layers=len(self.full_layers), sliding_layers=(),
                               sliding_window=None, num_sliding_blocks=0)

  def blocks_for(self, num_tokens: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return cdiv(num_tokens, self.block_size)

  def replace(self, **changes) -> "CacheConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_memory_budget(cls, model: "ModelConfig", **kwargs) -> "CacheConfig":
    """Sizes the block pool like a serving system: as many blocks as a memory budget
    holds; keywords and defaults: `pool_sizing.from_memory_budget`."""
    return pool_sizing.from_memory_budget(model, **kwargs)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer: Llama and the families that differ from it by the fields
  below (Qwen2 / Qwen2.5, Qwen3, Mistral, Gemma-2, Gemma-3 text). The defaults are Llama's;
  `from_hf_config` sets the rest from a Hugging Face config.json (see `paged_jax.hf_config`).

  Attributes:
    vocab_size: tokens in the vocabulary.
    hidden_size: model width.
    intermediate_size: gated-MLP hidden width.
    num_layers: decoder layers.
    num_heads: query heads.
    num_kv_heads: K/V heads (GQA when < num_heads; must divide num_heads).
    head_dim: features per head (default hidden_size // num_heads).
    rope_theta: RoPE base (of the full-attention layers).
    rms_norm_eps: RMSNorm epsilon.
    max_position_embeddings: longest supported position.
    tie_word_embeddings: lm_head shares the embedding matrix.
    rope_scaling: RoPE scaling of the full-attention layers (sorted (key, value) items of HF's
      `rope_scaling`; None for plain RoPE); see `rope_inv_freq`.
    dtype: activation/parameter dtype name.
    model_type: the HF family (`hf_config.MODEL_TYPES`); names the config.json written.
    hidden_act: MLP gate activation: "silu" (SwiGLU), "gelu_pytorch_tanh" (GeGLU, tanh
      approximation; Gemma), "gelu" (exact erf). HF `hidden_act` / `hidden_activation`.
    qkv_bias: q/k/v projections carry biases (Qwen2 always; HF `attention_bias` elsewhere).
    o_proj_bias: o_proj carries a bias (HF `attention_bias`, except Qwen2: never).
    mlp_bias: gate/up/down projections carry biases (HF Llama `mlp_bias`).
    qk_norm: RMSNorm over head_dim on each query and key head before RoPE (Qwen3, Gemma-3;
      params `q_norm`, `k_norm`).
    rms_norm_unit_offset: every RMSNorm scales by (1 + weight) instead of weight (Gemma).
    sandwich_norms: Gemma's four norms per layer: x + post_attention_layernorm(attn(
      input_layernorm(x))), then x + post_feedforward_layernorm(mlp(
      pre_feedforward_layernorm(x))). False: Llama's pre-norms (input_layernorm,
      post_attention_layernorm before the MLP).
    embedding_multiplier: embeddings are multiplied by this, rounded to `dtype` as HF does
      (Gemma: sqrt(hidden_size); derived from the family, no HF key).
    query_pre_attn_scalar: attention scores scale by query_pre_attn_scalar ** -0.5 (Gemma);
      None: head_dim ** -0.5. HF `query_pre_attn_scalar`.
    attn_logit_softcapping: attention scores become c * tanh(s / c) after scaling (Gemma-2);
      None: off. HF `attn_logit_softcapping`.
    final_logit_softcapping: logits become c * tanh(logits / c) (Gemma-2, optionally Gemma-3);
      None: off. HF `final_logit_softcapping`.
    sliding_window: tokens a sliding-window layer's query sees (itself included; keys at
      positions > p - sliding_window). HF `sliding_window` (Qwen: only with
      `use_sliding_window`).
    layer_types: per layer "full_attention" or "sliding_attention" (HF `layer_types`, or
      derived as transformers does: Mistral every layer, Qwen layers >= `max_window_layers`,
      Gemma-2 alternating from a sliding layer 0, Gemma-3 every `sliding_window_pattern`-th
      layer full). None: every layer sliding when `sliding_window` is set, else full.
    sliding_rope_theta: RoPE base of the sliding-window layers, which then use plain RoPE
      without `rope_scaling` (Gemma-3's local base, HF `rope_local_base_freq` /
      `rope_parameters.sliding_attention.rope_theta`); None: the same RoPE as full layers.
  """

  vocab_size: int = 256
  hidden_size: int = 128
  intermediate_size: int = 352
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 0
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  rope_scaling: Optional[Tuple[Tuple[str, Any], ...]] = None
  dtype: str = "float32"
  model_type: str = "llama"
  hidden_act: str = "silu"
  qkv_bias: bool = False
  o_proj_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  rms_norm_unit_offset: bool = False
  sandwich_norms: bool = False
  embedding_multiplier: float = 1.0
  query_pre_attn_scalar: Optional[float] = None
  attn_logit_softcapping: Optional[float] = None
  final_logit_softcapping: Optional[float] = None
  sliding_window: Optional[int] = None
  layer_types: Optional[Tuple[str, ...]] = None
  sliding_rope_theta: Optional[float] = None

  def __post_init__(self):
    check_int("vocab_size", self.vocab_size, 1)
    check_int("hidden_size", self.hidden_size, 1)
    check_int("intermediate_size", self.intermediate_size, 1)
    check_int("num_layers", self.num_layers, 1, 1024)
    check_int("num_heads", self.num_heads, 1, 1024)
    check_int("num_kv_heads", self.num_kv_heads, 1, self.num_heads)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_kv_heads must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
    if self.head_dim == 0:
      if self.hidden_size % self.num_heads:
        raise ValueError(
            f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            " when head_dim is not given")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    check_int("head_dim", self.head_dim, 1, 1024)
    check_int("max_position_embeddings", self.max_position_embeddings, 1)
    if not self.rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
    if isinstance(self.rope_scaling, Mapping):  # accept the HF dict form too
      object.__setattr__(self, "rope_scaling", parse_rope_scaling(dict(self.rope_scaling)))
    else:
      parse_rope_scaling(dict(self.rope_scaling or ()))
    self._check_variants()

  def _check_variants(self):
    """Validates the family fields (one-line errors naming the field)."""
    if self.dtype not in MODEL_DTYPES:
      raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
    if self.model_type not in hf_config.MODEL_TYPES:
      raise ValueError(f"model_type must be one of {hf_config.MODEL_TYPES}, "
                       f"got {self.model_type!r}")
    if self.hidden_act not in ("silu", "gelu_pytorch_tanh", "gelu"):
      raise ValueError("hidden_act must be one of ('silu', 'gelu_pytorch_tanh', 'gelu'), "
                       f"got {self.hidden_act!r}")
    for name in ("embedding_multiplier", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "sliding_rope_theta"):
      value = getattr(self, name)
      if (value is not None or name == "embedding_multiplier") and not (
          isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a number > 0 (or None to disable), got {value!r}")
    if self.sliding_window is not None:
      check_int("sliding_window", self.sliding_window, 1)
    if self.layer_types is not None:
      types = tuple(self.layer_types)
      object.__setattr__(self, "layer_types", types)   # hashable even when given a list
      if len(types) != self.num_layers or not set(types) <= set(hf_config.LAYER_TYPES):
        raise ValueError(f"layer_types must list num_layers={self.num_layers} of "
                         f"{hf_config.LAYER_TYPES}, got {list(types)}")
      if hf_config.SLIDING in types and self.sliding_window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is None")

  def layer_sliding_window(self, layer: int) -> Optional[int]:
    """Sliding window (tokens) of decoder layer `layer`, or None for full attention."""
    if self.sliding_window is None:
      return None
    if self.layer_types is None or self.layer_types[layer] == hf_config.SLIDING:
      return self.sliding_window
    return None

  @property
  def attention_scale(self) -> Optional[float]:
    """Softmax scale of the attention scores; None means head_dim ** -0.5."""
    if self.query_pre_attn_scalar is None:
      return None
    return float(self.query_pre_attn_scalar) ** -0.5

  def rope_inv_freq(self, sliding: bool = False) -> np.ndarray:
    """f32[head_dim // 2] RoPE inverse frequencies, with the configured scaling
    (`hf_config.rope_inv_freq`); pairs (i, i + head_dim/2) rotate by
    `position * inv_freq[i]` (HF rotate_half). `sliding=True`: those of sliding-window
    layers (plain RoPE of base `sliding_rope_theta` when that is set)."""
    if sliding and self.sliding_rope_theta is not None:
      return hf_config.rope_inv_freq(self.sliding_rope_theta, self.head_dim, None)
    return hf_config.rope_inv_freq(self.rope_theta, self.head_dim, self.rope_scaling)

  @property
  def sliding_rope_differs(self) -> bool:
    """True when sliding-window layers rotate with other frequencies than full layers."""
    return self.sliding_rope_theta is not None and any(
        self.layer_sliding_window(i) is not None for i in range(self.num_layers))

  @classmethod
  def from_hf_config(cls, cfg: Mapping[str, Any], dtype: str = "float32") -> "ModelConfig":
    """Builds from a Hugging Face `config.json` dictionary of any supported family
    (`hf_config.MODEL_TYPES`); ValueError naming the key for anything unsupported."""
    return cls(**hf_config.model_fields(cfg), dtype=dtype)

  def to_hf_config(self) -> dict:
    """The family's config.json dictionary; ValueError if `model_type`'s config.json cannot
    express these fields (e.g. qk_norm on a Llama)."""
    hf = hf_config.config_json(dataclasses.asdict(self))
    back = dataclasses.asdict(ModelConfig.from_hf_config(hf, dtype=self.dtype))
    lost = [k for k, v in dataclasses.asdict(self).items() if back[k] != v]
    if lost:
      raise ValueError(f"model_type={self.model_type!r} config.json cannot express "
                       + ", ".join(f"{k}={getattr(self, k)!r}" for k in lost))
    return hf

  @property
  def sliding_layers(self) -> Tuple[int, ...]:
    """Indices of the sliding-window layers (empty when every layer is full)."""
    return tuple(i for i in range(self.num_layers) if self.layer_sliding_window(i) is not None)

  def cache_config(self, *, hybrid_kv: Optional[bool] = None,
                   max_num_batched_tokens: int = 256, decode_steps_per_sync: int = 1,
                   **kwargs) -> CacheConfig:
    """A CacheConfig whose layer/head shapes match this model. K/V pages have the model's
    dtype unless `dtype` is passed ("auto", the default, means the model's; "int8" /
    "float8_e4m3fn" quantize). Hybrid KV gives the sliding-window layers a pool of their
    own (`CacheConfig.sliding_layers`), sized unless `num_sliding_blocks` is passed for an
    engine with these `max_num_batched_tokens` and `decode_steps_per_sync` (the engine
    checks it); `hybrid_kv` None (the default) turns it on iff the model has both
    sliding-window and full-attention layers (`pool_sizing.hybrid_fields`)."""
    dtype = kwargs.pop("dtype", "auto")
    pool_sizing.hybrid_fields(self, hybrid_kv, max_num_batched_tokens, decode_steps_per_sync,
                              kwargs, CacheConfig)
    return CacheConfig(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                       head_dim=self.head_dim, dtype=self.dtype if dtype == "auto" else dtype,
                       **kwargs)
