"""Every experiment CLI ends a bad flag value with one line `error: ...` and exit status 1.

The cases run in one driver process (tests/cli_driver.py forks per case), so the dozen
cases cost one JAX import, not twelve.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Not error output: jaxlib's C++ logging when a child first touches the backend, and the
# engine's start-up INFO log (cache sizing) that precedes a request it then refuses.
NOISE = ("absl::InitializeLog", "cudart_stub.cc", "INFO:paged_jax")


def _cases(tmp):
  a_file = os.path.join(tmp, "a_file")
  open(a_file, "w").close()
  no_tok = os.path.join(tmp, "no_tokenizer")
  os.makedirs(no_tok)
  with open(os.path.join(no_tok, "config.json"), "w") as f:
    json.dump({"model_type": "llama", "vocab_size": 32000}, f)
  g, m = "experiments.generate", "experiments.memory_waste"
  return {   # name: (module, argv, a phrase the one error line must hold)
      "empty_prompt": (g, ["--prompt_ids=1,2;;3"], "prompt 2 of '1,2;;3' is empty"),
      "id_outside_vocab": (g, ["--prompt_ids=1,999", "--attention_backend=reference"],
                           "999"),
      "negative_max_tokens": (g, ["--prompt_ids=1", "--max_tokens=-1"], "--max_tokens=-1"),
      "block_size_0": (g, ["--prompt_ids=1", "--block_size=0"], "block_size must be in"),
      "block_size_24": (g, ["--prompt_ids=1", "--block_size=24"], "power of two"),
      "temperature_nan": (g, ["--prompt_ids=1", "--temperature=nan"], "--temperature"),
      "one_block": (g, ["--prompt_ids=1,2,3", "--max_tokens=40", "--num_blocks=1",
                        "--attention_backend=reference"], "num_blocks=1"),
      "missing_checkpoint": (g, ["--prompt_ids=1", f"--checkpoint={tmp}/nowhere"],
                             "does not exist"),
      "no_tokenizer": (g, ["--prompt=hi", f"--checkpoint={no_tok}"], "no tokenizer.json"),
      "stray_argument": (g, ["--prompt_ids=1", "stray"], "unexpected arguments"),
      "memory_waste_block_size_7": (m, ["--block_size=7"], "power of two"),
      "memory_waste_out_is_a_file": (m, [f"--out={a_file}"], "is a file, not a directory"),
      "memory_waste_unknown_flag": (m, ["--num_request=5"], "num_request"),
      "compilation_cache_under_a_file": (m, [f"--compilation_cache={a_file}/xla"],
                                         "cannot be created"),
      "generate_help": (g, ["--help"], None),
      "memory_waste_help": (m, ["--helpfull"], None),
  }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("cli"))
  cases = _cases(tmp)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "cli_driver.py"),
       json.dumps([(mod, argv) for mod, argv, _ in cases.values()])],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
  return {name: (res, cases[name][2])
          for name, res in zip(cases, json.loads(proc.stdout))}


ERROR_CASES = ["empty_prompt", "id_outside_vocab", "negative_max_tokens", "block_size_0",
               "block_size_24", "temperature_nan", "one_block", "missing_checkpoint",
               "no_tokenizer", "stray_argument", "memory_waste_block_size_7",
               "memory_waste_out_is_a_file", "memory_waste_unknown_flag",
               "compilation_cache_under_a_file"]


@pytest.mark.parametrize("name", ERROR_CASES)
def test_bad_value_is_one_line_and_exit_1(results, name):
  res, phrase = results[name]
  lines = [l for l in res["stderr"].splitlines() if l.strip() and not any(n in l for n in NOISE)]
  assert res["rc"] == 1, res
  assert len(lines) == 1 and lines[0].startswith("error: "), res["stderr"]
  assert phrase in lines[0]
  assert res["stdout"] == ""


@pytest.mark.parametrize("name", ["generate_help", "memory_waste_help"])
def test_help_fits_a_screen(results, name):
  res, _ = results[name]
  lines = res["stdout"].splitlines()
  assert res["rc"] == 0 and 8 <= len(lines) <= 40, res
  assert lines[0] and "flags:" in lines and any(l.startswith("  --block_size") for l in lines)
