"""experiments/train_tiny at a tiny size: a few optimiser steps on the shipped stories, and
the checkpoint it writes loads back as the model it trained (same config, same parameters)
with the loss record and the greedy sample beside it."""

import json
import math

import jax
import numpy as np
import pytest

from experiments import train_tiny
from paged_jax import tokenizer
from paged_jax.models import hf_checkpoint
from paged_jax.models import llama


@pytest.mark.slow   # ~28 s on 2 cores (load 7): the train step and a 160-token sample
def test_few_steps_write_a_checkpoint_that_loads_back(tmp_path):
  out = tmp_path / "ckpt"
  f = train_tiny.Config(out=str(out), steps=6, batch_size=2, seq_len=16, warmup_steps=1,
                        hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, max_position_embeddings=256, sample_prompt="Once")
  train_tiny.main(f, None)
  record = json.loads((out / "loss_curve.json").read_text())
  assert [h["step"] for h in record["history"]] == [1, 6]
  first, last = record["history"]
  # From about ln(vocab) (a random model) down, at 3e-3 for 5 steps.
  assert math.isfinite(last["eval_loss"]) and last["train_loss"] < first["train_loss"]
  assert first["train_loss"] < math.log(tokenizer.VOCAB_SIZE) + 0.5
  assert record["greedy_sample"].startswith("Once") and record["train_tokens"] > 0
  config, params = hf_checkpoint.load_hf_checkpoint(str(out))
  assert (config.hidden_size, config.num_layers, config.num_kv_heads) == (16, 1, 1)
  assert config.vocab_size == tokenizer.VOCAB_SIZE
  assert llama.num_params(params) == record["num_params"]
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
  assert all(np.isfinite(x).all() for x in leaves)
  assert (out / "loss_curve.png").stat().st_size > 0
