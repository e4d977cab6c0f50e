"""Checkpoint files that lie: every error names the file and the tensor (issue 24, point 4).

Each case starts from a good checkpoint written by the safetensors package, edits the
bytes a corrupt or hostile writer would, and loads it through `load_hf_checkpoint`.
"""

import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from paged_jax.config import ModelConfig
from paged_jax.models import hf_checkpoint as hc
from paged_jax.models import safetensors_files as sf
from paged_jax.models.decoder import init_params

CONFIG = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4)
K_PROJ = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def params():
  import jax  # pylint: disable=g-import-not-at-top
  return init_params(CONFIG, jax.random.key(0))


@pytest.fixture
def ckpt(tmp_path, params):
  hc.save_hf_checkpoint(str(tmp_path), CONFIG, params, dtype="float32")
  return tmp_path, tmp_path / "model.safetensors"


def _split(path):
  raw = path.read_bytes()
  (n,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header_text: str, data: bytes):
  text = header_text.encode()
  text += b" " * (-len(text) % 8)
  path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit(path, change):
  """Rewrites the header after `change(header)`; the data section stays as it was."""
  header, data = _split(path)
  change(header)
  _write(path, json.dumps(header), data)


def _error(directory, exc=ValueError) -> str:
  with pytest.raises(exc) as info:
    hc.load_hf_checkpoint(str(directory))
  msg = str(info.value)
  assert "\n" not in msg
  return msg


def test_header_lying_about_dtype_names_the_tensor(ckpt):
  directory, path = ckpt
  _edit(path, lambda h: h[K_PROJ].update(dtype="F16"))
  assert _error(directory) == (
      f"{path}: tensor {K_PROJ!r}: header says dtype F16 shape [4, 8] (64 bytes) but its "
      f"data_offsets {_split(path)[0][K_PROJ]['data_offsets']} span 128 bytes")
  _edit(path, lambda h: h[K_PROJ].update(dtype="F33"))
  assert _error(directory).startswith(f"{path}: tensor {K_PROJ!r}: header gives unknown dtype "
                                      "'F33'")


def test_header_lying_about_shape_names_the_tensor(ckpt):
  directory, path = ckpt
  _edit(path, lambda h: h[K_PROJ].update(shape=[4, 9]))
  msg = _error(directory)
  assert msg.startswith(f"{path}: tensor {K_PROJ!r}: header says dtype F32 shape [4, 9] "
                        "(144 bytes)"), msg
  _edit(path, lambda h: h[K_PROJ].update(shape=[4, -8]))
  assert "header shape must be a list of ints >= 0, got [4, -8]" in _error(directory)


def test_header_lying_about_offsets_names_the_tensor(ckpt):
  directory, path = ckpt
  header, data = _split(path)
  header.pop("__metadata__", None)
  names = sorted(header, key=lambda n: header[n]["data_offsets"][0])
  first, second = names[0], names[1]
  a0, a1 = header[first]["data_offsets"]
  # The second tensor claims to start inside the first one (same size, so its entry alone
  # looks fine): an overlap, reported on the tensor that starts too early.
  b0 = header[second]["data_offsets"][0]
  _edit(path, lambda h: h[second].update(data_offsets=[b0 - 4, b0 - 4 + (
      h[second]["data_offsets"][1] - b0)]))
  msg = _error(directory)
  assert msg.startswith(f"{path}: tensor {second!r}: data_offsets [{b0 - 4}, ") and (
      f"overlaps tensor {first!r}" in msg), msg
  _write(path, json.dumps(header), data)
  _edit(path, lambda h: h[first].update(data_offsets=[a1, a0]))
  assert f"tensor {first!r}: header data_offsets must be [begin, end]" in _error(directory)
  # Offsets past the data of an intact file: the last tensor's end moved out.
  _write(path, json.dumps(header), data)
  last = names[-1]
  l0, l1 = header[last]["data_offsets"]
  _write(path, json.dumps(dict(header, **{last: dict(header[last], data_offsets=[
      l0 + 8, l1 + 8])})), data)
  msg = _error(directory)
  assert f"tensor {last!r}: data_offsets [{l0 + 8}, {l1 + 8}] leaves a gap after" in msg, msg


def test_truncated_file_and_stray_bytes_name_the_tensor(ckpt):
  directory, path = ckpt
  header, data = _split(path)
  header.pop("__metadata__", None)
  last = max(header, key=lambda n: header[n]["data_offsets"][1])
  raw = path.read_bytes()
  path.write_bytes(raw[:-3])
  assert _error(directory) == (
      f"{path}: truncated: tensor {last!r} needs data bytes up to {len(data)}, but the file "
      f"holds only {len(data) - 3}")
  path.write_bytes(raw + b"\0" * 4)
  assert _error(directory) == (
      f"{path}: 4 stray bytes after the last tensor {last!r} (data offsets end at "
      f"{len(data)}, the data section has {len(data) + 4})")


def test_duplicate_names_are_refused(ckpt, params):
  directory, path = ckpt
  header, data = _split(path)
  # The same name twice in one header (json.loads would keep the last silently).
  entries = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in header.items()]
  entries.append(f"{json.dumps(K_PROJ)}: {json.dumps(header[K_PROJ])}")
  _write(path, "{" + ", ".join(entries) + "}", data)
  assert _error(directory) == f"{path}: corrupt header (tensor {K_PROJ!r} is listed twice)"
  # The same name in two shards of a directory without an index.
  _write(path, json.dumps(header), data)
  save_file({K_PROJ: np.zeros((4, 8), np.float32)}, str(directory / "extra.safetensors"))
  assert _error(directory) == (f"tensor {K_PROJ!r} appears in both "
                               f"{directory / 'extra.safetensors'} and {path} "
                               "(duplicate name across shards)")
  os.remove(directory / "extra.safetensors")


def test_duplicates_across_indexed_shards(tmp_path, params):
  hc.save_hf_checkpoint(str(tmp_path), CONFIG, params, dtype="float32", max_shard_bytes=300)
  index = tmp_path / sf.INDEX_FILE
  doc = json.loads(index.read_text())
  files = sorted(set(doc["weight_map"].values()))
  assert len(files) >= 2
  assert hc.load_hf_checkpoint(str(tmp_path))[0] == CONFIG
  # A second shard also holds a tensor the index places in the first one.
  name = next(n for n, fn in doc["weight_map"].items() if fn == files[0])
  second = tmp_path / files[1]
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  tensors = load_file(str(second))
  tensors[name] = load_file(str(tmp_path / files[0]))[name]
  save_file(tensors, str(second))
  assert _error(tmp_path) == (f"tensor {name!r} appears in both {tmp_path / files[0]} and "
                              f"{second} (duplicate name across shards)")
  # The index itself listing a name twice.
  text = index.read_text().replace('"weight_map": {', f'"weight_map": {{"{name}": '
                                   f'"{files[1]}", ', 1)
  index.write_text(text)
  assert _error(tmp_path) == f"{index}: tensor {name!r} is listed twice"


def test_good_files_still_load_and_read_header_reports_sizes(ckpt, params):
  directory, path = ckpt
  header, data = sf.read_header(str(path))
  assert K_PROJ in header and "__metadata__" not in header
  assert sum(np.prod(v["shape"]) * 4 for v in header.values()) == data
  config, loaded = hc.load_hf_checkpoint(str(directory))
  assert config == CONFIG
  np.testing.assert_array_equal(
      loaded["params"]["model"]["layers_0"]["self_attn"]["k_proj"]["kernel"],
      params["params"]["model"]["layers_0"]["self_attn"]["k_proj"]["kernel"])
