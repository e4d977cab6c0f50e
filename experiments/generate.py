r"""Generate with the paged engine from a Hugging Face-format checkpoint (Llama, Qwen2 /
Qwen2.5, Qwen3, Mistral, Gemma-2, Gemma-3 text; see paged_jax/hf_config.py).

    python -m experiments.generate --checkpoint=DIR --prompt_ids='1,2,3;4,5' \
        --max_tokens=16 --temperature=0 --block_size=16 [--num_blocks=K]
    python -m experiments.generate [--checkpoint=DIR] --prompt="Once upon a time"

Prints only JSON on stdout: {"outputs": [[ids...], ...]} (one list per prompt;
with n > 1 or beam search, sample / hypothesis 0), plus "text" (decoded) when
--prompt is given. Text goes through the checkpoint's own tokenizer.json (the
`tokenizers` package), or the byte-level tokenizer of the shipped default model.
Logs (cache sizing etc.) go to stderr. Cache shapes come from the checkpoint's
config (layers, KV heads, head dim), so any model size works; by default the
cache holds every request at once (no preemption) with block_size tokens per block.
A bad flag value ends with one line `error: ...` and exit status 1.
"""

from __future__ import annotations

import json
import logging
import math
import sys

from absl import flags

from experiments import common
from paged_jax.config import cdiv, check_block_size

FLAGS = flags.FLAGS


def define_flags(flag_values=flags.FLAGS):
  """Defines the CLI flags on `flag_values` (absl's global FLAGS when run as a script)."""
  flags.DEFINE_string("checkpoint", None, "HF checkpoint dir (default: shipped tiny model)",
                      flag_values=flag_values)
  flags.DEFINE_string("prompt_ids", None, "token ids: '1,2,3' or several prompts '1,2;3,4'",
                      flag_values=flag_values)
  flags.DEFINE_multi_string("prompt", None, "text prompt(s) for the byte-level model",
                            flag_values=flag_values)
  flags.DEFINE_integer("max_tokens", 32, "tokens to generate per prompt", lower_bound=1,
                       flag_values=flag_values)
  flags.DEFINE_float("temperature", 0.0, "0 = greedy", flag_values=flag_values)
  flags.register_validator("temperature", lambda t: math.isfinite(t) and t >= 0,
                           "--temperature must be a finite number >= 0",
                           flag_values=flag_values)
  flags.DEFINE_integer("top_k", -1, "-1 = off", flag_values=flag_values)
  flags.DEFINE_float("top_p", 1.0, "nucleus mass in (0, 1]", flag_values=flag_values)
  flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=flag_values)
  flags.DEFINE_integer("n", 1, "parallel samples per prompt", flag_values=flag_values)
  flags.DEFINE_integer("beam_width", 1, "beam search width (1 = off)", flag_values=flag_values)
  flags.DEFINE_string("stop_token_ids", None, "comma-separated stop ids (text mode: EOS)",
                      flag_values=flag_values)
  flags.DEFINE_integer("block_size", 16, "tokens per KV-cache block (a power of two)",
                       flag_values=flag_values)
  flags.DEFINE_integer("num_blocks", None, "KV-cache blocks (default: fits every request)",
                       lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("max_seqs", None, "sequence slots (default: all requests at once)",
                       flag_values=flag_values)
  flags.DEFINE_integer("max_num_batched_tokens", 256, "per-step token budget",
                       flag_values=flag_values)
  flags.DEFINE_integer("decode_steps_per_sync", 1, "decode steps per host sync",
                       flag_values=flag_values)
  flags.DEFINE_enum("preemption_mode", "recompute", ["recompute", "swap"], "preemption",
                    flag_values=flag_values)
  flags.DEFINE_string("attention_backend", "auto", "auto|reference|pallas|pallas_interpret",
                      flag_values=flag_values)
  flags.DEFINE_string("dtype", "float32", "parameter / KV dtype", flag_values=flag_values)


def parse_ids(text: str, name: str):
  """'1,2;3' -> [[1, 2], [3]]; ValueError naming the flag for anything else (an empty
  prompt, a non-integer, a negative id)."""
  out = []
  for i, part in enumerate(text.split(";")):
    try:
      ids = [int(t) for t in part.split(",") if t.strip()]
    except ValueError:
      raise ValueError(f"--{name} must be comma-separated ints ('1,2;3'), got {text!r}"
                       ) from None
    if not ids:
      raise ValueError(f"--{name}: prompt {i + 1} of {text!r} is empty")
    if min(ids) < 0:
      raise ValueError(f"--{name}: ids must be >= 0, got {min(ids)} in {text!r}")
    out.append(ids)
  return out


def run(checkpoint=None, prompt_ids=None, prompt=None, max_tokens=32, temperature=0.0,
        top_k=-1, top_p=1.0, seed=0, n=1, beam_width=1, stop_token_ids=None, block_size=16,
        num_blocks=None, max_seqs=None, max_num_batched_tokens=256, decode_steps_per_sync=1,
        preemption_mode="recompute", attention_backend="auto", dtype="float32") -> dict:
  """Loads the checkpoint, generates, returns {"outputs": [...](, "text": [...])}."""
  # Flag checks first: they need no model, so a bad value fails in a blink.
  if (prompt_ids is None) == (not prompt):
    raise ValueError("give exactly one of --prompt_ids or --prompt")
  check_block_size(block_size)   # before any division by it
  ids = None if prompt else parse_ids(prompt_ids, "prompt_ids")
  from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine, SamplingParams  # pylint: disable=g-import-not-at-top
  from paged_jax.models import DEFAULT_CHECKPOINT, load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  checkpoint = checkpoint or DEFAULT_CHECKPOINT
  if prompt:
    tok = tokenizer.for_checkpoint(checkpoint)
    prompts = [tok.encode(p) for p in prompt]
    stops = list(tok.stop_ids)
  else:
    prompts, stops = ids, []
  if stop_token_ids is not None:
    stops = parse_ids(stop_token_ids, "stop_token_ids")[0]
  model_config, params = load_hf_checkpoint(checkpoint, dtype=dtype)
  sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, n=n, beam_width=beam_width, stop_token_ids=tuple(stops))
  seqs = sp.num_seqs
  longest = max(len(p) for p in prompts) + max_tokens
  blocks_per_seq = cdiv(min(longest, model_config.max_position_embeddings), block_size)
  cache_config = model_config.cache_config(
      block_size=block_size,
      num_blocks=num_blocks or max(1, sum(seqs * cdiv(len(p) + max_tokens, block_size)
                                          for p in prompts)),
      max_seqs=max_seqs or min(256, seqs * len(prompts)),
      max_blocks_per_seq=max(1, blocks_per_seq),
      dtype=dtype)
  engine = Engine(model_config, params, cache_config,
                  max_num_batched_tokens=max_num_batched_tokens,
                  decode_steps_per_sync=decode_steps_per_sync,
                  preemption_mode=preemption_mode, attention_backend=attention_backend,
                  max_beam_width=max(4, beam_width))
  outs = engine.generate(prompts, sp)
  logging.info("preemptions=%d swaps=%d steps=%d", engine.num_preemptions, engine.num_swaps,
               engine.stats["steps"])
  result = {"outputs": [o.outputs[0] for o in outs]}
  if prompt:
    result["text"] = [tok.decode(o.outputs[0]) for o in outs]
    for p, t in zip(prompt, result["text"]):
      logging.info("%s|%s", p, t)
  return result


FLAG_NAMES = ("checkpoint", "prompt_ids", "prompt", "max_tokens", "temperature", "top_k",
              "top_p", "seed", "n", "beam_width", "stop_token_ids", "block_size", "num_blocks",
              "max_seqs", "max_num_batched_tokens", "decode_steps_per_sync", "preemption_mode",
              "attention_backend", "dtype")


def cli(flag_values, out=None):
  """Runs `run()` with the parsed flags and prints its JSON (the `common.run_app` main)."""
  del out  # prints to stdout; no --out
  logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
  result = run(**{name: flag_values[name].value for name in FLAG_NAMES})
  sys.stdout.write(json.dumps(result) + "\n")
  sys.stdout.flush()


def main(argv, flag_values=None):
  """`cli()` on already parsed flags (default: absl's global FLAGS); argv must be [prog]."""
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  cli(FLAGS if flag_values is None else flag_values)


if __name__ == "__main__":
  common.run_app(cli, define_flags)
