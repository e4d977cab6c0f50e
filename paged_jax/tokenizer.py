"""Byte-level tokenizer for the shipped default model.

Ids 0..255 are the raw UTF-8 bytes; `BOS_ID` (256) starts a document and
`EOS_ID` (257) ends one. `VOCAB_SIZE` (258) is the model's vocabulary. Any
text round-trips exactly: `decode(encode(s)) == s`.
"""

from __future__ import annotations

from typing import Iterable, List

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258


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
