"""Trains a small Llama on a token stream (used by experiments/train_tiny.py).

Next-token cross-entropy over random windows of the stream, computed by the
dense forward (`dense.forward`, the same parameter tree the paged model uses),
optimised with optax AdamW under a linear-warmup + cosine-decay schedule and
global-norm gradient clipping. Notebooks can import `train` directly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, Sequence

import jax
import numpy as np
import optax

from paged_jax.config import ModelConfig
from paged_jax.models import dense, llama


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation settings. Lengths in tokens, learning rates per step."""
  steps: int = 600
  batch_size: int = 32
  seq_len: int = 128
  peak_lr: float = 3e-3
  end_lr_fraction: float = 0.05
  warmup_steps: int = 50
  weight_decay: float = 0.05
  clip_norm: float = 1.0
  eval_every: int = 50
  eval_batches: int = 4
  seed: int = 0

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
    if not self.peak_lr > 0 or not self.clip_norm > 0:
      raise ValueError(f"peak_lr and clip_norm must be > 0, got {self.peak_lr}, {self.clip_norm}")


def stream_from_documents(docs: Sequence[Sequence[int]]) -> np.ndarray:
  """Concatenates already-framed documents (e.g. BOS ... EOS) into one i32 stream."""
  return np.concatenate([np.asarray(d, np.int32) for d in docs])


def make_optimizer(tc: TrainConfig):
  """-> (optax transformation, learning-rate schedule)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.peak_lr, warmup_steps=tc.warmup_steps,
      decay_steps=tc.steps, end_value=tc.peak_lr * tc.end_lr_fraction)
  # No weight decay on norms (1-D weights), as is usual for Llama training.
  decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)
  return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay,
                                 mask=decay_mask)), schedule


def loss_fn(params, config: ModelConfig, windows: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) of windows i32[B, L+1]."""
  logits = dense.forward(params, config, windows[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def _windows(stream: np.ndarray, rng: np.random.Generator, batch: int, length: int):
  starts = rng.integers(0, len(stream) - length - 1, size=batch)
  return np.stack([stream[s:s + length + 1] for s in starts])


def train(config: ModelConfig, train_stream: np.ndarray, eval_stream: np.ndarray,
          tc: TrainConfig = TrainConfig(),
          log: Optional[Callable[[dict], None]] = None):
  """Trains from scratch.

  Args:
    config: the model (float32 training).
    train_stream / eval_stream: i32 token streams.
    tc: TrainConfig.
    log: called with each history record.

  Returns:
    (params, history): params `{"params": ...}`; history a list of dicts with
    step, train_loss (mean since the last record), eval_loss (when evaluated),
    lr, elapsed_s.
  """
  if len(train_stream) <= tc.seq_len + 1 or len(eval_stream) <= tc.seq_len + 1:
    raise ValueError(f"streams must be longer than seq_len + 1 = {tc.seq_len + 1} tokens")
  params = llama.init_params(config, jax.random.key(tc.seed))
  opt, schedule = make_optimizer(tc)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, config, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  eval_loss_fn = jax.jit(lambda p, b: loss_fn(p, config, b))
  rng = np.random.default_rng(tc.seed)
  eval_rng = np.random.default_rng(tc.seed + 1)
  eval_sets = [_windows(eval_stream, eval_rng, tc.batch_size, tc.seq_len)
               for _ in range(tc.eval_batches)]
  history: List[dict] = []
  t0, acc = time.perf_counter(), []
  for i in range(1, tc.steps + 1):
    params, opt_state, loss = step(params, opt_state, _windows(train_stream, rng, tc.batch_size,
                                                               tc.seq_len))
    acc.append(loss)
    if i % tc.eval_every == 0 or i == tc.steps or i == 1:
      rec = {"step": i, "train_loss": float(np.mean(jax.device_get(acc))),
             "lr": float(schedule(i)), "elapsed_s": round(time.perf_counter() - t0, 2)}
      rec["eval_loss"] = float(np.mean([eval_loss_fn(params, b) for b in eval_sets]))
      acc = []
      history.append(rec)
      if log:
        log(rec)
  return params, history
