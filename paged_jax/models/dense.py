"""Plain-jnp dense Llama forward: the test oracle (and the training forward).

Written independently of `llama.py`: no cache, no Flax, full recomputation of
every position with an explicit causal mask. It reads the same parameter tree
(`LlamaForCausalLM` layout, see `llama.py`) so a paged forward can be compared
against it. RoPE is computed here in complex form: feature pairs
(x[i], x[i + D/2]) are the real and imaginary parts of one complex number
rotated by `pos * theta**(-2i/D)`, which is exactly what Hugging Face's
`rotate_half` formulation computes.

All math runs in float32 with the highest matmul precision, whatever the
parameter dtype.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig

_HI = jax.lax.Precision.HIGHEST


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def _rms_norm(x, weight, eps):
  """x [..., H] f32 -> [..., H]."""
  var = jnp.mean(x * x, axis=-1, keepdims=True)
  return x / jnp.sqrt(var + eps) * _f32(weight)


def _rope_complex(x, positions, inv_freq):
  """x [B, L, heads, D], positions i32[B, L], inv_freq f32[D/2] -> x rotated (HF pairing)."""
  d = x.shape[-1]
  half = d // 2
  inv_freq = jnp.asarray(inv_freq, jnp.float32)                 # [D/2]
  angle = positions.astype(jnp.float32)[..., None] * inv_freq    # [B, L, D/2]
  rot = jnp.exp(1j * angle.astype(jnp.complex64))[:, :, None, :]  # [B, L, 1, D/2]
  z = (x[..., :half] + 1j * x[..., half:]).astype(jnp.complex64) * rot
  return jnp.concatenate([jnp.real(z), jnp.imag(z)], axis=-1).astype(jnp.float32)


def _causal_attention(q, k, v, valid):
  """q [B, L, Hq, D], k/v [B, L, Hkv, D], valid bool[B, L] -> [B, L, Hq, D]."""
  b, l, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  qg = q.reshape(b, l, hkv, group, d)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, precision=_HI) / jnp.sqrt(jnp.float32(d))
  causal = jnp.tril(jnp.ones((l, l), bool))
  mask = causal[None, None, None] & valid[:, None, None, None, :]
  scores = jnp.where(mask, scores, -jnp.inf)
  # A row with no visible key (only possible for masked-out query rows) gets zeros.
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.exp(scores - row_max)
  probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, precision=_HI)
  return out.reshape(b, l, hq, d)


def forward(params: Mapping[str, Any], config: ModelConfig, tokens: jax.Array,
            positions: Optional[jax.Array] = None,
            valid: Optional[jax.Array] = None) -> jax.Array:
  """Logits of every position, recomputed from scratch.

  Args:
    params: the `LlamaForCausalLM` parameter tree (`{"model": ..., "lm_head"?: ...}`),
      with or without an outer `{"params": ...}` wrapper.
    config: the model's ModelConfig.
    tokens: i32[L] or i32[B, L] token ids.
    positions: RoPE positions, same shape as tokens (default 0..L-1).
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
  emb = _f32(m["embed_tokens"]["embedding"])                     # [V, H]
  x = emb[tokens]                                                # [B, L, H]
  for i in range(c.num_layers):
    p = m[f"layers_{i}"]
    a = p["self_attn"]
    h = _rms_norm(x, p["input_layernorm"]["weight"], c.rms_norm_eps)
    q = jnp.matmul(h, _f32(a["q_proj"]["kernel"]), precision=_HI)
    k = jnp.matmul(h, _f32(a["k_proj"]["kernel"]), precision=_HI)
    v = jnp.matmul(h, _f32(a["v_proj"]["kernel"]), precision=_HI)
    q = _rope_complex(q.reshape(b, l, c.num_heads, c.head_dim), positions, c.rope_inv_freq())
    k = _rope_complex(k.reshape(b, l, c.num_kv_heads, c.head_dim), positions, c.rope_inv_freq())
    v = v.reshape(b, l, c.num_kv_heads, c.head_dim)
    att = _causal_attention(q, k, v, valid).reshape(b, l, c.num_heads * c.head_dim)
    x = x + jnp.matmul(att, _f32(a["o_proj"]["kernel"]), precision=_HI)
    mp = p["mlp"]
    h = _rms_norm(x, p["post_attention_layernorm"]["weight"], c.rms_norm_eps)
    gate = jnp.matmul(h, _f32(mp["gate_proj"]["kernel"]), precision=_HI)
    up = jnp.matmul(h, _f32(mp["up_proj"]["kernel"]), precision=_HI)
    x = x + jnp.matmul(jax.nn.silu(gate) * up, _f32(mp["down_proj"]["kernel"]), precision=_HI)
  x = _rms_norm(x, m["norm"]["weight"], c.rms_norm_eps)
  if c.tie_word_embeddings:
    logits = jnp.matmul(x, emb.T, precision=_HI)
  else:
    logits = jnp.matmul(x, _f32(params["lm_head"]["kernel"]), precision=_HI)
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
