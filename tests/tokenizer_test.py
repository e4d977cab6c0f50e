"""Tokenizers: the byte-level one of the shipped model, a checkpoint's tokenizer.json."""

import json

import pytest

from paged_jax import tokenizer
from tokenizer_fixture import WORDS, write_tokenizer_json  # pylint: disable=g-bad-import-order


def test_byte_round_trip_and_errors():
  text = "Once upon a time, naïve café — 猫. \n"
  ids = tokenizer.encode(text, add_bos=True, add_eos=True)
  assert ids[0] == tokenizer.BOS_ID and ids[-1] == tokenizer.EOS_ID
  assert ids[1:-1] == list(text.encode("utf-8"))
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode(ids + [65], stop_at_eos=True) == text
  assert tokenizer.decode(ids + [65], stop_at_eos=False) == text + "A"
  assert tokenizer.decode([0xE7, 0x8C]) == "\ufffd"  # truncated UTF-8 from a model
  with pytest.raises(ValueError, match=r"ids\[1\]=258"):
    tokenizer.decode([65, 258])


def test_checkpoint_tokenizer_json(tmp_path):
  write_tokenizer_json(tmp_path / "tokenizer.json")
  (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8, "eos_token_id": 2}))
  tok = tokenizer.for_checkpoint(str(tmp_path))
  assert tok.encode("once upon a time") == [1, 3, 4, 5, 6]
  assert tok.encode("a dog") == [1, 5, 0]
  assert tok.decode([1, 7, 3, 2]) == "cat once"   # BOS / EOS (special) dropped
  assert tok.stop_ids == (2,) and tok.vocab_size == len(WORDS)
  # generation_config.json's EOS list wins over config.json's.
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
  assert tokenizer.for_checkpoint(str(tmp_path)).stop_ids == (2, 7)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizers file"):
    tokenizer.for_checkpoint(str(tmp_path))


def test_byte_model_and_neither(tmp_path):
  byte_cfg = {"vocab_size": 258, "bos_token_id": 256, "eos_token_id": 257}
  (tmp_path / "config.json").write_text(json.dumps(byte_cfg))
  tok = tokenizer.for_checkpoint(str(tmp_path))
  assert tok.encode("hi") == [256, 104, 105] and tok.decode([104, 105, 257, 65]) == "hi"
  assert tok.stop_ids == (257,)
  (tmp_path / "config.json").write_text(json.dumps(dict(byte_cfg, vocab_size=32000)))
  with pytest.raises(ValueError, match="no tokenizer.json and not a byte-level model"):
    tokenizer.for_checkpoint(str(tmp_path))


def test_shipped_model_is_byte_level():
  from paged_jax.models import DEFAULT_CHECKPOINT
  assert isinstance(tokenizer.for_checkpoint(DEFAULT_CHECKPOINT), tokenizer.ByteTokenizer)
