"""The small model and dense greedy oracle shared by the engine-level tests.

One tiny Llama (`MC`), its weights scaled so next-token distributions are peaked
(greedy near-ties, where float rounding could legitimately flip an argmax, do not
occur), and the dense, cache-free forward of `paged_jax/models/dense.py` as the
oracle every engine output is compared with.
"""


import jax
import numpy as np

from paged_jax.config import ModelConfig
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


def dense_logprobs(params, ids):
  """f64[VOCAB] next-token log-probabilities after `ids` (len <= ORACLE_LEN)."""
  buf = np.zeros((ORACLE_LEN,), np.int32)
  buf[:len(ids)] = ids
  logits = np.asarray(_FWD(params, buf), np.float64)[len(ids) - 1]
  return logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()


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
