"""Hugging Face-format Llama checkpoints: load and save through the `safetensors` package.

A checkpoint directory holds `config.json` (HF Llama form) and either one
`model.safetensors`, or shards listed by `model.safetensors.index.json`
(`{"weight_map": {tensor_name: file_name}}`), or any `*.safetensors` files.

Names map 1:1 to the `LlamaForCausalLM` tree (see `llama.py`); HF stores Linear
weights as [out, in], Flax kernels as [in, out], so they are transposed (on the
device, after one host read per tensor). BF16 is read and written as
`ml_dtypes.bfloat16` by safetensors' numpy API, so no torch is needed.

Every failure is a `ValueError` (or `FileNotFoundError`) that names the file, the
tensor where there is one, and what is wrong: truncated file, corrupt header,
config.json that is not JSON, a non-float (e.g. int or quantized) weight, a wrong
shape, a missing or unknown tensor, a config that is not a Llama.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, List, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from paged_jax.config import ModelConfig

# Stored dtypes a weight may have: floats only. Integer or fp8 weights would need
# quantization scales this loader does not know, so they are rejected, never cast.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float16": np.dtype(np.float16)}
# Buffers some exporters leave in checkpoints; they carry nothing the model needs.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

TensorSpec = Tuple[Tuple[str, ...], Tuple[int, ...], bool]  # (tree path, HF shape, transpose?)


# ----------------------------------------------------------------------------- files

def read_json(path: str) -> Any:
  """Parsed JSON of `path`; ValueError naming the file and the position if it is not JSON."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
                     ) from None
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})"
                     ) from None


def _why_unreadable(path: str, error: SafetensorError) -> str:
  """A reason in words for a file safetensors refused, naming the first tensor whose bytes
  lie past the end of the file when the file was cut short."""
  size = os.path.getsize(path)
  text = str(error)
  if size < 8 or "too small" in text:
    return f"not a safetensors file (only {size} bytes)"
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
      return (f"truncated: the header alone claims {n} bytes but the file has {size - 8} "
              "after the length prefix")
    try:
      header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      return f"corrupt header ({type(e).__name__}: {e})"
  ends = sorted((int(info["data_offsets"][1]), name) for name, info in header.items()
                if isinstance(info, dict) and "data_offsets" in info)
  data = size - 8 - n
  past = [(end, name) for end, name in ends if end > data]
  if past:
    return (f"truncated: tensor {past[0][1]!r} needs data bytes up to {past[0][0]}, "
            f"but the file holds only {data}")
  return f"corrupt ({text})"


class _Shard:
  """One open safetensors file: keys, per-tensor dtype/shape from the header, lazy reads."""

  def __init__(self, path: str):
    self.path = path
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: safetensors file does not exist")
    try:
      self._file = safe_open(path, framework="numpy")
      self.names = set(self._file.keys())
    except SafetensorError as e:
      raise ValueError(f"{path}: {_why_unreadable(path, e)}") from None

  def spec(self, name: str) -> Tuple[str, Tuple[int, ...]]:
    """(safetensors dtype name, shape) of `name`, from the header only."""
    sl = self._file.get_slice(name)
    return sl.get_dtype(), tuple(int(s) for s in sl.get_shape())

  def read(self, name: str) -> np.ndarray:
    try:
      return self._file.get_tensor(name)
    except SafetensorError as e:
      raise ValueError(f"{self.path}: tensor {name!r} unreadable ({e})") from None


def _tensor_files(directory: str) -> Dict[str, str]:
  """{tensor name: file path} from the index, the single file, or every *.safetensors."""
  index = os.path.join(directory, INDEX_FILE)
  if os.path.exists(index):
    doc = read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()):
      raise ValueError(f"{index}: no 'weight_map' object of tensor name -> file name")
    return {name: os.path.join(directory, fn) for name, fn in weight_map.items()}
  files = sorted(fn for fn in os.listdir(directory) if fn.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"{directory}: no *.safetensors files")
  where: Dict[str, str] = {}
  for fn in files:
    path = os.path.join(directory, fn)
    for name in _Shard(path).names:
      if name in where:
        raise ValueError(f"tensor {name!r} appears in both {where[name]} and {path}")
      where[name] = path
  return where


# ----------------------------------------------------------------------------- name mapping

def expected_tensors(config: ModelConfig) -> Dict[str, TensorSpec]:
  """{HF name: (path in the Flax params tree, HF shape, transpose?)} for `config`."""
  c = config
  q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  out = {"model.embed_tokens.weight": (("model", "embed_tokens", "embedding"),
                                       (c.vocab_size, c.hidden_size), False),
         "model.norm.weight": (("model", "norm", "weight"), (c.hidden_size,), False)}
  linears = {"self_attn.q_proj": (q_out, c.hidden_size), "self_attn.k_proj": (kv_out, c.hidden_size),
             "self_attn.v_proj": (kv_out, c.hidden_size), "self_attn.o_proj": (c.hidden_size, q_out),
             "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
             "mlp.up_proj": (c.intermediate_size, c.hidden_size),
             "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
  for i in range(c.num_layers):
    pre = f"model.layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out[pre + norm + ".weight"] = (("model", f"layers_{i}", norm, "weight"),
                                     (c.hidden_size,), False)
    for lin, shape in linears.items():
      group, proj = lin.split(".")
      out[pre + lin + ".weight"] = (("model", f"layers_{i}", group, proj, "kernel"), shape, True)
  if not c.tie_word_embeddings:
    out["lm_head.weight"] = (("lm_head", "kernel"), (c.vocab_size, c.hidden_size), True)
  return out


# ----------------------------------------------------------------------------- config

def read_model_config(directory: str, dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a checkpoint directory's config.json (a Llama, or a ValueError)."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{directory}: checkpoint directory does not exist")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
  hf = read_json(path)
  if not isinstance(hf, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
  model_type = hf.get("model_type", "llama")
  if model_type != "llama":
    raise ValueError(f"{path}: model_type={model_type!r} is not a Llama "
                     "(this loader reads LlamaForCausalLM checkpoints)")
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{path}: hidden_act={act!r} is not supported (Llama uses silu)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ValueError(f"{path}: {key}=true is not supported (bias-free Llama only)")
  try:
    return ModelConfig.from_hf_config(hf, dtype=dtype)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- load / save

def _checked_shards(directory: str, expected: Mapping[str, TensorSpec]
                    ) -> Tuple[Dict[str, str], Dict[str, _Shard]]:
  """Opens the files holding `expected` and checks every header entry before any read."""
  where = _tensor_files(directory)
  # A tied model's redundant lm_head.weight is allowed (checked equal to the embedding).
  unknown = sorted(n for n in where if n not in expected and not n.endswith(_HARMLESS_SUFFIXES)
                   and n != "lm_head.weight")
  if unknown:
    shown = ", ".join(f"{n!r} (in {os.path.basename(where[n])})" for n in unknown[:5])
    raise ValueError(f"{directory}: unknown tensors {shown}{' ...' if len(unknown) > 5 else ''}"
                     " (not in a Llama of this config.json)")
  missing = sorted(n for n in expected if n not in where)
  if missing:
    raise ValueError(f"{directory}: missing tensors {missing[:5]}"
                     f"{' ...' if len(missing) > 5 else ''} (config.json asks for them)")
  shards = {path: _Shard(path) for path in sorted(set(where[n] for n in expected))}
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
  """Loads a HF Llama checkpoint directory.

  Args:
    directory: holds config.json and the safetensors file(s).
    dtype: parameter dtype of the result ("float32", "bfloat16", "float16").

  Returns:
    (ModelConfig, params) with params = {"params": {...}} for `LlamaForCausalLM.apply`;
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
  where, shards = _checked_shards(directory, expected)
  flat = {}
  for name, (tree_path, _, transpose) in expected.items():
    host = shards[where[name]].read(name)
    if host.dtype == np.float64:  # jax without x64 would narrow it with a warning
      host = host.astype(np.float32)
    arr = jnp.asarray(host).astype(dtype)  # widen/narrow on the device, exact for bf16/f16
    flat[tree_path] = arr.T if transpose else arr
  if "lm_head.weight" in where and config.tie_word_embeddings:
    path = where["lm_head.weight"]
    head = (shards.get(path) or _Shard(path)).read("lm_head.weight")
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
