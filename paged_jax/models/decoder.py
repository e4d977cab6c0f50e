"""The decoder (Flax linen) of every supported family, attention over the paged KV cache.

    model = DecoderForCausalLM(config)              # config: paged_jax.ModelConfig
    params = init_params(config, jax.random.key(0))
    logits, kv_pages = model.apply(params, tokens, positions, kv_pages, meta)

One module serves Llama, Qwen2 / Qwen2.5, Qwen3, Mistral, Gemma-2 and Gemma-3 (text): the
families differ only by ModelConfig fields (biases, QK-norm, (1 + w) norms, Gemma's sandwich
norms, GeGLU, scaled embeddings, the attention scale, soft caps, per-layer sliding windows
and per-layer-type RoPE), so every family runs the same one-jit engine step.
`LlamaForCausalLM` (models/llama.py) is this class under its first family's name.

`tokens`/`positions` are i32[T] (the new tokens of every sequence in the step,
packed; padding rows have `meta.slot_mapping == -1`), `kv_pages` is a
`kv_cache.KVPages`, `meta` an `attention.AttentionMetadata`. Each layer
projects Q/K/V, applies RoPE, writes K/V into its own layer's pages at
`meta.slot_mapping` (in place: each layer is its own array, see kv_cache.py) and runs
`attention.attention_from_metadata` over the block tables (the ragged kernel, or the
decode kernel when `meta.decode_only`) with the layer's sliding window, soft cap and scale.
Logits (f32[S, vocab]) are computed only at `meta.logits_indices`. Shapes are static,
so one jit trace serves every step; the pages are threaded functionally (the
engine donates them).

Parameter tree (maps 1:1 to Hugging Face names, see `hf_checkpoint.py`):

    model/embed_tokens/embedding                     [vocab, hidden]
    model/layers_N/input_layernorm/weight            [hidden]
    model/layers_N/self_attn/{q,k,v,o}_proj/kernel   [in, out]   (+ bias [out]: qkv_bias,
                                                                  o_proj_bias)
    model/layers_N/self_attn/{q,k}_norm/weight       [head_dim]  (qk_norm)
    model/layers_N/post_attention_layernorm/weight   [hidden]
    model/layers_N/{pre,post}_feedforward_layernorm/weight       (sandwich_norms)
    model/layers_N/mlp/{gate,up,down}_proj/kernel    [in, out]   (+ bias: mlp_bias)
    model/norm/weight                                [hidden]
    lm_head/kernel                                   [hidden, vocab]   (absent when tied)

RoPE follows Hugging Face's `rotate_half` convention (feature i pairs with
i + head_dim/2), which is what HF checkpoints' permuted q/k weights expect.
"""

from __future__ import annotations

from typing import Any, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged_jax import attention, kv_cache
from paged_jax.config import ModelConfig

_INIT_STD = 0.02  # Hugging Face's initializer_range default.
_ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
                "gelu": lambda x: nn.gelu(x, approximate=False)}


def _dtype(name: str):
  return jnp.dtype(name)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, *,
                 inv_freq=None) -> Tuple[jax.Array, jax.Array]:
  """cos, sin f32[T, head_dim] for positions i32[T] (HF layout: halves repeated).

  `inv_freq` f32[head_dim // 2] overrides the plain `theta` frequencies (RoPE scaling,
  see ModelConfig.rope_inv_freq).
  """
  if inv_freq is None:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  inv_freq = jnp.asarray(inv_freq, jnp.float32)
  freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)                         # [T, D]
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [T, heads, D] -> x * cos + rotate_half(x) * sin (computed in f32)."""
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + eps) * weight; statistics in f32.

  `unit_offset` (Gemma): y = (x_normed * (1 + weight)) in f32, then cast, with weights
  initialised to 0; otherwise (Llama) weight * x_normed cast to `dtype` first, weights 1.
  """
  eps: float
  dtype: Any = jnp.float32
  unit_offset: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
    weight = self.param("weight", init, (x.shape[-1],), self.dtype)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.unit_offset:
      return (xf * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
    return weight * xf.astype(self.dtype)


def _norm(c: ModelConfig, name: str = None) -> RMSNorm:
  return RMSNorm(c.rms_norm_eps, _dtype(c.dtype), c.rms_norm_unit_offset, name=name)


def _dense(features: int, dtype, name: str, bias: bool = False) -> nn.Dense:
  return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype,
                  kernel_init=nn.initializers.normal(_INIT_STD), name=name)


class DecoderAttention(nn.Module):
  """GQA self-attention over the paged cache for one layer."""
  config: ModelConfig
  layer_index: int
  attention_backend: str = "auto"

  def setup(self):
    c, dt = self.config, _dtype(self.config.dtype)
    self.q_proj = _dense(c.num_heads * c.head_dim, dt, "q_proj", c.qkv_bias)
    self.k_proj = _dense(c.num_kv_heads * c.head_dim, dt, "k_proj", c.qkv_bias)
    self.v_proj = _dense(c.num_kv_heads * c.head_dim, dt, "v_proj", c.qkv_bias)
    self.o_proj = _dense(c.hidden_size, dt, "o_proj", c.o_proj_bias)
    if c.qk_norm:
      self.q_norm = _norm(c)
      self.k_norm = _norm(c)

  def _heads(self, x):
    """x [T, hidden] -> q [T, Hq, D], k/v [T, Hkv, D] (k, q normed when qk_norm)."""
    c, t = self.config, x.shape[0]
    q = self.q_proj(x).reshape(t, c.num_heads, c.head_dim)
    k = self.k_proj(x).reshape(t, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v

  def init_weights(self, x):
    """Touches every parameter once (x [1, hidden]) so Flax creates them."""
    c = self.config
    q, _, _ = self._heads(x)
    return self.o_proj(q.reshape(1, c.num_heads * c.head_dim))

  def attention_kwargs(self) -> dict:
    """This layer's scale, soft cap and sliding window (only those that are set)."""
    c = self.config
    kw = dict(sm_scale=c.attention_scale, soft_cap=c.attn_logit_softcapping,
              sliding_window=c.layer_sliding_window(self.layer_index))
    return {k: v for k, v in kw.items() if v is not None}

  def __call__(self, x, cos, sin, kv_pages, meta):
    """x [T, hidden], cos/sin f32[T, D] -> ([T, hidden], new kv_pages)."""
    c = self.config
    q, k, v = self._heads(x)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv_pages = kv_cache.write(kv_pages, self.layer_index, k, v, meta.slot_mapping)
    k_pages, v_pages, k_scales, v_scales = kv_cache.layer(kv_pages, self.layer_index)
    # The ragged kernel, or the decode kernel when the step is `meta.decode_only`.
    out = attention.attention_from_metadata(q, k_pages, v_pages, meta, k_scales=k_scales,
                                            v_scales=v_scales, backend=self.attention_backend,
                                            **self.attention_kwargs())
    out = out.astype(x.dtype).reshape(x.shape[0], c.num_heads * c.head_dim)
    return self.o_proj(out), kv_pages


class DecoderMLP(nn.Module):
  """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (gelu)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c, dt = self.config, _dtype(self.config.dtype)
    gate = _dense(c.intermediate_size, dt, "gate_proj", c.mlp_bias)(x)
    up = _dense(c.intermediate_size, dt, "up_proj", c.mlp_bias)(x)
    act = _ACTIVATIONS[c.hidden_act]
    return _dense(c.hidden_size, dt, "down_proj", c.mlp_bias)(act(gate) * up)


class DecoderLayer(nn.Module):
  """Pre-norm block x + attn(norm(x)), x + mlp(norm(x)); Gemma's sandwich norms also normalise
  each branch's output (`ModelConfig.sandwich_norms`)."""
  config: ModelConfig
  layer_index: int
  attention_backend: str = "auto"

  def setup(self):
    c = self.config
    self.input_layernorm = _norm(c)
    self.self_attn = DecoderAttention(c, self.layer_index, self.attention_backend)
    # Llama: the norm before the MLP. Gemma: the norm of the attention output.
    self.post_attention_layernorm = _norm(c)
    if c.sandwich_norms:
      self.pre_feedforward_layernorm = _norm(c)
      self.post_feedforward_layernorm = _norm(c)
    self.mlp = DecoderMLP(c)

  def _residual_branches(self, x, attend):
    """Both residual branches around `attend(normed x) -> (out, aux)`; returns (x, aux)."""
    attn_out, aux = attend(self.input_layernorm(x))
    if not self.config.sandwich_norms:
      x = x + attn_out
      return x + self.mlp(self.post_attention_layernorm(x)), aux
    x = x + self.post_attention_layernorm(attn_out)
    mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
    return x + self.post_feedforward_layernorm(mlp_out), aux

  def init_weights(self, x):
    return self._residual_branches(x, lambda h: (self.self_attn.init_weights(h), None))[0]

  def __call__(self, x, cos, sin, kv_pages, meta):
    return self._residual_branches(
        x, lambda h: self.self_attn(h, cos, sin, kv_pages, meta))


class DecoderModel(nn.Module):
  """Embedding, decoder layers and the final norm (HF's `model.` prefix)."""
  config: ModelConfig
  attention_backend: str = "auto"

  def setup(self):
    c, dt = self.config, _dtype(self.config.dtype)
    self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=dt, param_dtype=dt,
                                 embedding_init=nn.initializers.normal(_INIT_STD))
    self.layers = [DecoderLayer(c, i, self.attention_backend, name=f"layers_{i}")
                   for i in range(c.num_layers)]
    self.norm = _norm(c)

  def _embed(self, tokens):
    x = self.embed_tokens(tokens)
    if self.config.embedding_multiplier != 1.0:
      # HF rounds the multiplier to the parameter dtype (sqrt(3072) is 55.5 in bf16).
      x = x * jnp.asarray(self.config.embedding_multiplier, x.dtype)
    return x

  def init_weights(self, tokens):
    x = self._embed(tokens)
    for layer in self.layers:
      x = layer.init_weights(x)
    return self.norm(x)

  def __call__(self, tokens, positions, kv_pages, meta):
    """-> (hidden [T, hidden] after the final norm, new kv_pages)."""
    c = self.config
    x = self._embed(tokens)
    rope = {False: rope_cos_sin(positions, c.head_dim, c.rope_theta,
                                inv_freq=c.rope_inv_freq())}
    if c.sliding_rope_differs:   # Gemma-3: local layers rotate with their own base
      rope[True] = rope_cos_sin(positions, c.head_dim, c.rope_theta,
                                inv_freq=c.rope_inv_freq(sliding=True))
    for i, layer in enumerate(self.layers):
      cos, sin = rope[c.sliding_rope_differs and c.layer_sliding_window(i) is not None]
      x, kv_pages = layer(x, cos, sin, kv_pages, meta)
    return self.norm(x), kv_pages

  def attend(self, x):
    return self.embed_tokens.attend(x)


class DecoderForCausalLM(nn.Module):
  """The decoder plus LM head; `apply(params, tokens, positions, kv_pages, meta)`.

  Attributes:
    config: ModelConfig (any supported family).
    attention_backend: passed to `attention.attention_from_metadata`: one of
      `attention.BACKENDS` ("auto", "reference", "xla", "cpu", "pallas", "pallas_interpret", or
      with the GPU kernel family forced: "pallas:triton", "pallas:mosaic_gpu",
      "pallas_interpret:triton", "pallas_interpret:mosaic_gpu").
  """
  config: ModelConfig
  attention_backend: str = "auto"

  def setup(self):
    c = self.config
    self.model = DecoderModel(c, self.attention_backend)
    if not c.tie_word_embeddings:
      self.lm_head = _dense(c.vocab_size, _dtype(c.dtype), "lm_head")

  def _logits(self, h):
    c = self.config
    logits = self.model.attend(h) if c.tie_word_embeddings else self.lm_head(h)
    logits = logits.astype(jnp.float32)
    if c.final_logit_softcapping is not None:
      cap = c.final_logit_softcapping
      logits = cap * jnp.tanh(logits / cap)
    return logits

  def init_weights(self, tokens):
    return self._logits(self.model.init_weights(tokens))

  def __call__(self, tokens, positions, kv_pages, meta):
    """One paged step.

    Args:
      tokens: i32[T] new token ids (padding rows: any valid id).
      positions: i32[T] their positions in their sequences.
      kv_pages: KVPages holding every sequence's earlier K/V.
      meta: AttentionMetadata (slot_mapping i32[T], block_tables i32[S, P],
        kv_lens i32[S] after this step, cu_q_lens i32[S+1], num_seqs, logits_indices i32[S]).

    Returns:
      (f32[S, vocab] logits of rows `meta.logits_indices`, new KVPages).
    """
    _check_step_shapes(self.config, tokens, positions, kv_pages, meta)
    h, kv_pages = self.model(tokens, positions, kv_pages, meta)
    return self._logits(h[meta.logits_indices]), kv_pages


def _check_step_shapes(c: ModelConfig, tokens, positions, kv_pages, meta) -> None:
  """Trace-time (static shape) checks; raise ValueError naming the argument."""
  if tokens.ndim != 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be an integer [T] array, got {tokens.dtype}{list(tokens.shape)}")
  t = tokens.shape[0]
  for name, x in (("positions", positions), ("meta.slot_mapping", meta.slot_mapping)):
    if tuple(x.shape) != (t,):
      raise ValueError(f"{name} must have shape [T] = [{t}] like tokens, got {list(x.shape)}")
  if meta.logits_indices.ndim != 1:
    raise ValueError(f"meta.logits_indices must be [S], got {list(meta.logits_indices.shape)}")
  want = (c.num_layers, c.num_kv_heads)
  if tuple(kv_pages.k.shape[:2]) != want or kv_pages.k.shape[-1] != c.head_dim:
    raise ValueError(
        f"kv_pages.k must be [num_layers={c.num_layers}, num_kv_heads={c.num_kv_heads}, "
        f"num_blocks, block_size, head_dim={c.head_dim}], got {list(kv_pages.k.shape)}")


def init_params(config: ModelConfig, rng: jax.Array) -> dict:
  """Fresh parameters (normal(0.02) weights, zero biases, identity norms), `{"params": ...}`."""
  model = DecoderForCausalLM(config)
  return model.init(rng, jnp.zeros((1,), jnp.int32), method=DecoderForCausalLM.init_weights)


def num_params(params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
