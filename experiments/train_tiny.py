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

import jax

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax import tokenizer
from paged_jax.config import ModelConfig
from paged_jax.models import dense, hf_checkpoint, llama, train

_DATA = os.path.join(os.path.dirname(__file__), "data", "stories.txt")

@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.train_tiny."""
  data: str = configs.flag(_DATA, "UTF-8 text; documents separated by blank lines")
  out: str = configs.flag("paged_jax/assets/tiny_byte_llama", "checkpoint directory")
  steps: int = configs.flag(600, "optimiser steps", lower=1)
  batch_size: int = configs.flag(32, "windows per step", lower=1)
  seq_len: int = configs.flag(128, "tokens per window", lower=2)
  peak_lr: float = configs.flag(3e-3, "peak learning rate", lower=0.0, lower_open=True)
  warmup_steps: int = configs.flag(50, "linear warmup steps", lower=0)
  hidden_size: int = configs.flag(128, "model width", lower=1)
  intermediate_size: int = configs.flag(384, "SwiGLU width", lower=1)
  num_layers: int = configs.flag(4, "decoder layers", lower=1)
  num_heads: int = configs.flag(4, "query heads", lower=1)
  num_kv_heads: int = configs.flag(2, "K/V heads", lower=1)
  max_position_embeddings: int = configs.flag(1024, "context length recorded in config.json",
                                              lower=1)
  tie_word_embeddings: bool = configs.flag(False, "share embedding and LM head")
  save_dtype: str = configs.flag("float32", "stored tensor dtype",
                                 choices=("float32", "bfloat16"))
  sample_prompt: str = configs.flag("Once upon a time", "prompt of the greedy sample")
  seed: int = configs.flag(0, "init and data seed")


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


def main(f: Config, out):
  """Trains with settings `f`; writes the checkpoint into `out` (the `common.run_app` main)."""
  config = ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=f.hidden_size,
                       intermediate_size=f.intermediate_size, num_layers=f.num_layers,
                       num_heads=f.num_heads, num_kv_heads=f.num_kv_heads,
                       max_position_embeddings=f.max_position_embeddings,
                       tie_word_embeddings=f.tie_word_embeddings, rms_norm_eps=1e-5)
  tc = train.TrainConfig(steps=f.steps, batch_size=f.batch_size, seq_len=f.seq_len,
                         peak_lr=f.peak_lr, warmup_steps=f.warmup_steps,
                         seed=f.seed)
  train_stream, eval_stream = load_streams(f.data)
  print(f"train {len(train_stream)} tokens, held-out {len(eval_stream)} tokens")
  log = lambda r: print(f"step {r['step']:5d}  train {r['train_loss']:.4f}  "
                        f"held-out {r['eval_loss']:.4f}  lr {r['lr']:.2e}  {r['elapsed_s']:.0f}s",
                        flush=True)
  params, history = train.train(config, train_stream, eval_stream, tc, log=log)
  print(f"{llama.num_params(params)} parameters")
  hf_checkpoint.save_hf_checkpoint(
      f.out, config, params, dtype=f.save_dtype,
      extra_config={"bos_token_id": tokenizer.BOS_ID, "eos_token_id": tokenizer.EOS_ID})
  prompt = tokenizer.encode(f.sample_prompt)
  sample = dense.greedy_generate(params, config, prompt, 160, stop_token_ids=(tokenizer.EOS_ID,))
  text = f.sample_prompt + tokenizer.decode(sample)
  with open(os.path.join(f.out, "loss_curve.json"), "w") as fh:
    json.dump({"model": config.to_hf_config(), "train": dataclasses.asdict(tc),
               "num_params": llama.num_params(params), "history": history,
               "train_tokens": int(len(train_stream)), "eval_tokens": int(len(eval_stream)),
               "greedy_sample": text, "backend": jax.default_backend(),
               **provenance.run_metadata(f)}, fh, indent=1)
  plot_curve(history, os.path.join(f.out, "loss_curve.png"))
  print("greedy sample:", text)


if __name__ == "__main__":
  common.run_app(main, Config)
