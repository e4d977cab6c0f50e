"""The small model, dense greedy oracle and engine factory shared by the engine tests.

One tiny Llama (`MC`), its weights scaled so next-token distributions are peaked
(greedy near-ties, where float rounding could legitimately flip an argmax, do not
occur), and the dense, cache-free forward of `paged_jax/models/dense.py` as the
oracle every engine output is compared with.
"""


import jax
import numpy as np

from paged_jax.config import ModelConfig
from paged_jax.engine import Engine, SamplingParams
from paged_jax.engine import engine as engine_mod
from paged_jax.models import dense, llama

VOCAB = 96
MC = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, max_position_embeddings=256)
ORACLE_LEN = 64  # dense forward length (padded; the causal mask hides the padding)


def peaked_params(seed=0):
  """Weights at 8x HF's init scale: peaked distributions, no greedy near-ties."""
  p = llama.init_params(MC, jax.random.key(seed))
  return jax.tree_util.tree_map(lambda x: x * 8.0 if x.ndim == 2 else x, p)


PARAMS = peaked_params()
_FWD = jax.jit(lambda p, t: dense.forward(p, MC, t))


def dense_logprobs_all(params, ids):
  """f64[len(ids), VOCAB]: row i holds the next-token log-probabilities after ids[:i + 1]
  (len(ids) <= ORACLE_LEN), from one dense forward."""
  buf = np.zeros((ORACLE_LEN,), np.int32)
  buf[:len(ids)] = ids
  logits = np.asarray(_FWD(params, buf), np.float64)[:len(ids)]
  m = logits.max(axis=-1, keepdims=True)
  return logits - m - np.log(np.sum(np.exp(logits - m), axis=-1, keepdims=True))


def dense_logprobs(params, ids):
  """f64[VOCAB] next-token log-probabilities after `ids` (len <= ORACLE_LEN)."""
  return dense_logprobs_all(params, ids)[-1]


def dense_greedy(params, prompt, max_tokens, stop=()):
  """Greedy continuation of `prompt` by full recomputation; stops after a `stop` id."""
  ids, out = list(prompt), []
  for _ in range(max_tokens):
    nxt = int(np.argmax(dense_logprobs(params, ids)))
    out.append(nxt)
    ids.append(nxt)
    if nxt in stop:
      break
  return out


def oracle_engine(*, block_size, num_blocks, max_seqs, budget, caching=False, **engine_kw):
  """An Engine on MC / PARAMS with the reference attention backend.

  Each slot holds up to ORACLE_LEN tokens, so every output can be checked against the
  dense oracle. `budget` is max_num_batched_tokens; `engine_kw` go to Engine.
  """
  cc = MC.cache_config(block_size=block_size, num_blocks=num_blocks, max_seqs=max_seqs,
                       max_blocks_per_seq=ORACLE_LEN // block_size,
                       enable_prefix_caching=caching)
  return Engine(MC, PARAMS, cc, max_num_batched_tokens=budget, attention_backend="reference",
                **engine_kw)


def random_prompts(seed, count, lo=1, hi=24, prefix=()):
  """`count` prompts of `prefix` + lo..hi random ids (seeded)."""
  rng = np.random.default_rng(seed)
  return [list(prefix) + [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(lo, hi + 1)))]
          for _ in range(count)]


def run_counting_dispatches_and_syncs(engine, monkeypatch):
  """Steps `engine` to the end under a device-to-host transfer guard (no hidden syncs),
  asserting one jitted dispatch and one `jax.device_get` per step."""
  calls = {"dispatch": 0, "sync": 0}
  inner, real_get = engine._step, jax.device_get   # pylint: disable=protected-access

  def counted(*a, **kw):
    calls["dispatch"] += 1
    return inner(*a, **kw)

  def counted_get(x):
    calls["sync"] += 1
    return real_get(x)

  engine._step = counted   # pylint: disable=protected-access
  monkeypatch.setattr(jax, "device_get", counted_get)
  steps = 0
  with jax.transfer_guard_device_to_host("disallow"):
    while engine.has_unfinished():
      engine.step()
      steps += 1
      assert calls["dispatch"] == calls["sync"] == steps


def greedy(max_tokens, **kw):
  return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def record_buckets(monkeypatch):
  """The step buckets the engine's steps use from now on, appended as they run (wraps
  engine.build_inputs through pytest's monkeypatch)."""
  used = []
  real = engine_mod.build_inputs

  def recording(*a, **kw):
    inputs, bucket = real(*a, **kw)
    used.append(bucket)
    return inputs, bucket
  monkeypatch.setattr(engine_mod, "build_inputs", recording)
  return used
