"""The Gemma-like hybrid model (sliding-window and full-attention layers) shared by the
hybrid KV tests, and its dense greedy oracle (cache-free, `paged_jax/models/dense.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distributed_fixtures import random_params
from paged_jax.config import ModelConfig
from paged_jax.models import dense

F, S = "full_attention", "sliding_attention"
# Gemma-3-like: 2 sliding layers per full one, window 6 (1.5 blocks of 4), soft cap, GeGLU,
# sandwich norms, local RoPE base.
GEMMA = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=3, num_heads=2,
    num_kv_heads=1, head_dim=16, model_type="gemma3_text", hidden_act="gelu_pytorch_tanh",
    qk_norm=True, rms_norm_unit_offset=True, sandwich_norms=True, embedding_multiplier=32**0.5,
    query_pre_attn_scalar=20.0, attn_logit_softcapping=3.0, sliding_window=6,
    layer_types=(S, F, S), sliding_rope_theta=10.0, max_position_embeddings=128)
PARAMS = random_params(GEMMA, 7)
ORACLE_LEN = 64
_DENSE = jax.jit(lambda p, t: dense.forward(p, GEMMA, t))


def dense_greedy(prompt, n):
  """n greedy tokens after `prompt` by full recomputation (len(prompt) + n <= 64)."""
  ids = list(prompt)
  for _ in range(n):
    buf = np.zeros((ORACLE_LEN,), np.int32)
    buf[:len(ids)] = ids
    ids.append(int(np.argmax(np.asarray(_DENSE(PARAMS, jnp.asarray(buf)))[len(ids) - 1])))
  return ids[len(prompt):]


def run_through_an_interrupt(monkeypatch, engine, point, k):
  """Steps `engine` to the end with one KeyboardInterrupt raised at its k-th step dispatch
  (`point` "dispatch") or k-th host wait for outputs ("wait"), which must reach the caller;
  then steps on without it. Returns {request_id: outputs} of every finished request."""
  count = {"n": 0}

  def wrap(fn):
    def wrapped(*a, **kw):
      count["n"] += 1
      if count["n"] == k:
        raise KeyboardInterrupt
      return fn(*a, **kw)
    return wrapped

  outs = {}
  with monkeypatch.context() as m:
    if point == "dispatch":
      m.setattr(engine, "_step", wrap(engine._step))   # pylint: disable=protected-access
    else:
      m.setattr(jax, "device_get", wrap(jax.device_get))
    with pytest.raises(KeyboardInterrupt):
      while engine.has_unfinished():
        outs.update({o.request_id: o.outputs for o in engine.step()})
  while engine.has_unfinished():
    outs.update({o.request_id: o.outputs for o in engine.step()})
  return outs
