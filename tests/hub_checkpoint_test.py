"""Checkpoints by name: a hub id resolves through huggingface_hub's own cache, offline.

The test builds a hub cache itself (the layout huggingface_hub writes: refs/main naming a
snapshot directory of the repository's files) holding a copy of the shipped model, so no
network is touched; `HF_HUB_OFFLINE=1` proves the cached snapshot is used as is.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from paged_jax.models import DEFAULT_CHECKPOINT
from paged_jax.models.hub import resolve_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
  repo = tmp_path / "hub" / "models--paged-jax--tiny-byte-llama"
  snap = repo / "snapshots" / REVISION
  snap.mkdir(parents=True)
  for name in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(DEFAULT_CHECKPOINT, name), snap / name)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(REVISION)
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  import huggingface_hub.constants as c  # the constants are read at import: point them too
  monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
  monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
  return str(snap)


def test_a_directory_is_itself():
  assert resolve_checkpoint(DEFAULT_CHECKPOINT) == DEFAULT_CHECKPOINT


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub_cache):
  assert os.path.samefile(resolve_checkpoint("paged-jax/tiny-byte-llama"), hub_cache)


@pytest.mark.parametrize("name", ["paged-jax/not-cached", "no-slash-and-no-dir", ""])
def test_an_unresolvable_name_is_a_one_line_error(hub_cache, name):
  with pytest.raises(ValueError, match="checkpoint") as e:
    resolve_checkpoint(name)
  assert "\n" not in str(e.value)


def test_generate_takes_a_hub_id(hub_cache):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  args = ["--max_tokens=4", "--temperature=0", "--prompt_ids=256,79,110"]
  outs = [subprocess.run([sys.executable, "-m", "experiments.generate", f"--checkpoint={c}",
                          *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout
          for c in ("paged-jax/tiny-byte-llama", DEFAULT_CHECKPOINT)]
  assert json.loads(outs[0]) == json.loads(outs[1])
