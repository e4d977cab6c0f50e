"""Hugging Face `config.json` <-> ModelConfig fields, per model family.

One decoder serves every supported family; a family is a set of ModelConfig field values
(see `ModelConfig`'s docstring). `model_fields(cfg)` reads a config.json dictionary of
`model_type` in `MODEL_TYPES` into those fields, with transformers' defaults for the keys a
config may leave out; `config_json(fields)` writes the family's config.json back. Both the
transformers v4 layout (`rope_theta`, `rope_scaling` at the top level; Gemma-3's
`rope_local_base_freq` and `sliding_window_pattern`) and the v5 one (`rope_parameters`,
per layer type for Gemma-3; `layer_types`) are read.

Anything the decoder does not implement (another `model_type`, an activation, a RoPE
scaling type, bidirectional attention, quantized weights) is a ValueError naming the field.
This module imports nothing from paged_jax (config.py imports it).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

# model_type -> the transformers class that writes / reads it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
MODEL_TYPES = tuple(ARCHITECTURES)
GEMMA_TYPES = ("gemma2", "gemma3_text")
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
# MLP gate activations: HF name -> the one this decoder computes.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
               "gelu_new": "gelu_pytorch_tanh", "gelu": "gelu"}

# transformers' (5.x) class defaults for keys a config.json may omit (tests/hf_families_test
# checks them against transformers when it is installed).
DEFAULTS: Dict[str, Dict[str, Any]] = {
    "llama": dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=2048,
                  rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                  mlp_bias=False),
    "mistral": dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=131072,
                    rope_theta=10000.0, tie_word_embeddings=False, sliding_window=4096),
    "qwen2": dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=32768,
                  rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "qwen3": dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=32768,
                  rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28, attention_bias=False),
    "gemma2": dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                   max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=True,
                   attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                        max_position_embeddings=131072, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, tie_word_embeddings=True,
                        attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                        sliding_window_pattern=6, final_logit_softcapping=None,
                        attn_logit_softcapping=None),
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")

# RoPE scaling types and the keys each keeps (the first is required).
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def parse_rope_scaling(rs: Optional[Mapping[str, Any]], field: str = "rope_scaling"):
  """HF `rope_scaling` dict -> hashable sorted tuple of items (None for plain RoPE)."""
  if not rs:
    return None
  rs = dict(rs)
  kind = rs.get("rope_type", rs.get("type")) or "default"
  if kind not in ROPE_KEYS:
    raise ValueError(f"{field} rope_type must be one of {sorted(ROPE_KEYS)}, got {kind!r} "
                     f"({rs!r})")
  if float(rs.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError(f"{field} partial_rotary_factor must be 1.0 (RoPE on every feature), "
                     f"got {rs['partial_rotary_factor']}")
  if kind == "default":
    return None
  missing = [k for k in ROPE_KEYS[kind][:1] if k not in rs]
  if missing:
    raise ValueError(f"{field} of type {kind!r} lacks {missing}")
  if not float(rs["factor"]) >= 1.0:
    raise ValueError(f"{field} factor must be >= 1, got {rs['factor']}")
  kept = {k: float(rs[k]) for k in ROPE_KEYS[kind] if k in rs}
  kept["rope_type"] = kind
  return tuple(sorted(kept.items()))


def rope_inv_freq(theta: float, head_dim: int, scaling) -> np.ndarray:
  """f32[head_dim // 2] inverse frequencies of RoPE base `theta` under `scaling` (the
  parsed `rope_scaling` items, or None): "linear" divides every frequency by `factor`;
  "llama3" (Llama 3.1+) divides the low frequencies by `factor`, keeps the high ones and
  interpolates in between."""
  inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  sc = dict(scaling or ())
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


def _split_rope(params: Mapping[str, Any], field: str) -> Tuple[Optional[float], Any]:
  """A v5 `rope_parameters` dict -> (rope_theta or None, parsed scaling)."""
  params = dict(params)
  theta = params.pop("rope_theta", None)
  return theta, parse_rope_scaling(params, field)


def _rope_fields(cfg: Mapping[str, Any], model_type: str) -> Dict[str, Any]:
  """rope_theta, rope_scaling and (Gemma-3) sliding_rope_theta of a config.json."""
  d = DEFAULTS[model_type]
  params = cfg.get("rope_parameters")
  if model_type != "gemma3_text":
    theta, scaling = None, None
    if params:   # v5: theta and scaling in one dict
      theta, scaling = _split_rope(params, "rope_parameters")
    else:        # v4: top-level keys
      scaling = parse_rope_scaling(cfg.get("rope_scaling"))
    theta = theta if theta is not None else cfg.get("rope_theta", d["rope_theta"])
    return dict(rope_theta=float(theta), rope_scaling=scaling)
  full_theta, scaling, local_theta = None, None, None
  if params and (FULL in params or SLIDING in params):   # v5: one dict per layer type
    full_theta, scaling = _split_rope(params.get(FULL) or {}, f"rope_parameters.{FULL}")
    local_theta, local_scaling = _split_rope(params.get(SLIDING) or {},
                                             f"rope_parameters.{SLIDING}")
    if local_scaling is not None:
      raise ValueError(f"rope_parameters.{SLIDING} rope_type must be 'default' (sliding layers "
                       f"use plain RoPE), got {dict(local_scaling)['rope_type']!r}")
  elif params:
    full_theta, scaling = _split_rope(params, "rope_parameters")
  else:
    scaling = parse_rope_scaling(cfg.get("rope_scaling"))
  full_theta = full_theta if full_theta is not None else cfg.get("rope_theta", d["rope_theta"])
  local_theta = (local_theta if local_theta is not None
                 else cfg.get("rope_local_base_freq", d["rope_local_base_freq"]))
  return dict(rope_theta=float(full_theta), rope_scaling=scaling,
              sliding_rope_theta=float(local_theta))


def _layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int,
                 sliding_window: Optional[int]) -> Optional[Tuple[str, ...]]:
  """Per-layer attention kinds as transformers derives them; None when every layer is full."""
  d = DEFAULTS[model_type]
  if sliding_window is None:
    return None
  if model_type == "mistral":    # transformers' Mistral slides every layer (ignores layer_types)
    return (SLIDING,) * num_layers
  given = cfg.get("layer_types")
  if given is not None:
    types = tuple(given)
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or len(types) != num_layers:
      raise ValueError(f"layer_types must list {num_layers} of {LAYER_TYPES}, got {list(given)}")
  elif model_type in ("qwen2", "qwen3"):
    first = int(cfg.get("max_window_layers", d["max_window_layers"]))
    types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
  elif model_type == "gemma2":
    types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
  else:   # gemma3_text
    pattern = int(cfg.get("sliding_window_pattern", d["sliding_window_pattern"]))
    types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
  return None if SLIDING not in types else types


def _get(cfg: Mapping[str, Any], key: str, model_type: str):
  return cfg[key] if key in cfg else DEFAULTS[model_type].get(key)


def model_fields(cfg: Mapping[str, Any]) -> Dict[str, Any]:
  """ModelConfig keyword arguments (all but dtype) of a HF config.json dictionary.

  Raises ValueError naming the key for a missing required key, an unsupported model_type,
  or any value the decoder does not implement.
  """
  missing = [k for k in _REQUIRED if k not in cfg]
  if missing:
    raise ValueError(f"config.json lacks required keys {missing}")
  model_type = cfg.get("model_type") or "llama"
  if model_type not in MODEL_TYPES:
    hint = (" (the multimodal Gemma-3; text-only checkpoints have model_type 'gemma3_text')"
            if model_type == "gemma3" else "")
    raise ValueError(f"model_type={model_type!r} is not supported{hint}; supported: "
                     f"{', '.join(MODEL_TYPES)}")
  if cfg.get("quantization_config"):
    raise ValueError("quantization_config is not supported (float weights only)")
  if cfg.get("use_bidirectional_attention"):
    raise ValueError("use_bidirectional_attention=true is not supported (causal decoders only)")
  if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError(f"partial_rotary_factor must be 1.0, got {cfg['partial_rotary_factor']}")
  gemma = model_type in GEMMA_TYPES
  act_key = "hidden_activation" if gemma else "hidden_act"
  act = _get(cfg, act_key, model_type)
  if act not in ACTIVATIONS:
    raise ValueError(f"{act_key}={act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
  heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
  bias = bool(_get(cfg, "attention_bias", model_type))
  if model_type == "qwen2":
    qkv_bias, o_bias = True, False        # Qwen2 always has q/k/v biases, never an o bias
  elif model_type == "mistral":
    qkv_bias = o_bias = False
  else:
    qkv_bias = o_bias = bias
  # Llama has no sliding window (transformers ignores the key); Qwen only with the switch.
  window = None if model_type == "llama" else _get(cfg, "sliding_window", model_type)
  if model_type in ("qwen2", "qwen3") and not _get(cfg, "use_sliding_window", model_type):
    window = None
  window = None if window is None else int(window)
  attn_cap = _get(cfg, "attn_logit_softcapping", model_type) if gemma else None
  if model_type == "gemma3_text" and attn_cap is not None:
    raise ValueError(f"attn_logit_softcapping={attn_cap} is not supported for gemma3_text "
                     "(transformers' Gemma-3 does not apply it); it must be null")
  final_cap = _get(cfg, "final_logit_softcapping", model_type) if gemma else None
  scalar = _get(cfg, "query_pre_attn_scalar", model_type) if gemma else None
  hidden = int(cfg["hidden_size"])
  layer_types = _layer_types(cfg, model_type, layers, window)
  return dict(
      model_type=model_type,
      vocab_size=int(cfg["vocab_size"]),
      hidden_size=hidden,
      intermediate_size=int(cfg["intermediate_size"]),
      num_layers=layers,
      num_heads=heads,
      num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
      head_dim=int(cfg.get("head_dim") or 0),
      rms_norm_eps=float(_get(cfg, "rms_norm_eps", model_type)),
      max_position_embeddings=int(_get(cfg, "max_position_embeddings", model_type)),
      tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", model_type)),
      hidden_act=ACTIVATIONS[act],
      qkv_bias=qkv_bias,
      o_proj_bias=o_bias,
      mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
      qk_norm=model_type in ("qwen3", "gemma3_text"),
      rms_norm_unit_offset=gemma,
      sandwich_norms=gemma,
      embedding_multiplier=hidden ** 0.5 if gemma else 1.0,
      query_pre_attn_scalar=None if scalar is None else float(scalar),
      attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
      final_logit_softcapping=None if final_cap is None else float(final_cap),
      sliding_window=window if layer_types is not None else None,
      layer_types=layer_types,
      **_rope_fields(cfg, model_type))


def config_json(fields: Mapping[str, Any]) -> dict:
  """The config.json dictionary of ModelConfig `fields` (`dataclasses.asdict`), in the
  transformers v4 layout (which v5 reads too). The caller checks the round trip."""
  f = fields
  model_type = f["model_type"]
  gemma = model_type in GEMMA_TYPES
  out = {
      "architectures": [ARCHITECTURES[model_type]],
      "model_type": model_type,
      "vocab_size": f["vocab_size"],
      "hidden_size": f["hidden_size"],
      "intermediate_size": f["intermediate_size"],
      "num_hidden_layers": f["num_layers"],
      "num_attention_heads": f["num_heads"],
      "num_key_value_heads": f["num_kv_heads"],
      "head_dim": f["head_dim"],
      "rope_theta": f["rope_theta"],
      "rms_norm_eps": f["rms_norm_eps"],
      "max_position_embeddings": f["max_position_embeddings"],
      "tie_word_embeddings": f["tie_word_embeddings"],
      "rope_scaling": dict(f["rope_scaling"]) if f["rope_scaling"] else None,
      ("hidden_activation" if gemma else "hidden_act"): f["hidden_act"],
      "torch_dtype": f["dtype"],
  }
  if model_type in ("llama", "qwen3") or gemma:
    out["attention_bias"] = f["qkv_bias"]
  if model_type == "llama":
    out["mlp_bias"] = f["mlp_bias"]
  layer_types = f["layer_types"]
  if model_type == "mistral":
    out["sliding_window"] = f["sliding_window"]
  elif model_type in ("qwen2", "qwen3"):
    out["use_sliding_window"] = f["sliding_window"] is not None
    out["sliding_window"] = f["sliding_window"]
    if layer_types:
      out["layer_types"] = list(layer_types)
  elif gemma:
    out["sliding_window"] = f["sliding_window"] or DEFAULTS[model_type]["sliding_window"]
    out["layer_types"] = list(layer_types or (FULL,) * f["num_layers"])
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
      out[key] = f[key]
  if model_type == "gemma3_text":
    out["rope_local_base_freq"] = f["sliding_rope_theta"]
  return out
