"""Frozen, hashable configuration objects, validated on construction.

`CacheConfig` fixes every shape of the paged KV cache and of the block manager's
state, so it can be a static argument of `jax.jit`. `ModelConfig` describes a
Llama-style decoder; `ModelConfig.from_hf_config` reads a Hugging Face
`config.json` dictionary.

Errors name the argument and the allowed range, and are raised before any device
work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np

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


class OutOfBlocksError(RuntimeError):
  """Raised by host-side wrappers when the cache has too few free blocks."""


def cdiv(a, b):
  """Ceiling of a / b for ints or int arrays (b > 0): blocks needed for `a` tokens of `b`
  tokens per block."""
  return -(-a // b)


def check_int(name: str, value: Any, lo: int, hi: Optional[int] = None) -> None:
  """The one host-side int validator: TypeError unless `value` is an int (not a bool),
  ValueError naming `name` and the range unless lo <= value (<= hi)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
  if value < lo or (hi is not None and value > hi):
    rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise ValueError(f"{name} must be {rng}, got {value}")


def check_block_size(block_size: Any) -> None:
  """ValueError unless `block_size` is a power of two in [1, 1024] (tokens per KV block)."""
  check_int("block_size", block_size, 1, 1024)
  if block_size & (block_size - 1):
    raise ValueError(f"block_size must be a power of two in [1, 1024], got {block_size}")


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
      requests can reuse them.
  """

  block_size: int = 16
  num_blocks: int = 256
  max_seqs: int = 8
  max_blocks_per_seq: int = 64
  num_layers: int = 1
  num_kv_heads: int = 1
  head_dim: int = 64
  dtype: str = "float32"
  enable_prefix_caching: bool = False

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
    if self.num_blocks * self.block_size > 2**31 - 1:
      # Flat cache slots (block * block_size + offset) are int32 inside jit.
      raise ValueError(
          f"num_blocks * block_size must be <= 2**31 - 1 (int32 cache slots), got "
          f"{self.num_blocks} * {self.block_size}")
    if self.max_seq_len > 2**30:
      raise ValueError(
          f"max_blocks_per_seq * block_size must be <= 2**30, got {self.max_seq_len}")

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
    return self.kv_bytes_per_token * self.num_slots

  def blocks_for(self, num_tokens: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return cdiv(num_tokens, self.block_size)

  def replace(self, **changes) -> "CacheConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_memory_budget(
      cls,
      model: "ModelConfig",
      *,
      block_size: int = 16,
      kv_budget_bytes: Optional[int] = None,
      gpu_memory_utilization: Optional[float] = None,
      max_seqs: int = 64,
      max_model_len: Optional[int] = None,
      dtype: str = "float32",
      **kwargs,
  ) -> "CacheConfig":
    """Sizes the block pool like a serving system.

    Exactly one of `kv_budget_bytes` (bytes for K/V pages) or
    `gpu_memory_utilization` (fraction in (0, 1] of the first device's free
    memory; falls back to an error on devices that report no memory stats) must
    be given. `max_model_len` defaults to the model's max positions.
    """
    if (kv_budget_bytes is None) == (gpu_memory_utilization is None):
      raise ValueError("give exactly one of kv_budget_bytes or gpu_memory_utilization")
    if gpu_memory_utilization is not None:
      if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
      import jax  # pylint: disable=g-import-not-at-top
      stats = jax.devices()[0].memory_stats() or {}
      if "bytes_limit" not in stats:
        raise ValueError(
            "gpu_memory_utilization needs a device that reports memory_stats(); "
            "pass kv_budget_bytes on this backend")
      free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
      kv_budget_bytes = int(free * gpu_memory_utilization)
    check_int("kv_budget_bytes", int(kv_budget_bytes), 1)
    max_model_len = max_model_len or model.max_position_embeddings
    probe = cls(block_size=block_size, num_blocks=1, max_seqs=max_seqs,
                max_blocks_per_seq=max(1, cdiv(max_model_len, block_size)),
                num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, dtype=dtype, **kwargs)
    num_blocks = int(kv_budget_bytes) // (probe.kv_bytes_per_token * block_size)
    if num_blocks < 1:
      raise ValueError(
          f"kv_budget_bytes={kv_budget_bytes} holds no block of {block_size} tokens "
          f"({probe.kv_bytes_per_token * block_size} bytes per block)")
    return probe.replace(num_blocks=num_blocks)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-style decoder.

  Attributes:
    vocab_size: tokens in the vocabulary.
    hidden_size: model width.
    intermediate_size: SwiGLU hidden width.
    num_layers: decoder layers.
    num_heads: query heads.
    num_kv_heads: K/V heads (GQA when < num_heads; must divide num_heads).
    head_dim: features per head (default hidden_size // num_heads).
    rope_theta: RoPE base.
    rms_norm_eps: RMSNorm epsilon.
    max_position_embeddings: longest supported position.
    tie_word_embeddings: lm_head shares the embedding matrix.
    dtype: activation/parameter dtype name.
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
      object.__setattr__(self, "rope_scaling", _parse_rope_scaling(dict(self.rope_scaling)))
    else:
      _parse_rope_scaling(dict(self.rope_scaling or ()))

  def rope_inv_freq(self) -> np.ndarray:
    """f32[head_dim // 2] RoPE inverse frequencies, with the configured scaling.

    Pairs (i, i + head_dim/2) rotate by `position * inv_freq[i]` (HF rotate_half).
    "linear" divides every frequency by `factor`; "llama3" (Llama 3.1+) divides the
    low frequencies by `factor`, keeps the high ones and interpolates in between.
    """
    d = self.head_dim
    inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = dict(self.rope_scaling or ())
    kind = sc.get("rope_type", "default")
    if kind == "linear":
      inv = inv / float(sc["factor"])
    elif kind == "llama3":
      factor = float(sc["factor"])
      low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
      old_len = float(sc.get("original_max_position_embeddings", 8192))
      wavelen = 2 * np.pi / inv
      smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
      # smooth == 0: long wavelengths (scaled by 1/factor); 1: short ones (kept).
      inv = (1 - smooth) * inv / factor + smooth * inv
    return inv.astype(np.float32)

  @classmethod
  def from_hf_config(cls, cfg: Mapping[str, Any], dtype: str = "float32") -> "ModelConfig":
    """Builds from a Hugging Face Llama `config.json` dictionary."""
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
    missing = [k for k in need if k not in cfg]
    if missing:
      raise ValueError(f"config.json lacks required keys {missing}")
    # transformers v5 writes `rope_parameters` (theta and scaling in one dict); v4 wrote
    # `rope_theta` and `rope_scaling` at the top level. Read either.
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_theta = rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_scaling = _parse_rope_scaling(rope_params or cfg.get("rope_scaling"))
    heads = int(cfg["num_attention_heads"])
    return cls(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or 0),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        dtype=dtype,
    )

  def to_hf_config(self) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        "hidden_act": "silu",
        "torch_dtype": self.dtype,
    }

  def cache_config(self, **kwargs) -> CacheConfig:
    """A CacheConfig whose layer/head shapes match this model."""
    return CacheConfig(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                       head_dim=self.head_dim, **kwargs)


_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def _parse_rope_scaling(rs: Optional[Mapping[str, Any]]):
  """HF `rope_scaling` dict -> hashable sorted tuple of items (None for plain RoPE)."""
  if not rs:
    return None
  rs = dict(rs)
  kind = rs.get("rope_type", rs.get("type")) or "default"
  if kind not in _ROPE_KEYS:
    raise ValueError(
        f"rope_scaling rope_type must be one of {sorted(_ROPE_KEYS)}, got {kind!r} ({rs!r})")
  if kind == "default":
    return None
  missing = [k for k in _ROPE_KEYS[kind][:1] if k not in rs]
  if missing:
    raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}")
  if not float(rs["factor"]) >= 1.0:
    raise ValueError(f"rope_scaling factor must be >= 1, got {rs['factor']}")
  kept = {k: float(rs[k]) for k in _ROPE_KEYS[kind] if k in rs}
  kept["rope_type"] = kind
  return tuple(sorted(kept.items()))


