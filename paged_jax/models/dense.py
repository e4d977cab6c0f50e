"""Plain-jnp dense decoder forward: the test oracle (and the training forward).

Written independently of `decoder.py`: no cache, no Flax, full recomputation of
every position with an explicit causal (and, per layer, sliding-window) mask. It reads the
same parameter tree (`DecoderForCausalLM` layout, see `decoder.py`) and the same
ModelConfig, every family's fields included, so a paged forward can be compared against
it. RoPE is computed here in complex form: feature pairs (x[i], x[i + D/2]) are the real
and imaginary parts of one complex number rotated by `pos * inv_freq[i]`, which is exactly
what Hugging Face's `rotate_half` formulation computes.

All math runs in float32 with the highest matmul precision, whatever the
parameter dtype.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig

_HI = jax.lax.Precision.HIGHEST
_ACT = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def _rms_norm(x, weight, config: ModelConfig):
  """x [..., H] f32 -> [..., H]; scales by (1 + weight) for Gemma-style norms."""
  var = jnp.mean(x * x, axis=-1, keepdims=True)
  scale = _f32(weight) + (1.0 if config.rms_norm_unit_offset else 0.0)
  return x / jnp.sqrt(var + config.rms_norm_eps) * scale


def _linear(x, p):
  """x [..., in] @ kernel [in, out] (+ bias when the tree has one)."""
  y = jnp.matmul(x, _f32(p["kernel"]), precision=_HI)
  return y + _f32(p["bias"]) if "bias" in p else y


def _rope_complex(x, positions, inv_freq):
  """x [B, L, heads, D], positions i32[B, L], inv_freq f32[D/2] -> x rotated (HF pairing)."""
  d = x.shape[-1]
  half = d // 2
  inv_freq = jnp.asarray(inv_freq, jnp.float32)                 # [D/2]
  angle = positions.astype(jnp.float32)[..., None] * inv_freq    # [B, L, D/2]
  rot = jnp.exp(1j * angle.astype(jnp.complex64))[:, :, None, :]  # [B, L, 1, D/2]
  z = (x[..., :half] + 1j * x[..., half:]).astype(jnp.complex64) * rot
  return jnp.concatenate([jnp.real(z), jnp.imag(z)], axis=-1).astype(jnp.float32)


def _causal_attention(q, k, v, valid, positions, *, scale, soft_cap=None, window=None):
  """q [B, L, Hq, D], k/v [B, L, Hkv, D], valid bool[B, L], positions i32[B, L] ->
  [B, L, Hq, D]. Query row i sees key j <= i (and positions[j] > positions[i] - window)."""
  b, l, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  qg = q.reshape(b, l, hkv, group, d)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, precision=_HI) * scale
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  mask = jnp.tril(jnp.ones((l, l), bool))[None] & valid[:, None, :]      # [B, q, s]
  if window is not None:
    mask &= positions[:, None, :] > positions[:, :, None] - window
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  # A row with no visible key (only possible for masked-out query rows) gets zeros.
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.exp(scores - row_max)
  probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, precision=_HI)
  return out.reshape(b, l, hq, d)


def _attention_block(p, c: ModelConfig, layer: int, h, positions, valid):
  """One layer's self-attention on normed h [B, L, H] -> [B, L, H]."""
  b, l, _ = h.shape
  q = _linear(h, p["q_proj"]).reshape(b, l, c.num_heads, c.head_dim)
  k = _linear(h, p["k_proj"]).reshape(b, l, c.num_kv_heads, c.head_dim)
  v = _linear(h, p["v_proj"]).reshape(b, l, c.num_kv_heads, c.head_dim)
  if c.qk_norm:
    q = _rms_norm(q, p["q_norm"]["weight"], c)
    k = _rms_norm(k, p["k_norm"]["weight"], c)
  window = c.layer_sliding_window(layer)
  inv_freq = c.rope_inv_freq(sliding=window is not None)
  q, k = _rope_complex(q, positions, inv_freq), _rope_complex(k, positions, inv_freq)
  scale = c.attention_scale or c.head_dim ** -0.5
  att = _causal_attention(q, k, v, valid, positions, scale=scale,
                          soft_cap=c.attn_logit_softcapping, window=window)
  return _linear(att.reshape(b, l, c.num_heads * c.head_dim), p["o_proj"])


def _mlp(p, c: ModelConfig, h):
  return _linear(_ACT[c.hidden_act](_linear(h, p["gate_proj"])) * _linear(h, p["up_proj"]),
                 p["down_proj"])


def forward(params: Mapping[str, Any], config: ModelConfig, tokens: jax.Array,
            positions: Optional[jax.Array] = None,
            valid: Optional[jax.Array] = None) -> jax.Array:
  """Logits of every position, recomputed from scratch.

  Args:
    params: the `DecoderForCausalLM` parameter tree (`{"model": ..., "lm_head"?: ...}`),
      with or without an outer `{"params": ...}` wrapper.
    config: the model's ModelConfig.
    tokens: i32[L] or i32[B, L] token ids.
    positions: RoPE positions, same shape as tokens (default 0..L-1); sliding windows
      count in these positions.
    valid: bool, same shape as tokens; False keys are never attended to
      (right padding). Default all True.

  Returns:
    f32[L, vocab] or f32[B, L, vocab] logits.
  """
  if "params" in params:
    params = params["params"]
  single = tokens.ndim == 1
  if single:
    tokens = tokens[None]
    positions = None if positions is None else positions[None]
    valid = None if valid is None else valid[None]
  b, l = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  if valid is None:
    valid = jnp.ones((b, l), bool)
  c = config
  m = params["model"]
  emb_param = m["embed_tokens"]["embedding"]
  emb = _f32(emb_param)                                          # [V, H]
  # The multiplier rounded to the parameter dtype, as HF's Gemma does.
  x = emb[tokens] * _f32(jnp.asarray(c.embedding_multiplier, emb_param.dtype))
  for i in range(c.num_layers):
    p = m[f"layers_{i}"]
    attn = _attention_block(p["self_attn"], c, i, _rms_norm(x, p["input_layernorm"]["weight"],
                                                             c), positions, valid)
    if c.sandwich_norms:
      x = x + _rms_norm(attn, p["post_attention_layernorm"]["weight"], c)
      mlp = _mlp(p["mlp"], c, _rms_norm(x, p["pre_feedforward_layernorm"]["weight"], c))
      x = x + _rms_norm(mlp, p["post_feedforward_layernorm"]["weight"], c)
    else:
      x = x + attn
      x = x + _mlp(p["mlp"], c, _rms_norm(x, p["post_attention_layernorm"]["weight"], c))
  x = _rms_norm(x, m["norm"]["weight"], c)
  if c.tie_word_embeddings:
    logits = jnp.matmul(x, emb.T, precision=_HI)
  else:
    logits = jnp.matmul(x, _f32(params["lm_head"]["kernel"]), precision=_HI)
  if c.final_logit_softcapping is not None:
    logits = c.final_logit_softcapping * jnp.tanh(logits / c.final_logit_softcapping)
  return logits[0] if single else logits


def greedy_generate(params, config: ModelConfig, prompt, max_new_tokens: int,
                    stop_token_ids=()) -> list:
  """Greedy decoding by full recomputation each step (slow; the oracle for engines).

  Returns the generated ids (without the prompt), stopping early after a stop id.
  """
  ids = [int(t) for t in prompt]
  total = len(ids) + max_new_tokens
  # One fixed padded length: causal masking keeps the right padding invisible,
  # so the whole loop compiles once.
  fwd = jax.jit(lambda p, t: forward(p, config, t))
  buf = jnp.zeros((total,), jnp.int32)
  out = []
  for _ in range(max_new_tokens):
    buf = buf.at[:len(ids)].set(jnp.asarray(ids, jnp.int32))
    logits = fwd(params, buf)
    nxt = int(jnp.argmax(logits[len(ids) - 1]))
    out.append(nxt)
    ids.append(nxt)
    if nxt in stop_token_ids:
      break
  return out
