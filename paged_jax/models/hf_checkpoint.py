"""Hugging Face-format checkpoints: load and save through the `safetensors` package.

A checkpoint directory holds `config.json` (of a family in `hf_config.MODEL_TYPES`: Llama,
Mistral, Qwen2 / Qwen2.5, Qwen3, Gemma-2, Gemma-3 text) and either one `model.safetensors`,
or shards listed by `model.safetensors.index.json` (`{"weight_map": {tensor_name:
file_name}}`), or any `*.safetensors` files.

Names map 1:1 to the `DecoderForCausalLM` tree (see `decoder.py`); HF stores Linear
weights as [out, in], Flax kernels as [in, out], so they are transposed (on the
device, after one host read per tensor). BF16 is read and written as
`ml_dtypes.bfloat16` by safetensors' numpy API, so no torch is needed.

Every failure is a `ValueError` (or `FileNotFoundError`) that names the file, the
tensor where there is one, and what is wrong: a header that lies about a tensor's dtype,
shape or offsets, a truncated file, a name in two shards (see `safetensors_files.py`),
config.json that is not JSON or asks for something unsupported (naming the key), a
non-float (e.g. int or quantized) weight, a wrong shape, a missing or unknown tensor.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from paged_jax.config import ModelConfig
from paged_jax.models.safetensors_files import (INDEX_FILE, SafetensorsFile, read_json,
                                                tensor_locations)

# Stored dtypes a weight may have: floats only. Integer or fp8 weights would need
# quantization scales this loader does not know, so they are rejected, never cast.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float16": np.dtype(np.float16)}
# Buffers some exporters leave in checkpoints; they carry nothing the model needs.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
__all__ = ["INDEX_FILE", "SINGLE_FILE", "CONFIG_FILE", "read_json", "expected_tensors",
           "read_model_config", "load_hf_checkpoint", "save_hf_checkpoint"]

TensorSpec = Tuple[Tuple[str, ...], Tuple[int, ...], bool]  # (tree path, HF shape, transpose?)


# ----------------------------------------------------------------------------- name mapping

def expected_tensors(config: ModelConfig) -> Dict[str, TensorSpec]:
  """{HF name: (path in the Flax params tree, HF shape, transpose?)} for `config`."""
  c = config
  q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  out = {"model.embed_tokens.weight": (("model", "embed_tokens", "embedding"),
                                       (c.vocab_size, c.hidden_size), False),
         "model.norm.weight": (("model", "norm", "weight"), (c.hidden_size,), False)}
  # name: ([out, in] shape, has a bias)
  linears = {"self_attn.q_proj": ((q_out, c.hidden_size), c.qkv_bias),
             "self_attn.k_proj": ((kv_out, c.hidden_size), c.qkv_bias),
             "self_attn.v_proj": ((kv_out, c.hidden_size), c.qkv_bias),
             "self_attn.o_proj": ((c.hidden_size, q_out), c.o_proj_bias),
             "mlp.gate_proj": ((c.intermediate_size, c.hidden_size), c.mlp_bias),
             "mlp.up_proj": ((c.intermediate_size, c.hidden_size), c.mlp_bias),
             "mlp.down_proj": ((c.hidden_size, c.intermediate_size), c.mlp_bias)}
  norms = {"input_layernorm": c.hidden_size, "post_attention_layernorm": c.hidden_size}
  if c.sandwich_norms:
    norms.update(pre_feedforward_layernorm=c.hidden_size, post_feedforward_layernorm=c.hidden_size)
  if c.qk_norm:
    norms.update({"self_attn.q_norm": c.head_dim, "self_attn.k_norm": c.head_dim})
  for i in range(c.num_layers):
    pre, tree = f"model.layers.{i}.", ("model", f"layers_{i}")
    for norm, size in norms.items():
      out[pre + norm + ".weight"] = (tree + tuple(norm.split(".")) + ("weight",), (size,), False)
    for lin, (shape, bias) in linears.items():
      path = tree + tuple(lin.split("."))
      out[pre + lin + ".weight"] = (path + ("kernel",), shape, True)
      if bias:
        out[pre + lin + ".bias"] = (path + ("bias",), shape[:1], False)
  if not c.tie_word_embeddings:
    out["lm_head.weight"] = (("lm_head", "kernel"), (c.vocab_size, c.hidden_size), True)
  return out


# ----------------------------------------------------------------------------- config

def read_model_config(directory: str, dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a checkpoint directory's config.json; ValueError "<path>: ..."
  naming the key for a family or value the decoder does not support."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{directory}: checkpoint directory does not exist")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
  hf = read_json(path)
  if not isinstance(hf, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
  try:
    return ModelConfig.from_hf_config(hf, dtype=dtype)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- load / save

def _checked_shards(directory: str, config: ModelConfig, expected: Mapping[str, TensorSpec]
                    ) -> Tuple[Dict[str, str], Dict[str, SafetensorsFile]]:
  """Opens the files holding `expected` and checks every header entry before any read."""
  where = tensor_locations(directory)
  # A tied model's redundant lm_head.weight is allowed (checked equal to the embedding).
  unknown = sorted(n for n in where if n not in expected and not n.endswith(_HARMLESS_SUFFIXES)
                   and n != "lm_head.weight")
  if unknown:
    shown = ", ".join(f"{n!r} (in {os.path.basename(where[n])})" for n in unknown[:5])
    raise ValueError(f"{directory}: unknown tensors {shown}{' ...' if len(unknown) > 5 else ''}"
                     f" (not in the {config.model_type} model of this config.json)")
  missing = sorted(n for n in expected if n not in where)
  if missing:
    raise ValueError(f"{directory}: missing tensors {missing[:5]}"
                     f"{' ...' if len(missing) > 5 else ''} (config.json asks for them)")
  shards = {path: SafetensorsFile(path) for path in sorted(set(where[n] for n in expected))}
  for name, (_, shape, _) in expected.items():
    shard = shards[where[name]]
    if name not in shard.names:
      raise ValueError(f"{shard.path}: tensor {name!r} is not in this file "
                       "(as the index claims)")
    st_dtype, st_shape = shard.spec(name)
    if st_dtype not in FLOAT_DTYPES:
      raise ValueError(f"{shard.path}: tensor {name!r} has dtype {st_dtype}, expected one of "
                       f"{FLOAT_DTYPES} (integer or quantized weights are not cast)")
    if st_shape != shape:
      raise ValueError(f"{shard.path}: tensor {name!r} has shape {st_shape}, expected {shape} "
                       "from config.json")
  return where, shards


def load_hf_checkpoint(directory: str, dtype: str = "float32") -> Tuple[ModelConfig, dict]:
  """Loads a HF checkpoint directory of any supported family.

  Args:
    directory: holds config.json and the safetensors file(s).
    dtype: parameter dtype of the result ("float32", "bfloat16", "float16").

  Returns:
    (ModelConfig, params) with params = {"params": {...}} for `DecoderForCausalLM.apply`;
    Linear kernels [in, out], embedding [vocab_size, hidden_size].

  Raises:
    FileNotFoundError for a missing directory / config.json / shard; ValueError naming the
    file and tensor for anything else that is wrong (see the module docstring).
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_SAVE_DTYPES)}, got {dtype!r}")
  config = read_model_config(directory, dtype)
  expected = expected_tensors(config)
  where, shards = _checked_shards(directory, config, expected)
  flat = {}
  for name, (tree_path, _, transpose) in expected.items():
    host = shards[where[name]].read(name)
    if host.dtype == np.float64:  # jax without x64 would narrow it with a warning
      host = host.astype(np.float32)
    arr = jnp.asarray(host).astype(dtype)  # widen/narrow on the device, exact for bf16/f16
    flat[tree_path] = arr.T if transpose else arr
  if "lm_head.weight" in where and config.tie_word_embeddings:
    path = where["lm_head.weight"]
    head = (shards.get(path) or SafetensorsFile(path)).read("lm_head.weight")
    emb = shards[where["model.embed_tokens.weight"]].read("model.embed_tokens.weight")
    if head.shape != emb.shape or not np.array_equal(head, emb):
      raise ValueError(f"{path}: tensor 'lm_head.weight' differs from model.embed_tokens.weight"
                       " but config.json sets tie_word_embeddings=true")
  return config, {"params": traverse_util.unflatten_dict(flat)}


def save_hf_checkpoint(directory: str, config: ModelConfig, params: Mapping,
                       dtype: str = "bfloat16", max_shard_bytes: Optional[int] = None,
                       extra_config: Optional[Mapping] = None) -> List[str]:
  """Writes config.json + safetensors (sharded with an index past `max_shard_bytes`).

  Returns the list of files written. `dtype` is the stored dtype of every tensor;
  `extra_config` adds keys to config.json (e.g. bos_token_id / eos_token_id).
  """
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_SAVE_DTYPES)}, got {dtype!r}")
  flat = traverse_util.flatten_dict(params.get("params", params))
  tensors = {}
  for name, (tree_path, shape, transpose) in expected_tensors(config).items():
    if tree_path not in flat:
      raise ValueError(f"params lack {'/'.join(tree_path)} (for tensor {name!r})")
    arr = np.asarray(flat[tree_path], dtype=np.float32)
    arr = arr.T if transpose else arr
    if arr.shape != shape:
      raise ValueError(f"params {'/'.join(tree_path)} give tensor {name!r} shape {arr.shape}, "
                       f"expected {shape}")
    tensors[name] = np.ascontiguousarray(arr.astype(_SAVE_DTYPES[dtype]))
  os.makedirs(directory, exist_ok=True)
  hf = config.to_hf_config()
  hf["torch_dtype"] = dtype
  hf.update(extra_config or {})
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2)
  written = [os.path.join(directory, CONFIG_FILE)]
  total = sum(a.nbytes for a in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    path = os.path.join(directory, SINGLE_FILE)
    save_file(tensors, path, metadata={"format": "pt"})
    return written + [path]
  shards: List[Dict[str, np.ndarray]] = [{}]
  for name in sorted(tensors):
    if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + tensors[name].nbytes > (
        max_shard_bytes):
      shards.append({})
    shards[-1][name] = tensors[name]
  weight_map = {}
  for i, shard in enumerate(shards):
    fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(directory, fn), metadata={"format": "pt"})
    written.append(os.path.join(directory, fn))
    weight_map.update({name: fn for name in shard})
  with open(os.path.join(directory, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return written + [os.path.join(directory, INDEX_FILE)]
