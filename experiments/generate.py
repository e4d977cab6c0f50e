r"""Generate with the paged engine from a Hugging Face-format checkpoint (Llama, Qwen2 /
Qwen2.5, Qwen3, Mistral, Gemma-2, Gemma-3 text; see paged_jax/hf_config.py).

    python -m experiments.generate --checkpoint=DIR --prompt_ids='1,2,3;4,5' \
        --max_tokens=16 --temperature=0 --block_size=16 [--num_blocks=K]
    python -m experiments.generate [--checkpoint=DIR] --prompt="Once upon a time"

Prints only JSON on stdout: {"outputs": [[ids...], ...]} (one list per prompt;
with n > 1 or beam search, sample / hypothesis 0), plus "text" (decoded) when
--prompt is given, and "speculative" (draft tokens proposed and accepted) with
--speculative_config='{"method": "ngram", "num_speculative_tokens": 3}' (vLLM's keys,
as the server's flag; docs/notes/speculative.md). Text goes through the checkpoint's own tokenizer.json (the
`tokenizers` package), or the byte-level tokenizer of the shipped default model.
Logs (cache sizing etc.) go to stderr. Cache shapes come from the checkpoint's
config (layers, KV heads, head dim), so any model size works; by default the
cache holds every request at once (no preemption) with block_size tokens per block.
A bad flag value ends with one line `error: ...` and exit status 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Optional, Tuple

from experiments import common
from experiments import configs
from paged_jax.config import cdiv, check_block_size

PREEMPTION_MODES = ("recompute", "swap")


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.generate (no --out: the JSON goes to stdout)."""
  checkpoint: Optional[str] = configs.flag(
      None, "HF checkpoint dir or hub id org/model (default: the shipped tiny model)")
  prompt_ids: Optional[str] = configs.flag(
      None, "token ids: '1,2,3' or several prompts '1,2;3,4'")
  prompt: Optional[Tuple[str, ...]] = configs.flag(None, "text prompt(s) (repeat the flag)",
                                                   multi=True)
  max_tokens: int = configs.flag(32, "tokens to generate per prompt", lower=1)
  temperature: float = configs.flag(0.0, "0 = greedy", lower=0.0)
  top_k: int = configs.flag(-1, "-1 = off", lower=-1)
  top_p: float = configs.flag(1.0, "nucleus mass", lower=0.0, lower_open=True, upper=1.0)
  seed: int = configs.flag(0, "sampling seed")
  n: int = configs.flag(1, "parallel samples per prompt", lower=1)
  beam_width: int = configs.flag(1, "beam search width (1 = off)", lower=1)
  stop_token_ids: Optional[str] = configs.flag(None, "comma-separated stop ids (text mode: EOS)")
  block_size: int = configs.flag(16, "tokens per KV-cache block (a power of two)", lower=1,
                                 upper=1024)
  num_blocks: Optional[int] = configs.flag(None, "KV-cache blocks (default: fits every request)",
                                           lower=1)
  max_seqs: Optional[int] = configs.flag(None, "sequence slots (default: all requests at once)",
                                         lower=1)
  max_num_batched_tokens: int = configs.flag(256, "per-step token budget", lower=1)
  decode_steps_per_sync: int = configs.flag(1, "decode steps per host sync", lower=1)
  preemption_mode: str = configs.flag("recompute", "preemption", choices=PREEMPTION_MODES)
  attention_backend: str = configs.flag(
      "auto", "a paged_jax.attention spelling: auto|reference|xla|cpu|pallas|"
      "pallas_interpret, or pallas[_interpret]:triton|mosaic_gpu|tpu")
  dtype: str = configs.flag("float32", "parameter / KV dtype")
  hybrid_kv: Optional[bool] = configs.flag(
      None, "sliding-window layers give back blocks that slid out of the window (needs "
      "sliding and full layers; recompute); default: on for such models (Gemma-2 / 3)")
  speculative_config: Optional[str] = configs.flag(
      None, "speculative decoding as JSON, vLLM's keys (as python -m paged_jax.serve), e.g. "
      "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")

  def check(self) -> None:
    # Checks that need no model, so a bad value fails in a blink.
    if (self.prompt_ids is None) == (not self.prompt):
      raise ValueError("give exactly one of --prompt_ids or --prompt")
    check_block_size(self.block_size)   # before any division by it
    if self.prompt_ids is not None:
      parse_ids(self.prompt_ids, "prompt_ids")
    if self.stop_token_ids is not None:
      parse_ids(self.stop_token_ids, "stop_token_ids")
    parse_speculative(self.speculative_config)


def define_flags(flag_values=None):
  """Defines the CLI flags on `flag_values` (absl's global FLAGS by default)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  configs.define_flags(Config, flags.FLAGS if flag_values is None else flag_values)


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


def parse_speculative(text: Optional[str]) -> Optional[dict]:
  """--speculative_config's JSON -> the engine's `speculative_config` dict (None: off),
  checked by `speculative.parse`; a one-line ValueError naming the flag otherwise."""
  if text is None:
    return None
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"--speculative_config must be a JSON object, got {text!r} ({e})"
                     ) from None
  if not isinstance(config, dict):
    raise ValueError(f"--speculative_config must be a JSON object, got {text!r}")
  from paged_jax.engine import speculative  # pylint: disable=g-import-not-at-top
  try:
    speculative.parse(config)
  except ValueError as e:
    raise ValueError(f"--speculative_config: {e}") from None
  return config


def run(config: Optional[Config] = None, **fields) -> dict:
  """Loads the checkpoint, generates, returns {"outputs": [...](, "text": [...])}.

  `config`, or its fields as keywords (`run(prompt_ids="1,2", max_tokens=4)`)."""
  c = config if config is not None else Config(**fields)
  ids = None if c.prompt else parse_ids(c.prompt_ids, "prompt_ids")
  checkpoint, prompt, max_tokens = c.checkpoint, c.prompt, c.max_tokens
  block_size, dtype = c.block_size, c.dtype
  from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine, SamplingParams  # pylint: disable=g-import-not-at-top
  from paged_jax.models import DEFAULT_CHECKPOINT, load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  from paged_jax.models.hub import resolve_checkpoint  # pylint: disable=g-import-not-at-top
  checkpoint = resolve_checkpoint(checkpoint or DEFAULT_CHECKPOINT)
  if prompt:
    tok = tokenizer.for_checkpoint(checkpoint)
    prompts = [tok.encode(p) for p in prompt]
    stops = list(tok.stop_ids)
  else:
    prompts, stops = ids, []
  if c.stop_token_ids is not None:
    stops = parse_ids(c.stop_token_ids, "stop_token_ids")[0]
  model_config, params = load_hf_checkpoint(checkpoint, dtype=dtype)
  sp = SamplingParams(max_tokens=max_tokens, temperature=c.temperature, top_k=c.top_k,
                      top_p=c.top_p, seed=c.seed, n=c.n, beam_width=c.beam_width,
                      stop_token_ids=tuple(stops))
  seqs = sp.num_seqs
  longest = max(len(p) for p in prompts) + max_tokens
  blocks_per_seq = cdiv(min(longest, model_config.max_position_embeddings), block_size)
  cache_config = model_config.cache_config(
      # Hybrid KV by default where it applies, but not under swap (it recomputes).
      hybrid_kv=False if c.hybrid_kv is None and c.preemption_mode != "recompute" else
      c.hybrid_kv, max_num_batched_tokens=c.max_num_batched_tokens,
      decode_steps_per_sync=c.decode_steps_per_sync, block_size=block_size,
      num_blocks=c.num_blocks or max(1, sum(seqs * cdiv(len(p) + max_tokens, block_size)
                                          for p in prompts)),
      max_seqs=c.max_seqs or min(256, seqs * len(prompts)),
      max_blocks_per_seq=max(1, blocks_per_seq),
      dtype=dtype)
  engine = Engine(model_config, params, cache_config,
                  max_num_batched_tokens=c.max_num_batched_tokens,
                  decode_steps_per_sync=c.decode_steps_per_sync,
                  preemption_mode=c.preemption_mode, attention_backend=c.attention_backend,
                  max_beam_width=max(4, c.beam_width),
                  speculative_config=parse_speculative(c.speculative_config))
  outs = engine.generate(prompts, sp)
  logging.info("preemptions=%d swaps=%d steps=%d", engine.num_preemptions, engine.num_swaps,
               engine.stats["steps"])
  result = {"outputs": [o.outputs[0] for o in outs]}
  if c.speculative_config is not None:   # drafts proposed / accepted (Engine.metrics)
    m = engine.metrics()
    result["speculative"] = {key: m[key] for key in ("spec_draft_tokens",
                                                      "spec_accepted_tokens")}
  if prompt:
    result["text"] = [tok.decode(o.outputs[0]) for o in outs]
    for p, t in zip(prompt, result["text"]):
      logging.info("%s|%s", p, t)
  return result


def cli(config: Config, out=None):
  """Runs `run(config)` and prints its JSON (the `common.run_app` main)."""
  del out  # prints to stdout; no --out
  logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
  result = run(config)
  sys.stdout.write(json.dumps(result) + "\n")
  sys.stdout.flush()


def main(argv, flag_values=None):
  """`cli()` on already parsed flags (default: absl's global FLAGS); argv must be [prog]."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}")
  cli(configs.from_flags(Config, flags.FLAGS if flag_values is None else flag_values))


if __name__ == "__main__":
  common.run_app(cli, Config)
