"""Speculative decoding's parts (`paged_jax.engine.speculative`): the config's one-line
errors, the n-gram proposer against a plain-Python search, the rollback against the
allocator's invariants, rejection sampling's distribution against the target's
(chi-square). The engine's cases: speculative_engine_test.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig
from paged_jax.engine import speculative
from tests.engine_oracle import oracle_engine


# ---- config -------------------------------------------------------------------------------
@pytest.mark.parametrize("config, names", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speed": 1}, "speed"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ("ngram", "speculative_config"),
])
def test_bad_config_is_one_line_naming_the_key(config, names):
  with pytest.raises(ValueError) as e:
    oracle_engine(block_size=4, num_blocks=16, max_seqs=2, budget=16, speculative_config=config)
  msg = str(e.value)
  assert names in msg and "\n" not in msg


def test_lookup_window_defaults_follow_vllm():
  parse = lambda **kw: speculative.parse({"method": "ngram", "num_speculative_tokens": 2, **kw})
  assert (parse().prompt_lookup_min, parse().prompt_lookup_max) == (5, 5)
  assert (parse(prompt_lookup_max=3).prompt_lookup_min, parse(prompt_lookup_min=2)
          .prompt_lookup_max) == (3, 2)
  assert speculative.parse(None) is None


# ---- proposer -----------------------------------------------------------------------------
def _ngram_reference(tokens, k, n_max, n_min):
  """The proposer's rule by plain loops: the longest n in [n_min, n_max] whose last-n
  suffix occurs earlier with a successor; its latest such occurrence's next k tokens."""
  for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
    suffix = tokens[len(tokens) - n:]
    for start in range(len(tokens) - n - 1, -1, -1):
      if tokens[start:start + n] == suffix:
        return tuple(tokens[start + n:start + n + k])
  return ()


def test_ngram_proposer_matches_plain_search():
  rng = np.random.default_rng(0)
  for _ in range(300):
    tokens = [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 30)))]
    k, n_max = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    n_min = int(rng.integers(1, n_max + 1))
    assert speculative.propose_ngram(tokens, k, n_max, n_min) == _ngram_reference(
        tokens, k, n_max, n_min), (tokens, k, n_max, n_min)


# ---- rollback -----------------------------------------------------------------------------
class RollbackTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_rollback_frees_exactly_the_blocks_past_the_accepted_length(self):
    cc = CacheConfig(block_size=4, num_blocks=24, max_seqs=4, max_blocks_per_seq=6,
                     num_layers=1, num_kv_heads=1, head_dim=8)
    rng = np.random.default_rng(1)
    for _ in range(10):
      lens = rng.integers(0, 18, 4)
      b = bm.init(cc)
      live = np.nonzero(lens)[0]
      b, st = bm.allocate(b, jnp.asarray(live, jnp.int32), jnp.asarray(lens[live], jnp.int32))
      assert np.all(np.asarray(st) == 0)
      b = bm.fork(b, jnp.asarray([live[0]], jnp.int32), jnp.asarray([-1], jnp.int32))[0]
      new = np.array([rng.integers(0, n + 1) if n else 0 for n in lens], np.int32)
      out = self.variant(speculative.rollback)(b, jnp.asarray(new))
      bm.check_state(out)
      held = lambda n: -(-n // 4)
      # Plain model: every slot keeps cdiv(new, 4) blocks; the rest return to the stack.
      assert int(out.num_free) == 24 - sum(held(n) for n in new)
      np.testing.assert_array_equal(np.asarray(out.seq_lens), new)
      tables = np.asarray(out.block_tables)
      for s, n in enumerate(new):
        assert np.all(tables[s, :held(n)] >= 0) and np.all(tables[s, held(n):] == -1)
        np.testing.assert_array_equal(tables[s, :held(n)], np.asarray(b.block_tables)[s, :held(n)])
      refs = np.bincount(tables[tables >= 0], minlength=24)
      np.testing.assert_array_equal(np.asarray(out.ref_count), refs)
      free = np.asarray(out.free_stack)[:int(out.num_free)]
      assert sorted(free.tolist()) == sorted(np.nonzero(refs == 0)[0].tolist())


# ---- rejection sampling -------------------------------------------------------------------
def _chi2_pvalue(counts, probs):
  """Pearson chi-square p-value of `counts` against `probs` (cells with mass > 0)."""
  n = counts.sum()
  keep = probs > 0
  assert np.all(counts[~keep] == 0), "a token outside the support was drawn"
  exp = n * probs[keep]
  stat = float(np.sum((counts[keep] - exp) ** 2 / exp))
  df = int(keep.sum()) - 1
  return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


@pytest.mark.parametrize("top_k, top_p, temperature", [(0, 1.0, 1.0), (4, 1.0, 0.7),
                                                        (0, 0.8, 1.3)])
def test_rejection_sampling_keeps_the_target_distribution(top_k, top_p, temperature):
  """Each emitted token is distributed as the non-speculative sampler's: the first token
  as p0 (draft accepted or the residual drawn), the second, given the first draft was
  accepted, as p1; with a likely and an unlikely draft."""
  vocab, k, n = 7, 2, 40000
  rng = np.random.default_rng(2)
  logits1 = rng.normal(size=(k + 1, vocab)).astype(np.float32) * 1.5
  target = np.asarray(speculative.sampling.masked_logits(
      jnp.asarray(logits1), jnp.full((k + 1,), temperature), jnp.full((k + 1,), top_k, jnp.int32),
      jnp.full((k + 1,), top_p)))
  p = np.asarray(jax.nn.softmax(jnp.asarray(target), axis=-1), np.float64)
  likely = int(np.argmax(p[0]))
  unlikely = int(np.argsort(p[1])[-2])
  tokens, accepted = jax.jit(speculative.verify)(
      jnp.broadcast_to(jnp.asarray(logits1), (n, k + 1, vocab)),
      jnp.tile(jnp.asarray([[likely, unlikely]], jnp.int32), (n, 1)),
      jnp.full((n,), k, jnp.int32), jnp.full((n,), temperature, jnp.float32),
      jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32),
      jnp.arange(n, dtype=jnp.int32), jnp.zeros((n,), jnp.int32))
  tokens, accepted = np.asarray(tokens), np.asarray(accepted)
  first = np.bincount(tokens[:, 0], minlength=vocab)
  assert _chi2_pvalue(first, p[0]) > 1e-3
  second = np.bincount(tokens[accepted >= 1, 1], minlength=vocab)
  assert _chi2_pvalue(second, p[1]) > 1e-3
  # Acceptance is p(draft): the test can tell a rule that accepts too often.
  assert abs(np.mean(accepted >= 1) - p[0, likely]) < 4 * np.sqrt(p[0, likely] / n) + 0.01


def test_greedy_verify_accepts_the_argmax_prefix():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(64, 4, 5)).astype(np.float32)
  drafts = rng.integers(0, 5, (64, 3)).astype(np.int32)
  num = rng.integers(0, 4, 64).astype(np.int32)
  arg = np.argmax(logits, -1)
  drafts[::2] = arg[::2, :3]          # half of them agree, at least until num
  tokens, acc = speculative.verify(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num),
                                   jnp.zeros(64), jnp.zeros(64, jnp.int32), jnp.ones(64),
                                   jnp.zeros(64, jnp.int32), jnp.zeros(64, jnp.int32))
  for r in range(64):
    a = 0
    while a < num[r] and drafts[r, a] == arg[r, a]:
      a += 1
    assert int(acc[r]) == a
    assert list(np.asarray(tokens)[r, :a + 1]) == list(drafts[r, :a]) + [arg[r, a]]
