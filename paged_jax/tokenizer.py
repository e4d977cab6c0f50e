"""Text <-> token ids: the byte-level tokenizer of the shipped model, and a checkpoint's own.

Byte level (the shipped default model, `paged_jax/assets/tiny_byte_llama`): ids
0..255 are the raw UTF-8 bytes; `BOS_ID` (256) starts a document and `EOS_ID`
(257) ends one. `VOCAB_SIZE` (258) is the model's vocabulary. Any text
round-trips exactly: `decode(encode(s)) == s`.

Any other Hugging Face checkpoint brings its tokenizer as `tokenizer.json`, read
by the `tokenizers` package (no download, no transformers):

    tok = tokenizer.for_checkpoint(directory)   # ByteTokenizer or HFTokenizer
    ids = tok.encode("Once upon a time")        # with the checkpoint's BOS etc.
    text = tok.decode(generated_ids)            # special tokens dropped
    tok.stop_ids                                # EOS ids (config / generation_config)
"""

from __future__ import annotations

import os
from typing import Iterable, List, Mapping, Tuple

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258
TOKENIZER_FILE = "tokenizer.json"


def encode(text: str, *, add_bos: bool = True, add_eos: bool = False) -> List[int]:
  """UTF-8 bytes of `text` as ids, optionally framed by BOS / EOS."""
  if not isinstance(text, str):
    raise TypeError(f"text must be a str, got {type(text).__name__}")
  ids = list(text.encode("utf-8"))
  if add_bos:
    ids.insert(0, BOS_ID)
  if add_eos:
    ids.append(EOS_ID)
  return ids


def decode(ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
  """Text of `ids`: BOS is dropped, decoding stops at EOS (unless told not to).

  Byte sequences that are not valid UTF-8 (a model may emit them) become U+FFFD.
  Raises ValueError naming the first id outside [0, VOCAB_SIZE).
  """
  out = bytearray()
  for i, tok in enumerate(ids):
    tok = int(tok)
    if not 0 <= tok < VOCAB_SIZE:
      raise ValueError(f"ids[{i}]={tok} is outside [0, {VOCAB_SIZE})")
    if tok == EOS_ID:
      if stop_at_eos:
        break
      continue
    if tok == BOS_ID:
      continue
    out.append(tok)
  return out.decode("utf-8", errors="replace")


class ByteTokenizer:
  """The byte-level tokenizer above as an object (the shipped model's)."""

  stop_ids: Tuple[int, ...] = (EOS_ID,)

  def encode(self, text: str) -> List[int]:
    return encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    return decode(ids)


class HFTokenizer:
  """A checkpoint's `tokenizer.json` through the `tokenizers` package.

  `encode` adds the special tokens the file's post-processor defines (e.g. Llama-3's
  `<|begin_of_text|>`); `decode` drops special tokens. `stop_ids` are given by the caller
  (see `for_checkpoint`).
  """

  def __init__(self, path: str, stop_ids: Tuple[int, ...] = ()):
    import tokenizers  # pylint: disable=g-import-not-at-top
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception subclasses
      raise ValueError(f"{path}: not a readable tokenizers file ({e})") from None
    self.path = path
    self.stop_ids = tuple(stop_ids)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> List[int]:
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    return list(self._tok.encode(text, add_special_tokens=True).ids)

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _id_list(value) -> Tuple[int, ...]:
  if value is None:
    return ()
  return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def is_byte_level(hf_config: Mapping) -> bool:
  """True for a config.json of this project's byte-level models (see experiments/train_tiny)."""
  return (hf_config.get("vocab_size") == VOCAB_SIZE and hf_config.get("bos_token_id") == BOS_ID
          and _id_list(hf_config.get("eos_token_id")) == (EOS_ID,))


def for_checkpoint(directory: str):
  """The tokenizer of a checkpoint directory: its tokenizer.json if present, else the byte
  tokenizer when config.json describes a byte-level model; ValueError otherwise.

  Stop ids: `eos_token_id` of generation_config.json if present, else of config.json.
  """
  from paged_jax.models.hf_checkpoint import read_json  # pylint: disable=g-import-not-at-top
  cfg_path = os.path.join(directory, "config.json")
  hf = read_json(cfg_path) if os.path.exists(cfg_path) else {}
  path = os.path.join(directory, TOKENIZER_FILE)
  if os.path.exists(path):
    gen_path = os.path.join(directory, "generation_config.json")
    gen = read_json(gen_path) if os.path.exists(gen_path) else {}
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    return HFTokenizer(path, _id_list(eos))
  if isinstance(hf, dict) and is_byte_level(hf):
    return ByteTokenizer()
  raise ValueError(f"{directory}: no {TOKENIZER_FILE} and not a byte-level model; "
                   "give token ids with --prompt_ids instead of text")
