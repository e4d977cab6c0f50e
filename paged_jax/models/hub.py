"""Checkpoints by name: a local directory, or a Hugging Face hub id resolved to one.

    directory = resolve_checkpoint("Qwen/Qwen2.5-0.5B-Instruct")   # or "/path/to/dir"

A hub id goes through `huggingface_hub.snapshot_download`, so its local cache
(`HF_HOME` / `HF_HUB_CACHE`) and offline mode (`HF_HUB_OFFLINE=1`) apply exactly as for
transformers: a cached snapshot is used without any network access; only the files the
engine reads (config, safetensors, tokenizer) are fetched.
"""

from __future__ import annotations

import os

# What the engine and its tokenizer read; nothing else is downloaded.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors",
                    "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")


def resolve_checkpoint(name: str) -> str:
  """The checkpoint directory for `name`: itself if it is a directory, else the local
  snapshot of the hub repository `name` ("org/model"), downloaded unless cached.

  Raises a one-line ValueError naming `checkpoint` when `name` is neither an existing
  directory nor a hub id that resolves (offline and not cached, unknown repository).
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"checkpoint must be a directory or a hub id 'org/model', got {name!r}")
  if os.path.isdir(name):
    return name
  if name.count("/") != 1 or name.startswith(("/", ".", "~")):
    raise ValueError(f"checkpoint directory {name!r} does not exist (nor is it a hub id "
                     f"'org/model')")
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  try:
    return huggingface_hub.snapshot_download(repo_id=name, allow_patterns=list(CHECKPOINT_FILES))
  except Exception as e:  # offline without a cached copy, unknown repo, network errors
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f"checkpoint {name!r} is not a directory and did not resolve as a hub "
                     f"id ({type(e).__name__}: {first})") from None
