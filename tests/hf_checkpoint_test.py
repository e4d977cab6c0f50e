"""HF safetensors checkpoints: load/save round trips, foreign writers, errors."""

import json
import os
import re
import struct

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file as st_load_numpy
from safetensors.numpy import save_file as st_save_numpy

from distributed_fixtures import random_params
from paged_jax import tokenizer
from paged_jax.config import ModelConfig
from paged_jax.models import DEFAULT_CHECKPOINT, dense, hf_checkpoint as hc, llama


def _config(tied=False, **kw):
  base = dict(vocab_size=61, hidden_size=24, intermediate_size=40, num_layers=2, num_heads=6,
              num_kv_heads=2, head_dim=4, rope_theta=1000.0, tie_word_embeddings=tied)
  base.update(kw)
  return ModelConfig(**base)


def _random_params(config, seed):
  return random_params(config, seed, matrix_scale=1.0)


def _hf_numpy_forward(t, cfg, tokens):
  """Transcription of HF LlamaForCausalLM on the raw HF-named [out, in] tensors (numpy f64)."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
  eps = cfg["rms_norm_eps"]
  norm = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
  lin = lambda x, name: x @ t[name].T
  n = len(tokens)
  inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
  emb = np.concatenate([np.outer(np.arange(n), inv)] * 2, -1)
  rot = lambda x: np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
  rope = lambda x: x * np.cos(emb)[:, None] + rot(x) * np.sin(emb)[:, None]
  x = t["model.embed_tokens.weight"][tokens]
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = norm(x, t[p + "input_layernorm.weight"])
    q = rope(lin(h, p + "self_attn.q_proj.weight").reshape(n, hq, d))
    k = rope(lin(h, p + "self_attn.k_proj.weight").reshape(n, hkv, d))
    v = lin(h, p + "self_attn.v_proj.weight").reshape(n, hkv, d)
    k, v = np.repeat(k, hq // hkv, 1), np.repeat(v, hq // hkv, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    a = np.einsum("hqk,khd->qhd", w, v).reshape(n, hq * d)
    x = x + lin(a, p + "self_attn.o_proj.weight")
    h = norm(x, t[p + "post_attention_layernorm.weight"])
    g, u = lin(h, p + "mlp.gate_proj.weight"), lin(h, p + "mlp.up_proj.weight")
    x = x + lin(g / (1 + np.exp(-g)) * u, p + "mlp.down_proj.weight")
  x = norm(x, t["model.norm.weight"])
  head = t["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else t["lm_head.weight"]
  return x @ head.T


def _same_tree(a, b, dtype=None):
  fa, ta = jax.tree_util.tree_flatten(a)
  fb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(fa, fb):
    x = np.asarray(x if dtype is None else jnp.asarray(x).astype(dtype), np.float32)
    np.testing.assert_array_equal(x, np.asarray(y, np.float32))


@pytest.mark.parametrize("tied", [False, True])
def test_float32_round_trip_and_hf_semantics(tmp_path, tied):
  config = _config(tied)
  params = _random_params(config, 1)
  files = hc.save_hf_checkpoint(str(tmp_path), config, params, dtype="float32")
  assert sorted(os.path.basename(f) for f in files) == ["config.json", "model.safetensors"]
  loaded_config, loaded = hc.load_hf_checkpoint(str(tmp_path))
  assert loaded_config == config
  _same_tree(params, loaded)
  # The file means the same model to an HF-convention reader ([out, in], rotate_half).
  raw = st_load_numpy(str(tmp_path / "model.safetensors"))
  assert ("lm_head.weight" in raw) == (not tied)
  assert raw["model.layers.1.self_attn.k_proj.weight"].shape == (8, 24)
  hf_cfg = json.loads((tmp_path / "config.json").read_text())
  tokens = np.random.default_rng(0).integers(0, 61, 11)
  want = _hf_numpy_forward(raw, hf_cfg, tokens)
  got = dense.forward(loaded, loaded_config, jnp.asarray(tokens))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bfloat16_written_by_safetensors_package(tmp_path):
  config = _config()
  params = _random_params(config, 2)
  # Build the HF tensors independently of our writer: [out, in], HF names, BF16.
  p = params["params"]
  tensors = {"model.embed_tokens.weight": p["model"]["embed_tokens"]["embedding"],
             "model.norm.weight": p["model"]["norm"]["weight"],
             "lm_head.weight": p["lm_head"]["kernel"].T,
             "model.layers.0.self_attn.rotary_emb.inv_freq": jnp.ones((2,))}
  for i in range(config.num_layers):
    layer = p["model"][f"layers_{i}"]
    for group in ("self_attn", "mlp"):
      for proj, leaf in layer[group].items():
        tensors[f"model.layers.{i}.{group}.{proj}.weight"] = leaf["kernel"].T
    for norm in ("input_layernorm", "post_attention_layernorm"):
      tensors[f"model.layers.{i}.{norm}.weight"] = layer[norm]["weight"]
  bf16 = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  st_save_numpy(bf16, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))
  loaded_config, loaded = hc.load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
  assert loaded_config.dtype == "bfloat16"
  assert jax.tree_util.tree_leaves(loaded)[0].dtype == jnp.bfloat16
  _same_tree(params, loaded, dtype=jnp.bfloat16)
  # And our bf16 writer is read back by the safetensors package bit for bit.
  hc.save_hf_checkpoint(str(tmp_path / "ours"), config, params, dtype="bfloat16")
  ours = st_load_numpy(str(tmp_path / "ours" / "model.safetensors"))
  for name, arr in bf16.items():
    if "inv_freq" not in name:
      assert ours[name].dtype == ml_dtypes.bfloat16
      np.testing.assert_array_equal(ours[name].view(np.uint16), arr.view(np.uint16), name)


def test_float16_file(tmp_path):
  config = _config()
  params = _random_params(config, 3)
  hc.save_hf_checkpoint(str(tmp_path), config, params, dtype="float16")
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F16"}
  _, loaded = hc.load_hf_checkpoint(str(tmp_path))
  _same_tree(params, loaded, dtype=jnp.float16)


def test_sharded_index(tmp_path):
  config = _config()
  params = _random_params(config, 4)
  files = hc.save_hf_checkpoint(str(tmp_path), config, params, dtype="float32",
                                max_shard_bytes=4000)
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) >= 3 and any(f.endswith(hc.INDEX_FILE) for f in files)
  _, loaded = hc.load_hf_checkpoint(str(tmp_path))
  _same_tree(params, loaded)
  # The index is honoured: a stray file it does not list is not read.
  st_save_numpy({"junk": np.ones(3, np.float32)}, str(tmp_path / "zz-extra.safetensors"))
  _, again = hc.load_hf_checkpoint(str(tmp_path))
  _same_tree(params, again)
  # A shard the index names but that is missing is reported.
  os.remove(shards[0])
  with pytest.raises(FileNotFoundError, match=os.path.basename(shards[0])):
    hc.load_hf_checkpoint(str(tmp_path))


def _write(tmp_path, config, tensors):
  st_save_numpy(tensors, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))


def _hf_tensors(tmp_path, config, seed=5):
  hc.save_hf_checkpoint(str(tmp_path / "src"), config, _random_params(config, seed), "float32")
  return st_load_numpy(str(tmp_path / "src" / "model.safetensors"))


def _load_error(tmp_path, exc=ValueError):
  with pytest.raises(exc) as info:
    hc.load_hf_checkpoint(str(tmp_path))
  return str(info.value)


def test_tensor_errors_name_file_and_tensor(tmp_path):
  config = _config()
  good = _hf_tensors(tmp_path, config)
  st_file = str(tmp_path / "model.safetensors")
  missing = dict(good)
  del missing["model.layers.1.mlp.up_proj.weight"]
  _write(tmp_path, config, missing)
  assert re.search(r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight",
                   _load_error(tmp_path))
  unknown = dict(good, **{"model.layers.0.self_attn.q_proj.bias": np.ones(24, np.float32)})
  _write(tmp_path, config, unknown)
  msg = _load_error(tmp_path)
  assert "unknown tensors" in msg and "model.layers.0.self_attn.q_proj.bias" in msg
  assert "model.safetensors" in msg
  wrong = dict(good, **{"model.layers.0.self_attn.k_proj.weight": np.ones((24, 8), np.float32)})
  _write(tmp_path, config, wrong)
  msg = _load_error(tmp_path)
  assert msg.startswith(st_file + ": tensor 'model.layers.0.self_attn.k_proj.weight'")
  assert "shape (24, 8), expected (8, 24)" in msg
  # An int32 weight is refused, not silently cast to float.
  ints = dict(good, **{"model.norm.weight": np.ones(24, np.int32)})
  _write(tmp_path, config, ints)
  msg = _load_error(tmp_path)
  assert msg.startswith(st_file + ": tensor 'model.norm.weight' has dtype I32"), msg
  # Harmless extras are ignored; the values loaded are the file's.
  _write(tmp_path, config, dict(good, **{"model.layers.1.self_attn.rotary_emb.inv_freq":
                                         np.ones(2, np.float32)}))
  _, params = hc.load_hf_checkpoint(str(tmp_path))
  np.testing.assert_array_equal(params["params"]["model"]["layers_1"]["mlp"]["up_proj"]["kernel"],
                                good["model.layers.1.mlp.up_proj.weight"].T)
  with pytest.raises(ValueError, match="dtype must be one of"):
    hc.load_hf_checkpoint(str(tmp_path), dtype="int8")


def test_config_errors_name_the_file(tmp_path):
  config = _config()
  _write(tmp_path, config, _hf_tensors(tmp_path, config))
  cfg = tmp_path / "config.json"
  hf = config.to_hf_config()
  for bad, want in [(dict(hf, model_type="gpt2"), "model_type='gpt2' is not supported; "
                      "supported: llama, mistral, qwen2, qwen3, gemma2, gemma3_text"),
                    (dict(hf, model_type="gemma3"), "text-only checkpoints have model_type "
                      "'gemma3_text'"),
                    (dict(hf, hidden_act="relu"), "hidden_act='relu' is not supported"),
                    (dict(hf, model_type="gemma2", hidden_activation="relu"),
                     "hidden_activation='relu' is not supported"),
                    (dict(hf, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                     "rope_scaling rope_type must be one of ['default', 'linear', 'llama3'], "
                     "got 'yarn'"),
                    (dict(hf, rope_scaling=None, rope_parameters={"rope_type": "dynamic",
                                                                  "factor": 2.0}),
                     "rope_parameters rope_type must be one of"),
                    (dict(hf, model_type="gemma3_text", attn_logit_softcapping=50.0),
                     "attn_logit_softcapping=50.0 is not supported for gemma3_text"),
                    (dict(hf, model_type="gemma2", use_bidirectional_attention=True),
                     "use_bidirectional_attention=true is not supported"),
                    (dict(hf, quantization_config={"quant_method": "gptq"}),
                     "quantization_config is not supported"),
                    (dict(hf, partial_rotary_factor=0.5), "partial_rotary_factor must be 1.0"),
                    (dict(hf, model_type="qwen2", use_sliding_window=True, sliding_window=4,
                          layer_types=["full_attention"]), "layer_types must list 2 of"),
                    (dict(hf, num_key_value_heads=4), "num_kv_heads"),
                    ([1, 2], "expected a JSON object")]:
    cfg.write_text(json.dumps(bad))
    msg = _load_error(tmp_path)
    assert msg.startswith(str(cfg) + ": ") and want in msg, msg
    assert "\n" not in msg
  cfg.write_text('{"vocab_size": 61,\n "hidden_size": }')
  assert _load_error(tmp_path) == f"{cfg}: not valid JSON (Expecting value at line 2 column 17)"
  cfg.write_bytes(b"\xff\xfe{}")
  assert "not valid JSON" in _load_error(tmp_path)
  assert "does not exist" in _load_error(tmp_path / "nowhere", FileNotFoundError)
  cfg.unlink()
  assert "no config.json" in _load_error(tmp_path, FileNotFoundError)


def test_tied_checkpoint_with_redundant_lm_head(tmp_path):
  config = _config(tied=True)
  good = _hf_tensors(tmp_path, config)
  assert "lm_head.weight" not in good
  _write(tmp_path, config, dict(good, **{"lm_head.weight": good["model.embed_tokens.weight"]}))
  loaded_config, loaded = hc.load_hf_checkpoint(str(tmp_path))
  assert loaded_config.tie_word_embeddings and "lm_head" not in loaded["params"]
  _write(tmp_path, config, dict(good, **{"lm_head.weight": good["model.embed_tokens.weight"] + 1}))
  with pytest.raises(ValueError, match="lm_head.weight"):
    hc.load_hf_checkpoint(str(tmp_path))


def test_truncated_and_corrupt_files_are_named(tmp_path):
  config = _config()
  hc.save_hf_checkpoint(str(tmp_path), config, _random_params(config, 6), "float32")
  path = tmp_path / "model.safetensors"
  raw = path.read_bytes()
  with safe_open(str(path), framework="numpy") as f:  # the tensor stored last is cut first
    [last] = [n for n in f.keys() if raw.endswith(f.get_tensor(n).tobytes())]
  path.write_bytes(raw[:-8])   # cuts into the last tensor only
  msg = _load_error(tmp_path)
  assert msg.startswith(f"{path}: truncated: tensor {last!r}"), msg
  path.write_bytes(raw[:20])
  assert _load_error(tmp_path).startswith(f"{path}: truncated: the header alone claims")
  (n,) = struct.unpack("<Q", raw[:8])
  path.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n:])
  assert _load_error(tmp_path).startswith(f"{path}: corrupt header (UnicodeDecodeError")
  path.write_bytes(raw[:8] + b"[" + raw[9:])
  assert _load_error(tmp_path).startswith(f"{path}: corrupt header (JSONDecodeError")
  path.write_bytes(b"abc")
  assert _load_error(tmp_path) == f"{path}: not a safetensors file (only 3 bytes)"


def test_llama3_style_sharded_bf16_tied_checkpoint(tmp_path):
  # What a current HF hub Llama-3.2 directory looks like: transformers-written config with
  # llama3 rope scaling, token-id lists and keys we ignore; bf16 shards plus an index;
  # tied embeddings without lm_head; written by the safetensors package, not by us.
  config = _config(tied=True, max_position_embeddings=512)
  params = _random_params(config, 7)
  hc.save_hf_checkpoint(str(tmp_path / "src"), config, params, dtype="float32")
  tensors = {k: v.astype(ml_dtypes.bfloat16)
             for k, v in st_load_numpy(str(tmp_path / "src" / "model.safetensors")).items()}
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[:7],
            "model-00002-of-00002.safetensors": names[7:]}
  for fn, part in shards.items():
    st_save_numpy({n: tensors[n] for n in part}, str(tmp_path / fn), metadata={"format": "pt"})
  (tmp_path / hc.INDEX_FILE).write_text(json.dumps(
      {"metadata": {"total_size": 1}, "weight_map": {n: fn for fn, p in shards.items()
                                                     for n in p}}))
  hf = dict(config.to_hf_config(), bos_token_id=1, eos_token_id=[2, 3], pretraining_tp=1,
            attention_dropout=0.0, initializer_range=0.02, use_cache=True, torch_dtype="bfloat16",
            transformers_version="4.45.0", rope_theta=500000.0,
            rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 64, "rope_type": "llama3"})
  del hf["head_dim"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  loaded_config, loaded = hc.load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
  assert loaded_config.head_dim == 4 and loaded_config.rope_theta == 500000.0
  assert dict(loaded_config.rope_scaling)["rope_type"] == "llama3"
  _same_tree(params, loaded, dtype=jnp.bfloat16)
  # The index names a shard that is gone: the message names it.
  (tmp_path / "model-00002-of-00002.safetensors").unlink()
  assert "model-00002-of-00002.safetensors" in _load_error(tmp_path, FileNotFoundError)
  (tmp_path / hc.INDEX_FILE).write_text('{"weight_map": 3}')
  assert "no 'weight_map' object" in _load_error(tmp_path)


@pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_CHECKPOINT, "config.json")),
                    reason="shipped checkpoint not built yet")
def test_shipped_checkpoint_writes_recognisable_text():
  config, params = hc.load_hf_checkpoint(DEFAULT_CHECKPOINT)
  assert config.vocab_size == tokenizer.VOCAB_SIZE
  assert 5e5 < llama.num_params(params) < 4e6
  prompt = tokenizer.encode("Once upon a time")
  out = dense.greedy_generate(params, config, prompt, 48, stop_token_ids=(tokenizer.EOS_ID,))
  text = tokenizer.decode(out)
  words = text.replace(",", " ").replace(".", " ").split()
  common = {"there", "was", "a", "little", "named", "in", "the", "lived", "called", "small",
            "house", "near", "by", "girl", "boy", "cat", "dog", "bird", "bear", "rabbit", "mouse"}
  assert sum(w.lower() in common for w in words) >= 4, text
