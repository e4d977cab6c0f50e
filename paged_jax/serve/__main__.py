r"""`python -m paged_jax.serve`: an OpenAI-compatible server over one paged engine.

    python -m paged_jax.serve [--checkpoint=DIR|org/model] [--host=127.0.0.1] [--port=8000]
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "tiny_byte_llama", "prompt": "Once upon a time", "max_tokens": 32}'

Without --checkpoint it serves the shipped tiny byte-level model. SIGTERM (or Ctrl-C)
stops taking requests, lets running ones finish for up to --drain_s seconds, aborts the
rest and exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF checkpoint directory or hub id (default: the "
                    "shipped tiny model)")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
flags.DEFINE_integer("port", 8000, "port to listen on (0: any free one)", lower_bound=0,
                     upper_bound=65535)
flags.DEFINE_string("served_model_name", None, "model id in the API (default: the "
                    "checkpoint's name)")
flags.DEFINE_integer("max_model_len", 1024, "context length served (prompt + completion)",
                     lower_bound=2)
flags.DEFINE_integer("max_seqs", 32, "sequence slots: the most requests in a step",
                     lower_bound=1)
flags.DEFINE_integer("block_size", 16, "tokens per KV-cache block", lower_bound=1)
flags.DEFINE_integer("num_blocks", None, "KV-cache blocks (default: every slot at half the "
                     "context)", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 256, "per-step token budget", lower_bound=1)
flags.DEFINE_string("dtype", "float32", "parameter / KV dtype")
flags.DEFINE_string("attention_backend", "auto", "the engine's attention backend")
flags.DEFINE_integer("seed", 0, "seeds the sampling seeds of requests that give none")
flags.DEFINE_bool("enable_prefix_caching", True, "automatic prefix caching (as vLLM v1)")
flags.DEFINE_enum("warm_up", "none", ["none", "greedy", "all"], "compile every step shape "
                  "a request can reach before serving (greedy: those of greedy n = 1 "
                  "requests; all: any request); none: shapes compile on first use, seconds "
                  "each")
flags.DEFINE_float("drain_s", 30.0, "seconds SIGTERM lets running requests finish",
                   lower_bound=0)
flags.DEFINE_string("speculative_config", None, "speculative decoding as JSON, vLLM's keys, "
                    "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """What `build_app_from_config` needs (the flags above, as a value for tests)."""
  checkpoint: str = None
  served_model_name: str = None
  max_model_len: int = 1024
  max_seqs: int = 32
  block_size: int = 16
  num_blocks: int = None
  max_num_batched_tokens: int = 256
  dtype: str = "float32"
  attention_backend: str = "auto"
  seed: int = 0
  enable_prefix_caching: bool = True
  warm_up: str = "none"
  drain_s: float = 30.0
  speculative_config: str = None


def build_app_from_config(c: ServerConfig):
  """Loads the checkpoint (a directory or a hub id), builds the engine and the app."""
  from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  from paged_jax.models import DEFAULT_CHECKPOINT, load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  from paged_jax.models.hub import resolve_checkpoint  # pylint: disable=g-import-not-at-top
  from paged_jax.serve import app as app_lib, chat  # pylint: disable=g-import-not-at-top
  from paged_jax.serve.runner import EngineRunner  # pylint: disable=g-import-not-at-top
  try:   # checked before any loading
    spec = json.loads(c.speculative_config) if c.speculative_config else None
  except json.JSONDecodeError as e:
    raise ValueError(f"--speculative_config must be a JSON object, got "
                     f"{c.speculative_config!r} ({e})") from None
  directory = resolve_checkpoint(c.checkpoint or DEFAULT_CHECKPOINT)
  model_config, params = load_hf_checkpoint(directory, dtype=c.dtype)
  tok = tokenizer.for_checkpoint(directory)
  max_len = min(c.max_model_len, model_config.max_position_embeddings)
  per_seq = -(-max_len // c.block_size)
  cache_config = model_config.cache_config(
      block_size=c.block_size, max_seqs=c.max_seqs, max_blocks_per_seq=per_seq,
      num_blocks=c.num_blocks or max(per_seq, c.max_seqs * per_seq // 2),
      max_num_batched_tokens=c.max_num_batched_tokens, dtype=c.dtype,
      enable_prefix_caching=c.enable_prefix_caching)
  engine = Engine(model_config, params, cache_config,
                  max_num_batched_tokens=c.max_num_batched_tokens,
                  attention_backend=c.attention_backend, speculative_config=spec)
  if c.warm_up != "none":   # every shape a request reaches (all: up to n = 16 samples)
    from paged_jax.engine import reachable_buckets  # pylint: disable=g-import-not-at-top
    shapes = reachable_buckets(engine.buckets, max_rows=cache_config.max_seqs,
                               max_len=engine.max_model_len,
                               lanes_per_row=16 if c.warm_up == "all" else 1)
    done = engine.compile_buckets(shapes, all_greedy=(True,) if c.warm_up == "greedy" else
                                  (False, True))
    logging.info("warm-up: %s", done)
  runner = EngineRunner(engine, tok.decode)
  name = c.served_model_name or (c.checkpoint or os.path.basename(directory.rstrip("/")))
  return app_lib.build_app(
      runner, model_name=name, encode=tok.encode, decode=tok.decode,
      render_chat=chat.load_template(directory), stop_ids=tuple(tok.stop_ids),
      vocab_size=model_config.vocab_size, max_model_len=engine.max_model_len, seed=c.seed,
      drain_s=c.drain_s)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  import uvicorn  # pylint: disable=g-import-not-at-top
  logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
  fields = {f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(ServerConfig)}
  try:
    application = build_app_from_config(ServerConfig(**fields))
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"paged_jax.serve: {e}")
  # uvicorn's own SIGTERM / SIGINT handling: stop accepting, let open requests finish
  # (bounded by drain_s), then the app's shutdown aborts what is left.
  # uvicorn re-raises the signal it drained on at exit, to the handler found before it:
  # this one, so a drained SIGTERM ends the process with status 0.
  signal.signal(signal.SIGTERM, lambda *_: None)
  uvicorn.run(application, host=FLAGS.host, port=FLAGS.port, log_level="info",
              timeout_graceful_shutdown=max(1, int(FLAGS.drain_s)))


if __name__ == "__main__":
  app.run(main)
