"""The files of a Hugging Face checkpoint: JSON, safetensors headers checked tensor by tensor.

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {...}}`, then the
data section; each tensor's bytes are data[begin:end], the tensors tile the data section
without gaps or overlaps. `SafetensorsFile` checks all of that from the header before any
tensor is read, so a file that lies (a dtype or shape whose size disagrees with its offsets,
overlapping or out-of-order offsets, a tensor past the end of a truncated file, a name
listed twice) is refused with a message naming the file and the tensor; the `safetensors`
package then reads the tensors (zero-copy where it can).

`tensor_locations(directory)` maps each tensor name to its file, from
`model.safetensors.index.json` or from every `*.safetensors` file, and refuses a name held
by two files.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Dict, List, Tuple

import numpy as np
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
# Bytes per element of each safetensors dtype name.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER_BYTES = 100 * 2**20   # the safetensors package's own limit


def _no_duplicate_keys(what: str):
  """object_pairs_hook for json.load that refuses a key given twice (json keeps the last)."""
  def hook(pairs: List[Tuple[str, Any]]):
    seen = set()
    for key, _ in pairs:
      if key in seen:
        raise ValueError(f"{what} {key!r} is listed twice")
      seen.add(key)
    return dict(pairs)
  return hook


def read_json(path: str, *, unique_keys: str = "") -> Any:
  """Parsed JSON of `path`; ValueError naming the file and the position if it is not JSON
  (and, with `unique_keys="tensor"`, naming a key that an object lists twice)."""
  hook = _no_duplicate_keys(unique_keys) if unique_keys else None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f, object_pairs_hook=hook)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
                     ) from None
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})"
                     ) from None
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None


def read_header(path: str) -> Tuple[Dict[str, dict], int]:
  """({tensor name: {"dtype", "shape", "data_offsets"}}, data section bytes) of a safetensors
  file, every entry checked against the file; ValueError "<path>: ..." naming the tensor."""
  size = os.path.getsize(path)
  if size < 8:
    raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
      raise ValueError(f"{path}: truncated: the header alone claims {n} bytes but the file has "
                       f"{size - 8} after the length prefix")
    if n > _MAX_HEADER_BYTES:
      raise ValueError(f"{path}: corrupt header (claims {n} bytes, over the "
                       f"{_MAX_HEADER_BYTES}-byte limit)")
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys("tensor"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: corrupt header ({type(e).__name__}: {e})") from None
  except ValueError as e:
    raise ValueError(f"{path}: corrupt header ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: corrupt header (a JSON {type(header).__name__}, not an object)")
  header.pop("__metadata__", None)
  data = size - 8 - n
  for name, info in header.items():
    _check_entry(path, name, info)
  _check_tiling(path, header, data)
  return header, data


def _check_entry(path: str, name: str, info: Any) -> None:
  """One header entry: a known dtype, a shape of ints >= 0, offsets whose span holds exactly
  the bytes that dtype and shape need."""
  where = f"{path}: tensor {name!r}"
  if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
    raise ValueError(f"{where}: header entry must have dtype, shape and data_offsets, "
                     f"got {info!r}")
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if dtype not in DTYPE_BYTES:
    raise ValueError(f"{where}: header gives unknown dtype {dtype!r} "
                     f"(safetensors dtypes: {', '.join(DTYPE_BYTES)})")
  if not isinstance(shape, list) or not all(
      isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
    raise ValueError(f"{where}: header shape must be a list of ints >= 0, got {shape!r}")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(
      isinstance(o, int) and not isinstance(o, bool) for o in offsets)
          and 0 <= offsets[0] <= offsets[1]):
    raise ValueError(f"{where}: header data_offsets must be [begin, end] with "
                     f"0 <= begin <= end, got {offsets!r}")
  need = math.prod(shape) * DTYPE_BYTES[dtype]
  if offsets[1] - offsets[0] != need:
    raise ValueError(f"{where}: header says dtype {dtype} shape {shape} ({need} bytes) but its "
                     f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes")


def _check_tiling(path: str, header: Dict[str, dict], data: int) -> None:
  """The tensors' byte ranges tile the data section in order: no gap, overlap or overrun."""
  spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                 for name, info in header.items())
  end, prev = 0, None
  for begin, stop, name in spans:
    if begin != end:
      what = "overlaps" if begin < end else "leaves a gap after"
      after = f"tensor {prev!r}" if prev else "the start of the data"
      raise ValueError(f"{path}: tensor {name!r}: data_offsets [{begin}, {stop}] {what} "
                       f"{after} (which ends at byte {end})")
    end, prev = stop, name
  if end > data:
    past = next(name for begin, stop, name in spans if stop > data)
    stop = header[past]["data_offsets"][1]
    raise ValueError(f"{path}: truncated: tensor {past!r} needs data bytes up to {stop}, "
                     f"but the file holds only {data}")
  if end < data:
    raise ValueError(f"{path}: {data - end} stray bytes after the last tensor "
                     f"{prev!r} (data offsets end at {end}, the data section has {data})")


class SafetensorsFile:
  """One safetensors file: names, dtype and shape of each tensor from its checked header;
  tensors read on demand by the safetensors package."""

  def __init__(self, path: str):
    self.path = path
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: safetensors file does not exist")
    self.header, _ = read_header(path)
    self.names = set(self.header)
    self._file = None

  def spec(self, name: str) -> Tuple[str, Tuple[int, ...]]:
    """(safetensors dtype name, shape) of `name`, from the header only."""
    info = self.header[name]
    return info["dtype"], tuple(info["shape"])

  def read(self, name: str) -> np.ndarray:
    try:
      if self._file is None:
        self._file = safe_open(self.path, framework="numpy")
      return self._file.get_tensor(name)
    except SafetensorError as e:
      raise ValueError(f"{self.path}: tensor {name!r} unreadable ({e})") from None


def tensor_locations(directory: str) -> Dict[str, str]:
  """{tensor name: file path} from the index, or from every *.safetensors file.

  ValueError when the index lists a name twice, or two files both hold a tensor (in the
  files the index names, or in the directory without an index).
  """
  index = os.path.join(directory, INDEX_FILE)
  if os.path.exists(index):
    doc = read_json(index, unique_keys="tensor")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()):
      raise ValueError(f"{index}: no 'weight_map' object of tensor name -> file name")
    where = {name: os.path.join(directory, fn) for name, fn in weight_map.items()}
    _check_unique(sorted(set(where.values())))
    return where
  files = sorted(fn for fn in os.listdir(directory) if fn.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"{directory}: no *.safetensors files")
  return _check_unique([os.path.join(directory, fn) for fn in files])


def _check_unique(paths: List[str]) -> Dict[str, str]:
  """{name: path} over `paths` (existing ones); ValueError naming a tensor in two files."""
  where: Dict[str, str] = {}
  for path in paths:
    if not os.path.exists(path):
      continue   # a missing shard is reported when a tensor of it is needed
    for name in sorted(SafetensorsFile(path).names):
      if name in where:
        raise ValueError(f"tensor {name!r} appears in both {where[name]} and {path} "
                         "(duplicate name across shards)")
      where[name] = path
  return where
