r"""Generate with the paged engine from a Hugging Face-format Llama checkpoint.

    python -m experiments.generate --checkpoint=DIR --prompt_ids=1,2,3;4,5 \
        --max_tokens=16 --temperature=0 --block_size=16 [--num_blocks=K]
    python -m experiments.generate --prompt="Once upon a time" --max_tokens=64

Prints only JSON on stdout: {"outputs": [[ids...], ...]} (one list per prompt;
with n > 1 or beam search, sample / hypothesis 0), plus "text" (decoded) when
--prompt is given (the byte-level tokenizer of the default shipped model).
Logs (cache sizing etc.) go to stderr. Cache shapes come from the checkpoint's
config (layers, KV heads, head dim), so any Llama size works; by default the
cache holds every request at once (no preemption) with block_size tokens per block.
"""

from __future__ import annotations

import json
import logging
import sys

from absl import app
from absl import flags

FLAGS = flags.FLAGS


def _define_flags(flag_values=flags.FLAGS):
  """Defines the CLI flags on `flag_values` (absl's global FLAGS when run as a script)."""
  flags.DEFINE_string("checkpoint", None, "HF Llama checkpoint dir (default: shipped tiny model)",
                      flag_values=flag_values)
  flags.DEFINE_string("prompt_ids", None, "token ids: '1,2,3' or several prompts '1,2;3,4'",
                      flag_values=flag_values)
  flags.DEFINE_multi_string("prompt", None, "text prompt(s) for the byte-level model",
                            flag_values=flag_values)
  flags.DEFINE_integer("max_tokens", 32, "tokens to generate per prompt", flag_values=flag_values)
  flags.DEFINE_float("temperature", 0.0, "0 = greedy", flag_values=flag_values)
  flags.DEFINE_integer("top_k", -1, "-1 = off", flag_values=flag_values)
  flags.DEFINE_float("top_p", 1.0, "nucleus mass in (0, 1]", flag_values=flag_values)
  flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=flag_values)
  flags.DEFINE_integer("n", 1, "parallel samples per prompt", flag_values=flag_values)
  flags.DEFINE_integer("beam_width", 1, "beam search width (1 = off)", flag_values=flag_values)
  flags.DEFINE_string("stop_token_ids", None, "comma-separated stop ids (text mode: EOS)",
                      flag_values=flag_values)
  flags.DEFINE_integer("block_size", 16, "tokens per KV-cache block", flag_values=flag_values)
  flags.DEFINE_integer("num_blocks", None, "KV-cache blocks (default: fits every request)",
                       flag_values=flag_values)
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


def _parse_ids(text: str, name: str):
  try:
    return [[int(t) for t in part.split(",") if t.strip()] for part in text.split(";")]
  except ValueError as e:
    raise app.UsageError(f"--{name} must be comma-separated ints ('1,2;3'), got {text!r}") from e


def run(checkpoint=None, prompt_ids=None, prompt=None, max_tokens=32, temperature=0.0,
        top_k=-1, top_p=1.0, seed=0, n=1, beam_width=1, stop_token_ids=None, block_size=16,
        num_blocks=None, max_seqs=None, max_num_batched_tokens=256, decode_steps_per_sync=1,
        preemption_mode="recompute", attention_backend="auto", dtype="float32") -> dict:
  """Loads the checkpoint, generates, returns {"outputs": [...](, "text": [...])}."""
  from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine, SamplingParams  # pylint: disable=g-import-not-at-top
  from paged_jax.models import DEFAULT_CHECKPOINT, load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  if (prompt_ids is None) == (not prompt):
    raise app.UsageError("give exactly one of --prompt_ids or --prompt")
  model_config, params = load_hf_checkpoint(checkpoint or DEFAULT_CHECKPOINT, dtype=dtype)
  if prompt:
    prompts = [tokenizer.encode(p) for p in prompt]
    stops = [tokenizer.EOS_ID] if model_config.vocab_size == tokenizer.VOCAB_SIZE else []
  else:
    prompts = _parse_ids(prompt_ids, "prompt_ids")
    stops = []
  if stop_token_ids is not None:
    stops = _parse_ids(stop_token_ids, "stop_token_ids")[0]
  sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, n=n, beam_width=beam_width, stop_token_ids=tuple(stops))
  seqs = sp.num_seqs
  longest = max(len(p) for p in prompts) + max_tokens
  blocks_per_seq = -(-min(longest, model_config.max_position_embeddings) // block_size)
  cache_config = model_config.cache_config(
      block_size=block_size,
      num_blocks=num_blocks or max(1, sum(seqs * (-(-(len(p) + max_tokens) // block_size))
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
    result["text"] = [tokenizer.decode(o.outputs[0]) for o in outs]
    for p, t in zip(prompt, result["text"]):
      logging.info("%s|%s", p, t)
  return result


def main(argv, flag_values=None):
  """Runs `run()` with the parsed flags (default: absl's global FLAGS); prints JSON."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  flag_values = FLAGS if flag_values is None else flag_values
  logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
  result = run(**{name: flag_values[name].value for name in (
      "checkpoint", "prompt_ids", "prompt", "max_tokens", "temperature", "top_k", "top_p",
      "seed", "n", "beam_width", "stop_token_ids", "block_size", "num_blocks", "max_seqs",
      "max_num_batched_tokens", "decode_steps_per_sync", "preemption_mode",
      "attention_backend", "dtype")})
  sys.stdout.write(json.dumps(result) + "\n")
  sys.stdout.flush()


if __name__ == "__main__":
  _define_flags()
  app.run(main)
