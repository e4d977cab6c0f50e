"""Sampling against a NumPy reference of greedy / temperature / top-k / top-p."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine import sampling

_SAMPLE = jax.jit(sampling.sample)

def np_filtered_probs(logits, temperature, top_k, top_p):
  """Reference (float64): vLLM semantics, top-k first, then top-p on the survivors."""
  x = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
  order = np.argsort(-x, kind="stable")
  keep = np.zeros(x.shape, bool)
  k = len(x) if top_k <= 0 else min(top_k, len(x))
  top = order[:k]
  p = np.exp(x[top] - x[top].max())
  p /= p.sum()
  mass = 0.0
  for tok, pt in zip(top, p):
    keep[tok] = True
    mass += pt
    if mass >= top_p:
      break
  probs = np.where(keep, np.exp(x - x.max()), 0.0)
  return probs / probs.sum()


def test_filtered_logits_keep_exactly_the_reference_set():
  rng = np.random.default_rng(0)
  s, v = 64, 50
  logits = rng.normal(size=(s, v)).astype(np.float32) * 3
  temperature = rng.uniform(0.2, 2.0, size=s).astype(np.float32)
  top_k = rng.integers(-1, v + 5, size=s).astype(np.int32)
  top_p = rng.uniform(0.05, 1.0, size=s).astype(np.float32)
  top_p[:5] = 1.0
  got = np.asarray(sampling.filtered_logits(jnp.asarray(logits), jnp.asarray(temperature),
                                            jnp.asarray(top_k), jnp.asarray(top_p)))
  for i in range(s):
    ref = np_filtered_probs(logits[i], temperature[i], top_k[i], top_p[i])
    np.testing.assert_array_equal(np.isfinite(got[i]), ref > 0, err_msg=f"row {i}")
    mine = np.exp(got[i] - got[i].max())
    np.testing.assert_allclose(mine / mine.sum(), ref, atol=1e-5)


def test_threshold_search_equals_the_sort_on_ties_and_a_large_vocabulary():
  """The sorting-free cut-offs keep exactly what the sort-based reference keeps, where
  values tie (quantized logits: both keep every token tied with a cut-off) and at a
  4,096-token vocabulary, where the float64 NumPy rule keeps the same."""
  rng = np.random.default_rng(7)
  for s, v, quant in ((32, 4096, None), (64, 40, 0.5)):
    logits = rng.normal(size=(s, v)).astype(np.float32) * 2
    if quant:
      logits = np.round(logits / quant) * quant
    temperature = rng.uniform(0.3, 1.5, size=s).astype(np.float32)
    top_k = rng.integers(-1, v + 3, size=s).astype(np.int32)
    top_p = rng.uniform(0.05, 1.0, size=s).astype(np.float32)
    args = [jnp.asarray(x) for x in (logits, temperature, top_k, top_p)]
    got = np.isfinite(np.asarray(sampling.filtered_logits(*args)))
    ref = np.isfinite(np.asarray(sampling.filtered_logits_sorted(*args)))
    np.testing.assert_array_equal(got, ref)
    for i in range(0, s if quant is None else 0, 8):   # the NumPy rule cuts ties by index
      np.testing.assert_array_equal(
          got[i], np_filtered_probs(logits[i], temperature[i], top_k[i], top_p[i]) > 0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0),
                                                     (1.3, -1, 0.6), (0.8, 6, 0.8)])
def test_empirical_distribution_matches_reference(temperature, top_k, top_p):
  rng = np.random.default_rng(2)
  v, draws = 10, 6000
  logits = rng.normal(size=(v,)).astype(np.float32) * 1.5
  ref = np_filtered_probs(logits, temperature, top_k, top_p)
  rows = jnp.broadcast_to(jnp.asarray(logits), (draws, v))
  full = lambda val, dt: jnp.full((draws,), val, dt)
  toks = np.asarray(_SAMPLE(
      rows, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
      jnp.arange(draws), full(0, jnp.int32)))
  freq = np.bincount(toks, minlength=v) / draws
  assert np.all(freq[ref == 0] == 0)
  # 4.5 sigma of a binomial proportion per token.
  np.testing.assert_array_less(np.abs(freq - ref), 4.5 * np.sqrt(ref * (1 - ref) / draws) + 1e-9)


def test_seeded_per_request_independent_of_batch_position():
  rng = np.random.default_rng(3)
  s, v = 8, 40
  logits = rng.normal(size=(s, v)).astype(np.float32)
  seeds = rng.integers(0, 2**30, size=s).astype(np.int32)
  index = rng.integers(0, 100, size=s).astype(np.int32)
  args = lambda perm: (jnp.asarray(logits[perm]), jnp.full((s,), 1.0), jnp.full((s,), -1),
                       jnp.full((s,), 1.0), jnp.asarray(seeds[perm]), jnp.asarray(index[perm]))
  base = np.asarray(_SAMPLE(*args(np.arange(s))))
  perm = rng.permutation(s)
  np.testing.assert_array_equal(np.asarray(_SAMPLE(*args(perm))), base[perm])
  # A different sample index gives fresh draws (not all equal over many rows).
  many = 200
  lg = jnp.zeros((many, v))
  one = lambda i: np.asarray(_SAMPLE(lg, jnp.ones((many,)), jnp.full((many,), -1),
                                             jnp.ones((many,)), jnp.arange(many),
                                             jnp.full((many,), i)))
  assert np.mean(one(0) == one(1)) < 0.2
  np.testing.assert_array_equal(one(4), one(4))


def test_top_logprobs_match_log_softmax():
  rng = np.random.default_rng(4)
  logits = rng.normal(size=(5, 30)).astype(np.float32)
  vals, ids = sampling.top_logprobs(jnp.asarray(logits), 6)
  lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  order = np.argsort(-lp, axis=-1)[:, :6]
  np.testing.assert_array_equal(np.asarray(ids), order)
  np.testing.assert_allclose(np.asarray(vals), np.take_along_axis(lp, order, -1), rtol=1e-5)


class SampleVariantsTest(chex.TestCase):
  """`sample` jitted and eagerly: the same tokens either way."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_greedy_rows_are_argmax(self):
    sample = self.variant(sampling.sample, static_argnames="all_greedy")
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 33)).astype(np.float32)
    z = lambda dt, val=0: jnp.full((16,), val, dt)
    toks = sample(jnp.asarray(logits), z(jnp.float32), z(jnp.int32, 3), z(jnp.float32, 0.5),
                  jnp.arange(16), z(jnp.int32))
    chex.assert_shape(toks, (16,))
    chex.assert_trees_all_equal(toks, logits.argmax(-1))
    # The all-greedy variant (the step's static flag when every request is greedy) gives
    # the same tokens without the filter path; ties go to the lowest id in both.
    logits[3, 7] = logits[3, 20] = logits[3].max() + 1.0
    args = (jnp.asarray(logits), z(jnp.float32), z(jnp.int32, 3), z(jnp.float32, 0.5),
            jnp.arange(16), z(jnp.int32))
    fast, slow = sample(*args, all_greedy=True), sample(*args)
    chex.assert_trees_all_equal(fast, slow, strict=True)
    assert int(fast[3]) == 7

  @chex.variants(with_jit=True, without_jit=True)
  def test_each_row_samples_as_if_alone_in_a_mixed_batch(self):
    """Greedy, plain-temperature and filtered rows share one batch with no branch on the
    batch (no lax.cond: per-row selects); each row must draw exactly what it draws alone,
    and a plain row exactly categorical(its key, logits / temperature)."""
    sample = self.variant(sampling.sample)
    rng = np.random.default_rng(11)
    s, v = 6, 50
    logits = rng.normal(size=(s, v)).astype(np.float32) * 3
    temp = np.array([0.0, 1.0, 0.7, 1.3, 1.0, 0.5], np.float32)
    top_k = np.array([-1, -1, 5, 1, -1, 3], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 1.0, 0.5, 0.9], np.float32)
    seeds = rng.integers(0, 2**30, size=s).astype(np.int32)
    index = rng.integers(0, 100, size=s).astype(np.int32)
    rows = lambda sel: tuple(jnp.asarray(a[sel])
                             for a in (logits, temp, top_k, top_p, seeds, index))
    full = np.asarray(sample(*rows(np.arange(s))))
    for i in range(s):
      assert int(sample(*rows(np.array([i])))[0]) == full[i], i
    assert full[0] == np.argmax(logits[0]) and full[3] == np.argmax(logits[3])  # greedy, top-1
    keys = sampling.row_keys(jnp.asarray(seeds), jnp.asarray(index))
    assert full[1] == int(jax.random.categorical(keys[1], jnp.asarray(logits[1] / temp[1])))
    kept = np.asarray(sampling.filtered_logits(*rows(np.arange(s))[:4]))
    assert all(np.isfinite(kept[i, full[i]]) for i in range(s))
    assert np.isinf(kept[4]).sum() > 0 and np.isinf(kept[2]).sum() == v - 5


if __name__ == "__main__":
  absltest.main()
