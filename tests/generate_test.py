"""experiments.generate on a checkpoint that brings its own tokenizer.json: text in, text out."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from experiments import generate
from paged_jax.config import ModelConfig
from paged_jax.models import dense, llama, save_hf_checkpoint
from tokenizer_fixture import WORDS, write_tokenizer_json  # pylint: disable=g-bad-import-order


ROOT = str(pathlib.Path(__file__).resolve().parents[1])

# One cache shape for both tests (2 blocks of 8 per sequence), so the step compiles once.
RUN_KW = dict(max_tokens=6, block_size=8, num_blocks=8, max_seqs=2,
              attention_backend="reference")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt")
  config = ModelConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=48,
                       num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=64)
  params = llama.init_params(config, jax.random.key(3))
  # The model's EOS is word 7 ("cat"), so greedy decoding may stop on it.
  save_hf_checkpoint(str(path), config, params, dtype="float32",
                     extra_config={"bos_token_id": 1, "eos_token_id": 7})
  write_tokenizer_json(path / "tokenizer.json")
  return path, config, params


def test_text_prompt_uses_the_checkpoint_tokenizer(checkpoint):
  path, config, params = checkpoint
  result = generate.run(checkpoint=str(path), prompt=["once upon a", "a time"], **RUN_KW)
  prompts = [[1, 3, 4, 5], [1, 5, 6]]   # <s> + word ids, from the WordLevel vocabulary
  want = [dense.greedy_generate(params, config, p, 6, stop_token_ids=(7,)) for p in prompts]
  assert result["outputs"] == want
  # Decoded by the same tokenizer: words joined by spaces, special tokens dropped.
  assert result["text"] == [" ".join(WORDS[t] for t in ids if t > 2) for ids in want]
  json.dumps(result)


def test_token_ids_need_no_tokenizer(checkpoint):
  path, config, params = checkpoint
  (path / "tokenizer.json").rename(path / "moved.json")
  try:
    result = generate.run(checkpoint=str(path), prompt_ids="2,3,4;4", **RUN_KW)
    with pytest.raises(ValueError, match="no tokenizer.json"):
      generate.run(checkpoint=str(path), prompt=["once"], block_size=8)
  finally:
    (path / "moved.json").rename(path / "tokenizer.json")
  assert result == {"outputs": [dense.greedy_generate(params, config, p, 6, stop_token_ids=())
                                for p in ([2, 3, 4], [4])]}


SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, '
        '"prompt_lookup_min": 1}')


def test_speculative_config_drafts_and_greedy_outputs_equal_the_dense_model(checkpoint):
  """--speculative_config: prompt lookup proposes drafts (the prompts repeat themselves),
  and greedy outputs are the dense model's, token for token."""
  path, config, params = checkpoint
  prompts = [[2, 3, 4, 2, 3, 4, 2, 3], [5, 6, 5, 6, 5]]
  result = generate.run(checkpoint=str(path), prompt_ids="2,3,4,2,3,4,2,3;5,6,5,6,5",
                        speculative_config=SPEC, stop_token_ids="0", **RUN_KW)
  assert result["outputs"] == [dense.greedy_generate(params, config, p, 6, stop_token_ids=(0,))
                               for p in prompts]
  spec = result["speculative"]
  assert spec["spec_draft_tokens"] > 0
  assert 0 <= spec["spec_accepted_tokens"] <= spec["spec_draft_tokens"]


@pytest.mark.parametrize("value, says", [
    ("{not json", "must be a JSON object"),
    ("[3]", "must be a JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "[1, 16]"),
])
def test_bad_speculative_config_is_a_one_line_error_naming_the_flag(value, says):
  with pytest.raises(ValueError) as e:
    generate.Config(prompt_ids="1,2", speculative_config=value)
  text = str(e.value)
  assert text.startswith("--speculative_config") and says in text and "\n" not in text


def test_bad_speculative_config_exits_before_loading_a_model(tmp_path):
  """The CLI ends with one line `error: ...` naming the flag (no checkpoint is read: the
  directory given does not exist)."""
  r = subprocess.run([sys.executable, "-m", "experiments.generate", "--prompt_ids=1,2",
                      f"--checkpoint={tmp_path / 'absent'}", '--speculative_config={"k": 1}'],
                     cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: --speculative_config") and "unknown key 'k'" in last, r.stderr
