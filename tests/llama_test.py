"""Paged Llama forward == dense full-recompute forward (paged_jax.models)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from distributed_fixtures import random_params as _random_params
from paged_jax import attention, kv_cache, tokenizer
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.models import DEFAULT_CHECKPOINT, dense, llama, load_hf_checkpoint


def _config(num_heads=4, num_kv_heads=2, tied=False, **kw):
  base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
              num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8,
              rope_theta=500.0, tie_word_embeddings=tied, max_position_embeddings=256)
  base.update(kw)
  return ModelConfig(**base)


_dense_jit = jax.jit(dense.forward, static_argnums=1)


class _Allocator:
  """Minimal independent block allocator: blocks handed out in a random order."""

  def __init__(self, cache: CacheConfig, rng):
    self.cache = cache
    self.free = list(rng.permutation(cache.num_blocks))
    self.tables = -np.ones((cache.max_seqs, cache.max_blocks_per_seq), np.int32)
    self.lens = np.zeros(cache.max_seqs, np.int32)

  def slots_for(self, seq, num_new):
    bs = self.cache.block_size
    out = []
    for pos in range(self.lens[seq], self.lens[seq] + num_new):
      if pos % bs == 0:
        self.tables[seq, pos // bs] = self.free.pop()
      out.append(self.tables[seq, pos // bs] * bs + pos % bs)
    self.lens[seq] += num_new
    return out


def _step_inputs(alloc, seqs_tokens, chunk, num_rows, num_seq_rows):
  """Packs one ragged step. chunk: list of (seq, new token ids). Returns model inputs."""
  tokens, positions, slots, cu = [], [], [], [0]
  kv_lens, tables, logits_idx = [], [], []
  for seq, new in chunk:
    start = alloc.lens[seq]
    slots += alloc.slots_for(seq, len(new))
    tokens += new
    positions += list(range(start, start + len(new)))
    cu.append(len(tokens))
    kv_lens.append(alloc.lens[seq])
    tables.append(alloc.tables[seq])
    logits_idx.append(len(tokens) - 1)
  pad = num_rows - len(tokens)
  assert pad >= 0
  n = len(chunk)
  pad_seqs = num_seq_rows - n
  meta = attention.AttentionMetadata(
      slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
      block_tables=jnp.asarray(np.stack(tables + [np.full_like(tables[0], -1)] * pad_seqs)),
      kv_lens=jnp.asarray(kv_lens + [0] * pad_seqs, jnp.int32),
      cu_q_lens=jnp.asarray(cu + [cu[-1]] * pad_seqs, jnp.int32),
      num_seqs=jnp.asarray(n, jnp.int32),
      logits_indices=jnp.asarray(logits_idx + [0] * pad_seqs, jnp.int32))
  # Padding rows carry real-looking ids and positions: they must still be ignored.
  tokens = jnp.asarray(tokens + [5] * pad, jnp.int32)
  positions = jnp.asarray(positions + [3] * pad, jnp.int32)
  return tokens, positions, meta


def _poisoned_pages(cache, seed):
  pages = kv_cache.init(cache)
  keys = iter(jax.random.split(jax.random.key(seed), 4 * cache.num_layers))
  # Pages (4-D per layer) get noise; int8/fp8 scales (3-D) stay zero as before.
  noise = lambda x: (jax.random.normal(next(keys), x.shape) * 10).astype(x.dtype)
  return pages.map_layers(lambda x: noise(x) if x.ndim == 4 else x)


def _run_schedule(config, params, block_size, schedule, prompts, seed, cache_dtype="float32"):
  """Runs `schedule` (list of steps, each a list of (seq, num_new)) through the paged model.

  Returns a list of (seq, position, logits) for every logits row produced.
  """
  cache = config.cache_config(block_size=block_size, num_blocks=64, max_seqs=4,
                              max_blocks_per_seq=64 // block_size * 2, dtype=cache_dtype)
  rng = np.random.default_rng(seed)
  alloc = _Allocator(cache, rng)
  pages = _poisoned_pages(cache, seed)
  model = llama.LlamaForCausalLM(config, attention_backend="reference")
  traces = []

  def forward(*args):
    traces.append(1)
    return model.apply(*args)

  step = jax.jit(forward)
  fed = {s: 0 for s in range(len(prompts))}
  results = []
  for chunk_spec in schedule:
    chunk = []
    for seq, num_new in chunk_spec:
      chunk.append((seq, [int(t) for t in prompts[seq][fed[seq]:fed[seq] + num_new]]))
      fed[seq] += num_new
    tokens, positions, meta = _step_inputs(alloc, None, chunk, num_rows=16, num_seq_rows=4)
    logits, pages = step(params, tokens, positions, pages, meta)
    assert logits.shape == (4, config.vocab_size) and logits.dtype == jnp.float32
    for row, (seq, _) in enumerate(chunk):
      results.append((seq, fed[seq], np.asarray(logits[row])))
  assert len(traces) == 1  # fixed shapes: one trace for every step
  return results


_SCHEDULE = [
    [(0, 7), (1, 3)],              # two prefill chunks
    [(0, 5), (1, 1), (2, 9)],      # continue a prefill, decode, new prefill
    [(0, 1), (1, 1), (2, 1)],      # decodes
    [(2, 1), (0, 1)],              # decodes, reordered
    [(1, 6), (2, 1), (0, 1)],      # long chunk mixed with decodes
    [(0, 1), (1, 1), (2, 1)],
]


@pytest.mark.parametrize("num_heads,num_kv_heads,tied,block_size", [
    (4, 2, False, 4),   # GQA, untied
    (4, 4, True, 2),    # MHA, tied
    pytest.param(4, 1, False, 8, marks=pytest.mark.slow),   # MQA
    (4, 2, True, 1),
])
def test_paged_forward_matches_dense(num_heads, num_kv_heads, tied, block_size):
  config = _config(num_heads, num_kv_heads, tied)
  params = _random_params(config, seed=num_heads * 10 + num_kv_heads + tied)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, config.vocab_size, 40) for _ in range(3)]
  results = _run_schedule(config, params, block_size, _SCHEDULE, prompts, seed=block_size)
  # Causal: the dense logits of row p over the whole prompt are those of prefix [:p+1].
  full = [np.asarray(_dense_jit(params, config, jnp.asarray(p, jnp.int32))) for p in prompts]
  for seq, fed, logits in results:
    np.testing.assert_allclose(logits, full[seq][fed - 1], rtol=2e-4, atol=2e-4,
                               err_msg=f"seq {seq} after {fed} tokens")
  # The comparison is sharp: logits vary by O(1) between positions.
  spread = np.std([r[2] for r in results], axis=0).mean()
  assert spread > 0.1


def test_padding_rows_write_nothing_and_positions_matter():
  config = _config()
  params = _random_params(config, seed=3)
  cache = config.cache_config(block_size=4, num_blocks=16, max_seqs=2, max_blocks_per_seq=8)
  alloc = _Allocator(cache, np.random.default_rng(0))
  pages = _poisoned_pages(cache, 7)
  tokens, positions, meta = _step_inputs(alloc, None, [(0, [1, 2, 3, 4, 5])], 16, 2)
  model = llama.LlamaForCausalLM(config, attention_backend="reference")
  apply = jax.jit(model.apply)
  logits, new_pages = apply(params, tokens, positions, pages, meta)
  written = np.zeros((cache.num_blocks * cache.block_size,), bool)
  written[np.asarray(meta.slot_mapping[:5])] = True
  old_k = np.asarray(pages.k).reshape(2, 2, -1, 8)
  new_k = np.asarray(new_pages.k).reshape(2, 2, -1, 8)
  np.testing.assert_array_equal(new_k[:, :, ~written], old_k[:, :, ~written])
  assert not np.allclose(new_k[:, :, written], old_k[:, :, written])
  # Other positions (RoPE is relative, so stretch them) change the logits ...
  stretched, _ = apply(params, tokens, positions * 3, pages, meta)
  assert np.abs(np.asarray(stretched[0]) - np.asarray(logits[0])).max() > 1e-2
  # ... exactly as the dense oracle says.
  want = _dense_jit(params, config, jnp.asarray([1, 2, 3, 4, 5]), jnp.arange(5) * 3)[-1]
  np.testing.assert_allclose(stretched[0], want, rtol=2e-4, atol=2e-4)


def test_rope_is_hf_rotate_half():
  """apply_rope equals a numpy transcription of HF's apply_rotary_pos_emb."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 3, 16)).astype(np.float32)
  pos = rng.integers(0, 1000, 5)
  theta = 10000.0
  inv = 1.0 / theta ** (np.arange(0, 16, 2) / 16)
  emb = np.concatenate([np.outer(pos, inv)] * 2, axis=-1)
  rot = np.concatenate([-x[..., 8:], x[..., :8]], axis=-1)
  want = x * np.cos(emb)[:, None] + rot * np.sin(emb)[:, None]
  cos, sin = llama.rope_cos_sin(jnp.asarray(pos), 16, theta)
  np.testing.assert_allclose(llama.apply_rope(jnp.asarray(x), cos, sin), want,
                             rtol=1e-4, atol=1e-4)


def test_bfloat16_model_close_to_float32_dense():
  config = _config(dtype="bfloat16")
  params32 = _random_params(_config(), seed=11)
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params32)
  prompts = [np.random.default_rng(2).integers(0, 97, 20)]
  results = _run_schedule(config, params16, 4, [[(0, 12)], [(0, 1)], [(0, 1)]], prompts, 0)
  full = np.asarray(_dense_jit(params16, config, jnp.asarray(prompts[0], jnp.int32)))
  for seq, fed, logits in results:
    want = full[fed - 1]
    err = np.abs(logits - want).max() / np.abs(want).max()
    assert err < 0.05, err


def test_param_tree_names():
  config = _config(num_layers=1)
  shapes = jax.tree_util.tree_map(lambda x: x.shape, llama.init_params(config, jax.random.key(0)))
  layer = shapes["params"]["model"]["layers_0"]
  assert layer["self_attn"]["q_proj"]["kernel"] == (32, 32)
  assert layer["self_attn"]["k_proj"]["kernel"] == (32, 16)
  assert layer["mlp"]["down_proj"]["kernel"] == (48, 32)
  assert shapes["params"]["lm_head"]["kernel"] == (32, 97)
  tied = llama.init_params(_config(num_layers=1, tied=True), jax.random.key(0))
  assert "lm_head" not in tied["params"]


def test_shipped_model_paged_greedy_equals_dense_greedy():
  """The loaded HF checkpoint decodes the same text through the paged cache."""
  config, params = load_hf_checkpoint(DEFAULT_CHECKPOINT)
  prompt = tokenizer.encode("Once upon a time")
  steps = 24
  want = dense.greedy_generate(params, config, prompt, steps)
  cache = config.cache_config(block_size=8, num_blocks=16, max_seqs=1, max_blocks_per_seq=8)
  alloc = _Allocator(cache, np.random.default_rng(3))
  pages = _poisoned_pages(cache, 4)
  step = jax.jit(llama.LlamaForCausalLM(config, attention_backend="reference").apply)
  got, new = [], prompt
  for _ in range(steps):
    tokens, positions, meta = _step_inputs(alloc, None, [(0, new)], num_rows=32, num_seq_rows=1)
    logits, pages = step(params, tokens, positions, pages, meta)
    new = [int(jnp.argmax(logits[0]))]
    got.append(new[0])
  assert got == want, (tokenizer.decode(got), tokenizer.decode(want))
  assert tokenizer.decode(got).startswith(", there was")  # recognisable story opening


def test_bad_shapes_name_the_argument():
  config = _config()
  params = _random_params(config, 5)
  cache = config.cache_config(block_size=4, num_blocks=8, max_seqs=2, max_blocks_per_seq=4)
  alloc = _Allocator(cache, np.random.default_rng(0))
  tokens, positions, meta = _step_inputs(alloc, None, [(0, [1, 2, 3])], 8, 2)
  model = llama.LlamaForCausalLM(config, attention_backend="reference")
  pages = kv_cache.init(cache)
  with pytest.raises(ValueError, match="positions"):
    model.apply(params, tokens, positions[:5], pages, meta)
  with pytest.raises(ValueError, match="tokens"):
    model.apply(params, tokens[None], positions, pages, meta)
  with pytest.raises(ValueError, match="kv_pages"):
    model.apply(params, tokens, positions, kv_cache.init(cache.replace(num_layers=3)), meta)


def test_int8_kv_cache_close_to_dense():
  """Quantized pages: the model passes the per-token scales through to attention."""
  config = _config()
  params = _random_params(config, 21)
  prompts = [np.random.default_rng(4).integers(0, 97, 20)]
  results = _run_schedule(config, params, 4, [[(0, 12)], [(0, 1)], [(0, 1)]], prompts, 0,
                          cache_dtype="int8")
  full = np.asarray(_dense_jit(params, config, jnp.asarray(prompts[0], jnp.int32)))
  for _, fed, logits in results:
    want = full[fed - 1]
    err = np.abs(logits - want).max() / np.abs(want).max()
    assert 0 < err < 0.05, err


def test_training_learns_a_repeating_stream():
  from paged_jax.models import train  # pylint: disable=g-import-not-at-top
  config = _config(vocab_size=tokenizer.VOCAB_SIZE, num_layers=1)
  text = "the cat sat on the mat. " * 60
  stream = np.asarray(tokenizer.encode(text), np.int32)
  tc = train.TrainConfig(steps=40, batch_size=8, seq_len=32, warmup_steps=5, eval_every=20,
                         eval_batches=1, peak_lr=1e-2)
  params, history = train.train(config, stream, stream, tc)
  assert [h["step"] for h in history] == [1, 20, 40]
  assert history[-1]["eval_loss"] < 0.3 * history[0]["eval_loss"]
  got = dense.greedy_generate(params, config, tokenizer.encode("the cat sat on the mat. the"), 4)
  assert tokenizer.decode(got) == " cat", tokenizer.decode(got)
  with pytest.raises(ValueError, match="seq_len"):
    train.train(config, stream[:20], stream, tc)


@pytest.mark.parametrize("backend,cache_dtype", [
    ("reference", "float32"), ("reference", "int8"), ("pallas_interpret", "float32")])
def test_decode_only_step_runs_the_decode_kernel_and_equals_the_ragged_path(
    backend, cache_dtype, monkeypatch):
  """`AttentionMetadata(decode_only=True)`: the decode kernel serves every layer, with the
  ragged path's logits and pages (and the dense oracle's logits) on a decode-only batch
  with a dead sequence row and padding rows."""
  config = _config(head_dim=16)   # the Pallas kernels take head_dim >= 16
  params = _random_params(config, seed=21)
  cache = config.cache_config(block_size=4, num_blocks=32, max_seqs=4, max_blocks_per_seq=8,
                              dtype=cache_dtype)
  rng = np.random.default_rng(5)
  prompts = [list(rng.integers(0, config.vocab_size, n)) for n in (9, 4, 13)]
  alloc = _Allocator(cache, rng)
  pages = _poisoned_pages(cache, 3)
  model = llama.LlamaForCausalLM(config, attention_backend=backend)
  decode_calls = []
  original = attention.paged_attention
  monkeypatch.setattr(attention, "paged_attention",
                      lambda *a, **kw: decode_calls.append(1) or original(*a, **kw))
  apply = jax.jit(model.apply)
  prefill = [(s, [int(t) for t in p[:-1]]) for s, p in enumerate(prompts)]
  tokens, positions, meta = _step_inputs(alloc, None, prefill, 32, 4)
  _, pages = apply(params, tokens, positions, pages, meta)
  assert not decode_calls
  # Decode: sequences 2 and 0 (one new token each), seq row 3 dead, 5 padding rows.
  chunk = [(2, [int(prompts[2][-1])]), (0, [int(prompts[0][-1])])]
  tokens, positions, meta = _step_inputs(alloc, None, chunk, 7, 4)
  want_logits, want_pages = apply(params, tokens, positions, pages, meta)
  got_logits, got_pages = apply(params, tokens, positions, pages,
                                meta.replace(decode_only=True))
  assert len(decode_calls) == config.num_layers
  tol = 1e-5 if backend == "reference" else 2e-5
  np.testing.assert_allclose(got_logits[:2], want_logits[:2], rtol=tol, atol=tol)
  # Layer 0 writes the same K/V bit for bit; later layers' inputs carry the two kernels'
  # rounding (int8 codes may sit one step away).
  for got, want in zip(jax.tree_util.tree_leaves(got_pages),
                       jax.tree_util.tree_leaves(want_pages)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.ndim == 4 and cache_dtype == "int8":
      assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 1e-3
    else:
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  for a, b in zip(got_pages.k[0:1], want_pages.k[0:1]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for row, seq in enumerate((2, 0)):
    dense_logits = _dense_jit(params, config, jnp.asarray(prompts[seq], jnp.int32))[-1]
    np.testing.assert_allclose(got_logits[row], dense_logits,
                               rtol=2e-4 if cache_dtype == "float32" else 0.1,
                               atol=2e-4 if cache_dtype == "float32" else 0.1)
