r"""Trains the shipped default model: a tiny byte-level Llama.

    python -m experiments.train_tiny --out=paged_jax/assets/tiny_byte_llama

Reads experiments/data/stories.txt (stories written by this project, see
experiments/data/README.md), frames each story as BOS bytes EOS, holds out the
last 5% for evaluation, trains with `paged_jax.models.train.train`, and writes
a Hugging Face-format checkpoint (config.json + model.safetensors) plus
loss_curve.json / loss_curve.png and a greedy sample to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import flags
import jax

from experiments import common
from paged_jax import tokenizer
from paged_jax.config import ModelConfig
from paged_jax.models import dense, hf_checkpoint, llama, train

_DATA = os.path.join(os.path.dirname(__file__), "data", "stories.txt")

FLAGS = flags.FLAGS


def _define_flags():
  """Defines this script's flags on absl's global FLAGS (only when run as a script)."""
  flags.DEFINE_string("data", _DATA, "UTF-8 text; documents separated by blank lines.")
  flags.DEFINE_string("out", "paged_jax/assets/tiny_byte_llama", "checkpoint directory")
  flags.DEFINE_integer("steps", 600, "optimiser steps")
  flags.DEFINE_integer("batch_size", 32, "windows per step")
  flags.DEFINE_integer("seq_len", 128, "tokens per window")
  flags.DEFINE_float("peak_lr", 3e-3, "peak learning rate")
  flags.DEFINE_integer("warmup_steps", 50, "linear warmup steps")
  flags.DEFINE_integer("hidden_size", 128, "model width")
  flags.DEFINE_integer("intermediate_size", 384, "SwiGLU width")
  flags.DEFINE_integer("num_layers", 4, "decoder layers")
  flags.DEFINE_integer("num_heads", 4, "query heads")
  flags.DEFINE_integer("num_kv_heads", 2, "K/V heads")
  flags.DEFINE_integer("max_position_embeddings", 1024, "context length recorded in config.json")
  flags.DEFINE_bool("tie_word_embeddings", False, "share embedding and LM head")
  flags.DEFINE_enum("save_dtype", "float32", ["float32", "bfloat16"], "stored tensor dtype")
  flags.DEFINE_string("sample_prompt", "Once upon a time", "prompt of the greedy sample")
  flags.DEFINE_integer("seed", 0, "init and data seed")


def load_streams(path: str):
  """-> (train stream, eval stream) of BOS+bytes+EOS documents (i32)."""
  with open(path, encoding="utf-8") as f:
    docs = [d.strip() for d in f.read().split("\n\n") if d.strip()]
  split = max(1, int(len(docs) * 0.95))
  enc = lambda ds: train.stream_from_documents(
      [tokenizer.encode(d, add_bos=True, add_eos=True) for d in ds])
  return enc(docs[:split]), enc(docs[split:])


def plot_curve(history, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  steps = [h["step"] for h in history]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(steps, [h["train_loss"] for h in history], label="train")
  ax.plot(steps, [h["eval_loss"] for h in history], label="held-out")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats / byte)")
  ax.set_yscale("log")
  ax.set_title("tiny_byte_llama")
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(f, out):
  """Runs with the parsed flags (absl's global FLAGS, read below) into `out`."""
  del f
  config = ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=FLAGS.hidden_size,
                       intermediate_size=FLAGS.intermediate_size, num_layers=FLAGS.num_layers,
                       num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
                       max_position_embeddings=FLAGS.max_position_embeddings,
                       tie_word_embeddings=FLAGS.tie_word_embeddings, rms_norm_eps=1e-5)
  tc = train.TrainConfig(steps=FLAGS.steps, batch_size=FLAGS.batch_size, seq_len=FLAGS.seq_len,
                         peak_lr=FLAGS.peak_lr, warmup_steps=FLAGS.warmup_steps,
                         seed=FLAGS.seed)
  train_stream, eval_stream = load_streams(FLAGS.data)
  print(f"train {len(train_stream)} tokens, held-out {len(eval_stream)} tokens")
  log = lambda r: print(f"step {r['step']:5d}  train {r['train_loss']:.4f}  "
                        f"held-out {r['eval_loss']:.4f}  lr {r['lr']:.2e}  {r['elapsed_s']:.0f}s",
                        flush=True)
  params, history = train.train(config, train_stream, eval_stream, tc, log=log)
  print(f"{llama.num_params(params)} parameters")
  hf_checkpoint.save_hf_checkpoint(
      FLAGS.out, config, params, dtype=FLAGS.save_dtype,
      extra_config={"bos_token_id": tokenizer.BOS_ID, "eos_token_id": tokenizer.EOS_ID})
  prompt = tokenizer.encode(FLAGS.sample_prompt)
  sample = dense.greedy_generate(params, config, prompt, 160, stop_token_ids=(tokenizer.EOS_ID,))
  text = FLAGS.sample_prompt + tokenizer.decode(sample)
  with open(os.path.join(FLAGS.out, "loss_curve.json"), "w") as f:
    json.dump({"model": config.to_hf_config(), "train": dataclasses.asdict(tc),
               "num_params": llama.num_params(params), "history": history,
               "train_tokens": int(len(train_stream)), "eval_tokens": int(len(eval_stream)),
               "greedy_sample": text, "backend": jax.default_backend(),
               **common.run_metadata(FLAGS)}, f, indent=1)
  plot_curve(history, os.path.join(FLAGS.out, "loss_curve.png"))
  print("greedy sample:", text)


if __name__ == "__main__":
  common.run_app(main, _define_flags)
