"""Every experiment CLI ends a bad flag value with one line `error: ...` and exit status 1:
a field's type, range or choices (`experiments.configs`), a rule between fields
(`Config.check`), or a value the library refuses.

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
  sb, bs = "experiments.serving_benchmark", "experiments.block_size_sweep"
  pc = "experiments.perf_calibrate"
  out = f"--out={tmp}/out"
  return {   # name: (module, argv, a phrase the one error line must hold)
      "empty_prompt": (g, ["--prompt_ids=1,2;;3"], "prompt 2 of '1,2;;3' is empty"),
      "id_outside_vocab": (g, ["--prompt_ids=1,999", "--attention_backend=reference"],
                           "999"),
      "negative_max_tokens": (g, ["--prompt_ids=1", "--max_tokens=-1"],
                              "--max_tokens must be an int >= 1, got -1"),
      "max_tokens_not_an_int": (g, ["--prompt_ids=1", "--max_tokens=many"], "--max_tokens"),
      "block_size_0": (g, ["--prompt_ids=1", "--block_size=0"],
                       "--block_size must be an int in [1, 1024], got 0"),
      "top_p_0": (g, ["--prompt_ids=1", "--top_p=0"], "--top_p must be a finite number in (0, 1]"),
      "no_prompt": (g, [], "give exactly one of --prompt_ids or --prompt"),
      "preemption_mode": (g, ["--prompt_ids=1", "--preemption_mode=drop"],
                          "--preemption_mode must be one of recompute, swap, got 'drop'"),
      "block_size_24": (g, ["--prompt_ids=1", "--block_size=24"], "power of two"),
      "temperature_nan": (g, ["--prompt_ids=1", "--temperature=nan"], "--temperature"),
      "one_block": (g, ["--prompt_ids=1,2,3", "--max_tokens=40", "--num_blocks=1",
                        "--attention_backend=reference"], "num_blocks=1"),
      "missing_checkpoint": (g, ["--prompt_ids=1", f"--checkpoint={tmp}/nowhere"],
                             "does not exist"),
      "no_tokenizer": (g, ["--prompt=hi", f"--checkpoint={no_tok}"], "no tokenizer.json"),
      "stray_argument": (g, ["--prompt_ids=1", "stray"], "unexpected arguments"),
      "memory_waste_block_size_7": (m, ["--block_size=7"], "--block_size must be a power of two"),
      "memory_waste_watermark": (m, ["--watermark=1"], "--watermark must be a finite number in "
                                 "[0, 1), got 1.0"),
      "memory_waste_workload": (m, ["--workload=wiki"], "--workload must be one of sharegpt, "
                                "alpaca, got 'wiki'"),
      "memory_waste_out_is_a_file": (m, [f"--out={a_file}"], "is a file, not a directory"),
      "memory_waste_unknown_flag": (m, ["--num_request=5"], "num_request"),
      "compilation_cache_under_a_file": (m, [f"--compilation_cache={a_file}/xla"],
                                         "cannot be created"),
      "serving_rate_0": (sb, ["--rates=0", out],
                         "--rates must be a finite number > 0 or auto, got 0.0"),
      "serving_rates_auto_and_list": (sb, ["--rates=auto,2", out],
                                      "--rates must be auto or a list of rates"),
      "serving_unknown_gpu": (sb, ["--clock=model", "--gpu=v100", out],
                              "--gpu must be one of a100-40gb, a100-80gb, h100-sxm, h200"),
      "serving_unknown_model": (sb, ["--clock=model", "--model=gpt-4", out],
                                "--model must be one of opt-13b"),
      "serving_weights_fill_the_gpu": (sb, ["--clock=model", "--model=opt-175b", "--tp=1", out],
                                       "opt-175b leaves no KV memory on 1 x a100-40gb"),
      "serving_tp_heads": (sb, ["--clock=model", "--model=opt-66b", "--tp=5", out],
                           "tp must divide opt-66b's num_heads=72, got 5"),
      "serving_rate_not_a_number": (sb, ["--rates=2,x", out], "--rates: 'x' is not a number"),
      "serving_unknown_system": (sb, ["--systems=paged,orca_fifo", out],
                                 "--systems must be one of paged, orca_max, orca_pow2, "
                                 "orca_oracle, got 'orca_fifo'"),
      "serving_no_arrival": (sb, ["--duration_s=0.001", out], "admits no request"),
      "serving_swap_cost": (sb, ["--swap_s_per_token=-1", out],
                            "--swap_s_per_token must be a finite number >= 0"),
      "serving_slo_factor": (sb, ["--slo_factor=0.5", out], "--slo_factor must be a finite "
                             "number >= 1"),
      "sweep_engine_block_sizes": (bs, ["--block_sizes=16", "--engine_block_sizes=32", out],
                                   "--engine_block_sizes [32] are not in --block_sizes"),
      "sweep_num_requests": (bs, ["--num_requests=alpaca:0", out],
                             "--num_requests[alpaca] must be an int >= 1, got 0"),
      "sweep_num_requests_pairs": (bs, ["--num_requests=alpaca", out], "key:value pairs"),
      "sharing_width_7": ("experiments.sharing", ["--widths=2,7", out],
                          "--widths must be an int in [1, 6], got 7"),
      "step_cost_long": ("experiments.step_cost", ["--short=8", "--long=8", out],
                         "--long must be > --short=8"),
      "throughput_budget": ("experiments.throughput", ["--kv_budget_tokens=128", out],
                            "--kv_budget_tokens must be >= --max_len=256"),
      "prefix_caching_prompt_len": ("experiments.prefix_caching",
                                    ["--system_prompt_lens=256,900", out],
                                    "--system_prompt_lens must be an int in [1, 896], got 900"),
      "hf_peer_random_pair": ("experiments.hf_peer_bench", ["--random_hidden_size=512", out],
                              "--random_hidden_size and --random_num_layers go together"),
      "block_manager_small_pool": ("experiments.block_manager_bench",
                                   ["--num_blocks_list=16", "--cpu_cores=0", out],
                                   "--num_blocks_list: 16 blocks is too small"),
      "calibrate_unknown_gpu": (pc, ["--gpu=v100", out], "--gpu must be one of a100-40gb"),
      "calibrate_not_a_llama": (pc, ["--model=opt-13b", out],
                                "--model must be one of llama-13b, llama-3-8b, gemma-2-9b, "
                                "gemma-2-27b, mistral-7b, got 'opt-13b'"),
      "calibrate_small_pool": (pc, ["--kv_budget_tokens=1024", out],
                               "--kv_budget_tokens must be >= 33280 (the largest batch"),
      "paper_scale_paged_first": ("experiments.paper_scale", ["--systems=orca_max,paged", out],
                                  "--systems must start with paged"),
      "generate_help": (g, ["--help"], None),
      "memory_waste_help": (m, ["--helpfull"], None),
  }


@pytest.fixture(scope="module")
def cli_tmp(tmp_path_factory):
  return str(tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def results(cli_tmp):
  cases = _cases(cli_tmp)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "cli_driver.py"),
       json.dumps([(mod, argv) for mod, argv, _ in cases.values()])],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
  return {name: (res, cases[name][2])
          for name, res in zip(cases, json.loads(proc.stdout))}


ERROR_CASES = ["empty_prompt", "id_outside_vocab", "negative_max_tokens",
               "max_tokens_not_an_int", "block_size_0", "block_size_24", "top_p_0", "no_prompt",
               "preemption_mode", "temperature_nan", "one_block", "missing_checkpoint",
               "no_tokenizer", "stray_argument", "memory_waste_block_size_7",
               "memory_waste_watermark", "memory_waste_workload",
               "memory_waste_out_is_a_file", "memory_waste_unknown_flag",
               "compilation_cache_under_a_file", "serving_rate_0", "serving_rates_auto_and_list",
               "serving_unknown_gpu", "serving_unknown_model", "serving_weights_fill_the_gpu",
               "serving_tp_heads", "serving_rate_not_a_number",
               "serving_unknown_system", "serving_no_arrival", "serving_swap_cost",
               "serving_slo_factor", "sweep_engine_block_sizes", "sweep_num_requests",
               "sweep_num_requests_pairs", "sharing_width_7", "step_cost_long",
               "throughput_budget", "prefix_caching_prompt_len", "hf_peer_random_pair",
               "block_manager_small_pool", "calibrate_unknown_gpu", "calibrate_not_a_llama",
               "calibrate_small_pool", "paper_scale_paged_first"]


@pytest.mark.parametrize("name", ERROR_CASES)
def test_bad_value_is_one_line_and_exit_1(results, name):
  res, phrase = results[name]
  lines = [l for l in res["stderr"].splitlines() if l.strip() and not any(n in l for n in NOISE)]
  assert res["rc"] == 1, res
  assert len(lines) == 1 and lines[0].startswith("error: "), res["stderr"]
  assert phrase in lines[0]
  assert res["stdout"] == ""


def test_bad_values_write_nothing(results, cli_tmp):
  # Refused while the settings are built, before the --out directory is made.
  assert results["serving_rate_0"][0]["rc"] == 1
  assert not os.path.exists(os.path.join(cli_tmp, "out"))


@pytest.mark.parametrize("name", ["generate_help", "memory_waste_help"])
def test_help_fits_a_screen(results, name):
  res, _ = results[name]
  lines = res["stdout"].splitlines()
  assert res["rc"] == 0 and 8 <= len(lines) <= 40, res
  assert lines[0] and "flags:" in lines and any(l.startswith("  --block_size") for l in lines)
