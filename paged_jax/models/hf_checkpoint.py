"""Hugging Face-format Llama checkpoints: safetensors load and save.

A checkpoint directory holds `config.json` (HF Llama form) and either one
`model.safetensors`, or shards listed by `model.safetensors.index.json`
(`{"weight_map": {tensor_name: file_name}}`), or any `*.safetensors` files.

Safetensors layout (parsed here directly so BF16 works without torch): an
8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw little-endian tensor bytes (offsets relative to the buffer start).
BF16 is read and written through `ml_dtypes.bfloat16`.

Names map 1:1 to the `LlamaForCausalLM` tree (see `llama.py`); HF stores
Linear weights as [out, in], Flax kernels as [in, out], so they are transposed.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, Iterable, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np

from paged_jax.config import ModelConfig

_ST_TO_NP = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_SAVE_DTYPES = ("float32", "bfloat16", "float16")
# Buffers some exporters leave in checkpoints; they carry nothing the model needs.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ----------------------------------------------------------------------------- safetensors

def read_safetensors_header(path: str) -> Tuple[Dict[str, dict], int]:
  """-> ({name: {"dtype", "shape", "data_offsets"}}, byte offset of the data buffer)."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    size = os.path.getsize(path)
    if n > size - 8:
      raise ValueError(f"{path}: header length {n} exceeds the file size {size}")
    header = json.loads(f.read(n).decode("utf-8"))
  header.pop("__metadata__", None)
  for name, info in header.items():
    if info.get("dtype") not in _ST_TO_NP:
      raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
  return header, 8 + n


def read_safetensors(path: str, names: Optional[Iterable[str]] = None) -> Dict[str, np.ndarray]:
  """Reads tensors (all, or `names`) of one file as numpy arrays (BF16 as ml_dtypes)."""
  header, start = read_safetensors_header(path)
  wanted = list(header) if names is None else list(names)
  buf = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name in wanted:
    info = header[name]
    dt = _ST_TO_NP[info["dtype"]]
    begin, end = info["data_offsets"]
    shape = tuple(int(s) for s in info["shape"])
    expect = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if end - begin != expect or start + end > buf.size:
      raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes, "
                       f"expected {expect} for shape {shape} {info['dtype']}")
    arr = np.frombuffer(buf[start + begin:start + end].tobytes(), dtype=dt.newbyteorder("<"))
    out[name] = arr.astype(dt, copy=False).reshape(shape)
  return out


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
  """Writes tensors (numpy, BF16 via ml_dtypes) as one safetensors file."""
  header, offset, blobs = {}, 0, []
  for name in sorted(tensors):
    arr = np.ascontiguousarray(tensors[name])
    if arr.dtype not in _NP_TO_ST:
      raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
    data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    header[name] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
  header["__metadata__"] = dict(metadata or {"format": "pt"})
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)  # data buffer 8-byte aligned, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for data in blobs:
      f.write(data)


# ----------------------------------------------------------------------------- name mapping

def expected_tensors(config: ModelConfig) -> Dict[str, Tuple[Tuple[str, ...], Tuple[int, ...], bool]]:
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


def _shard_files(directory: str) -> Dict[str, str]:
  """{tensor name: file path} from the index, the single file, or every *.safetensors."""
  index = os.path.join(directory, INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: no 'weight_map' object")
    return {name: os.path.join(directory, fn) for name, fn in weight_map.items()}
  files = sorted(fn for fn in os.listdir(directory) if fn.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"{directory}: no *.safetensors files")
  where = {}
  for fn in files:
    path = os.path.join(directory, fn)
    for name in read_safetensors_header(path)[0]:
      if name in where:
        raise ValueError(f"tensor {name!r} appears in both {where[name]} and {path}")
      where[name] = path
  return where


# ----------------------------------------------------------------------------- load / save

def _check_supported(hf: Mapping) -> None:
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"config.json hidden_act={act!r} is not supported (only silu)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ValueError(f"config.json {key}=true is not supported (bias-free Llama only)")
  model_type = hf.get("model_type", "llama")
  if model_type != "llama":
    raise ValueError(f"config.json model_type={model_type!r} is not supported (llama only)")


def load_hf_checkpoint(directory: str, dtype: str = "float32") -> Tuple[ModelConfig, dict]:
  """Loads a HF Llama checkpoint directory.

  Args:
    directory: holds config.json and the safetensors file(s).
    dtype: parameter dtype of the result ("float32", "bfloat16", "float16").

  Returns:
    (ModelConfig, params) with params = {"params": {...}} for `LlamaForCausalLM.apply`.

  Raises:
    ValueError naming the tensor for missing, unknown or wrongly shaped tensors.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {_SAVE_DTYPES}, got {dtype!r}")
  cfg_path = os.path.join(directory, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{directory}: no config.json")
  with open(cfg_path) as f:
    hf = json.load(f)
  _check_supported(hf)
  config = ModelConfig.from_hf_config(hf, dtype=dtype)
  expected = expected_tensors(config)
  where = _shard_files(directory)
  extra_lm_head = config.tie_word_embeddings and "lm_head.weight" in where
  unknown = sorted(n for n in where if n not in expected and not n.endswith(_HARMLESS_SUFFIXES)
                   and not (extra_lm_head and n == "lm_head.weight"))
  if unknown:
    raise ValueError(f"unknown tensors in {directory}: {unknown[:10]}"
                     f"{' ...' if len(unknown) > 10 else ''}")
  missing = sorted(n for n in expected if n not in where)
  if missing:
    raise ValueError(f"missing tensors in {directory}: {missing[:10]}"
                     f"{' ...' if len(missing) > 10 else ''}")
  headers = {}
  for path in set(where[n] for n in expected):
    if not os.path.exists(path):
      raise FileNotFoundError(f"shard {path} listed in the index does not exist")
    headers[path] = read_safetensors_header(path)[0]
  for name, (_, shape, _) in expected.items():
    info = headers[where[name]].get(name)
    if info is None:
      raise ValueError(f"tensor {name!r} is not in {where[name]} (as the index claims)")
    if tuple(info["shape"]) != shape:
      raise ValueError(f"tensor {name!r} has shape {tuple(info['shape'])}, "
                       f"expected {shape} from config.json")
  np_dtype = jnp.dtype(dtype)
  params: dict = {}
  by_file: Dict[str, list] = {}
  for name in expected:
    by_file.setdefault(where[name], []).append(name)
  for path, names in by_file.items():
    arrays = read_safetensors(path, names)
    for name in names:
      tree_path, _, transpose = expected[name]
      arr = arrays[name].astype(np.float32)  # widen first: exact for bf16/f16
      if transpose:
        arr = arr.T
      node = params
      for key in tree_path[:-1]:
        node = node.setdefault(key, {})
      node[tree_path[-1]] = jnp.asarray(arr, dtype=np_dtype)
  if extra_lm_head:
    head = read_safetensors(where["lm_head.weight"], ["lm_head.weight"])["lm_head.weight"]
    emb = np.asarray(params["model"]["embed_tokens"]["embedding"], np.float32)
    if head.shape != emb.shape or not np.array_equal(head.astype(np.float32), emb):
      raise ValueError("tensor 'lm_head.weight' differs from model.embed_tokens.weight "
                       "but config.json sets tie_word_embeddings=true")
  return config, {"params": params}


def save_hf_checkpoint(directory: str, config: ModelConfig, params: Mapping,
                       dtype: str = "bfloat16", max_shard_bytes: Optional[int] = None,
                       extra_config: Optional[Mapping] = None) -> list:
  """Writes config.json + safetensors (sharded with an index past `max_shard_bytes`).

  Returns the list of files written. `dtype` is the stored dtype of every tensor;
  `extra_config` adds keys to config.json (e.g. bos_token_id / eos_token_id).
  """
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {_SAVE_DTYPES}, got {dtype!r}")
  if "params" in params:
    params = params["params"]
  np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  tensors = {}
  for name, (tree_path, shape, transpose) in expected_tensors(config).items():
    node = params
    for key in tree_path:
      if key not in node:
        raise ValueError(f"params lack {'/'.join(tree_path)} (for tensor {name!r})")
      node = node[key]
    arr = np.asarray(node, dtype=np.float32)
    arr = arr.T if transpose else arr
    if arr.shape != shape:
      raise ValueError(f"params {'/'.join(tree_path)} give tensor {name!r} shape {arr.shape}, "
                       f"expected {shape}")
    tensors[name] = np.ascontiguousarray(arr.astype(np_dtype))
  os.makedirs(directory, exist_ok=True)
  hf = config.to_hf_config()
  hf["torch_dtype"] = dtype
  hf.update(extra_config or {})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  written = [os.path.join(directory, "config.json")]
  total = sum(a.nbytes for a in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    path = os.path.join(directory, SINGLE_FILE)
    write_safetensors(path, tensors)
    return written + [path]
  shards, cur, cur_bytes = [], {}, 0
  for name in sorted(tensors):
    if cur and cur_bytes + tensors[name].nbytes > max_shard_bytes:
      shards.append(cur)
      cur, cur_bytes = {}, 0
    cur[name] = tensors[name]
    cur_bytes += tensors[name].nbytes
  shards.append(cur)
  weight_map = {}
  for i, shard in enumerate(shards):
    fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(os.path.join(directory, fn), shard)
    written.append(os.path.join(directory, fn))
    weight_map.update({name: fn for name in shard})
  with open(os.path.join(directory, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return written + [os.path.join(directory, INDEX_FILE)]
