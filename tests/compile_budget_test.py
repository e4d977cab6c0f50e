"""paged_jax.executables: live compiled executables bounded by the process's map headroom.

The LRU's bookkeeping is checked against a plain-Python model of a process (each live
callable holds a known number of maps); real jits check that releasing one gives its
maps back and leaves the arrays it produced (donated ones included) valid.
"""

import collections
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import executables
from paged_jax.engine import SamplingParams

from engine_oracle import (ORACLE_LEN, PARAMS, VOCAB, dense_greedy, oracle_engine,
                           random_prompts, record_buckets)


class FakeProcess:
  """Maps: `base` plus `per_callable` for each callable made and not yet released (a
  callable's maps appear at its first call, as a compile's do)."""

  def __init__(self, base=1000, per_callable=100):
    self.base, self.per_callable = base, per_callable
    self.compiled = set()   # names called at least once and not released
    self.readings = 0

  def read(self):
    self.readings += 1
    return self.base + self.per_callable * len(self.compiled)

  def make(self, name):
    proc = self

    class Callable:
      def __call__(self):
        proc.compiled.add(name)
        return name

      def clear_cache(self):
        proc.compiled.discard(name)

    return Callable()


def use(budget, proc, name):
  return budget.get(name, lambda: proc.make(name))()


def test_the_lru_keeps_the_process_under_its_map_bound():
  proc = FakeProcess(base=1000, per_callable=100)
  budget = executables.ExecutableBudget(max_maps=2000, reserve_maps=500,
                                        read_maps=proc.read)
  # New callables are made while the maps leave 500 free (1000 + 5 x 100 <= 1500): the
  # 7th finds 1600 and releases the least recently used first.
  for i in range(6):
    assert use(budget, proc, i) == i
  assert len(budget) == 6 and budget.stats()["released"] == 0
  use(budget, proc, 0)              # 0 becomes the most recently used
  assert use(budget, proc, 6) == 6
  assert 1 not in budget and 0 in budget and len(budget) == 6
  peak = 0
  for i in range(7, 60):
    use(budget, proc, i % 11)       # cycles through more shapes than fit
    peak = max(peak, proc.read())
    assert proc.read() <= 2000 - 500 + 100   # at most one compile past the ceiling
    assert len(budget) == 6
  assert budget.stats()["released"] >= 40
  assert budget.stats()["peak_maps"] <= peak == 1600
  assert budget.stats()["maps_per_executable"] == 100


def test_hits_neither_make_nor_read():
  proc = FakeProcess()
  budget = executables.ExecutableBudget(max_maps=10_000, reserve_maps=500, read_maps=proc.read)
  made = []
  for _ in range(3):
    budget.get("a", lambda: made.append(1) or proc.make("a"))()
  assert len(made) == 1 and proc.readings == 1 + 1   # configure's probe + one new key
  assert budget.stats()["hits"] == 2


def test_a_count_bound_where_maps_cannot_be_read():
  proc = FakeProcess()
  budget = executables.ExecutableBudget(read_maps=lambda: None)
  assert budget.max_maps is None and budget.max_live == executables.DEFAULT_MAX_LIVE
  budget.configure(max_live=3)
  for i in range(10):
    use(budget, proc, i)
    assert len(budget) <= 3
  assert list(budget._live) == [7, 8, 9]   # pylint: disable=protected-access
  assert len(proc.compiled) == 3           # released callables were cleared
  assert budget.release() == 3 and not proc.compiled and len(budget) == 0


def test_nothing_to_release_warns_once_and_still_serves(caplog):
  proc = FakeProcess(base=1900, per_callable=100)
  budget = executables.ExecutableBudget(max_maps=2000, reserve_maps=500, read_maps=proc.read)
  with caplog.at_level("WARNING", logger="paged_jax.executables"):
    assert use(budget, proc, "a") == "a" and use(budget, proc, "b") == "b"
  assert len([r for r in caplog.records if "vm.max_map_count" in r.message]) == 1


@pytest.mark.parametrize("kw, message", [
    (dict(max_maps=0), "max_maps must be a positive int"),
    (dict(max_live=True), "max_live must be a positive int"),
    (dict(max_maps=100, reserve_maps=100), "reserve_maps must be < max_maps=100"),
])
def test_bad_bounds_are_one_line_errors(kw, message):
  with pytest.raises(ValueError, match=message):
    executables.ExecutableBudget(read_maps=lambda: 10, **kw)


def test_the_limit_reads_the_environment(monkeypatch, tmp_path):
  limit = tmp_path / "max_map_count"
  limit.write_text("65530\n")
  monkeypatch.setenv(executables.ENV_MAX_MAPS, "4000")
  assert executables.map_limit(str(limit)) == 4000
  monkeypatch.setenv(executables.ENV_MAX_MAPS, "100000")
  assert executables.map_limit(str(limit)) == 65530   # it only lowers the limit
  monkeypatch.delenv(executables.ENV_MAX_MAPS)
  assert executables.map_limit(str(tmp_path / "absent")) is None
  monkeypatch.setenv(executables.ENV_MAX_MAPS, "many")
  with pytest.raises(ValueError, match=r"\$PAGED_JAX_MAX_MAPS must be a positive int"):
    executables.map_limit(str(limit))


needs_proc_maps = pytest.mark.skipif(executables.map_count() is None,
                                     reason="no /proc/self/maps on this platform")


def _step(x, state, *, scale):
  """A donated state and a few kernels (each compiled shape maps code of its own)."""
  y = jnp.tanh(x * scale) @ jnp.cos(x.T) + jnp.sum(state)
  return state + jnp.mean(y), jnp.sort(y, axis=-1)


def _reference(x, state, scale):
  y = np.tanh(x * scale) @ np.cos(x.T) + state.sum()
  return state + y.mean(), np.sort(y, axis=-1)


@needs_proc_maps
def test_releasing_a_jit_gives_its_maps_back_and_keeps_donated_outputs():
  budget = executables.ExecutableBudget(max_live=2)
  rng = np.random.default_rng(0)
  state = jnp.zeros((4,), jnp.float32)
  want = np.zeros((4,), np.float64)
  held = []
  gc.collect()
  start = executables.map_count()
  readings = []
  for i in range(8):                    # 8 shapes, 2 live at a time
    n = 2 + i
    x = rng.standard_normal((n, n)).astype(np.float32)
    fn = budget.get(("step", n), functools.partial(
        executables.shape_jit, _step, donate_argnums=(1,), scale=0.5))
    state, out = fn(jnp.asarray(x), state)   # `state` was donated: the old one is gone
    want, want_out = _reference(x.astype(np.float64), want, 0.5)
    held.append((out, want_out))
    readings.append(executables.map_count())
  del fn
  # The outputs of released executables (every one but the last two) are still right.
  for out, want_out in held:
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(np.asarray(state), want, rtol=2e-4, atol=2e-4)
  assert budget.stats()["released"] == 6 and len(budget) == 2
  # Maps stop growing once two are live: eight shapes hold what three did (give or take
  # a few maps of allocator noise), though each new shape added maps of its own.
  per_shape = readings[1] - readings[0]
  assert per_shape > 10, readings
  assert readings[-1] - readings[2] < per_shape, (start, readings)
  budget.release()
  gc.collect()
  assert executables.map_count() - start < per_shape, (start, executables.map_count())


@needs_proc_maps
def test_a_lowered_map_limit_releases_by_headroom():
  # The map bound itself (no count bound): a ceiling about three shapes above what the
  # process holds makes the LRU release as new shapes keep coming.
  x = jnp.asarray(np.ones((3, 3), np.float32))
  state = lambda n: jnp.asarray(np.zeros((n,), np.float32))
  gc.collect()
  before = executables.map_count()
  probe = executables.shape_jit(_step, scale=1.0)
  probe(x, state(1))
  cost = executables.map_count() - before      # one shape's maps
  del probe
  gc.collect()
  now = executables.map_count()
  budget = executables.ExecutableBudget(max_maps=now + 1000 + 3 * cost, reserve_maps=1000)
  for i in range(12):
    budget.get(("shape", i), functools.partial(executables.shape_jit, _step, scale=i))(
        x, state(i + 2))
  stats = budget.stats()
  each = stats["maps_per_executable"]   # measured by the budget (allocator noise included)
  assert cost > 10 and stats["released"] >= 6, (cost, stats)
  assert 2 <= stats["live"] <= 6, stats      # about three fit under the ceiling
  assert cost / 2 <= each <= 2 * cost, (cost, stats)
  # Each reading (before a compile) is at most one compile past the ceiling.
  assert stats["peak_maps"] <= budget.max_maps - budget.reserve_maps + 2 * max(cost, each)
  budget.release()


# --- the engine under the process-wide budget ------------------------------------------

@pytest.fixture
def engine_budget():
  """The process-wide BUDGET, emptied before and after; `configure` it in the test."""
  executables.BUDGET.release()
  yield executables.BUDGET
  executables.BUDGET.release()
  executables.configure()


def _counts(budget):
  s = budget.stats()
  return collections.Counter(created=s["created"], released=s["released"])


def _check_against_oracle(prompts, outs, max_tokens):
  for prompt, out in zip(prompts, outs):
    assert out.outputs[0] == dense_greedy(PARAMS, prompt, max_tokens), prompt


def test_an_engine_with_two_live_executables_serves_what_the_oracle_does(monkeypatch,
                                                                        engine_budget):
  # Batches of different sizes and lengths move one engine across more step shapes than
  # two; shapes come back after their executables were released (traced and compiled
  # again), and every greedy output is the dense oracle's.
  engine_budget.configure(max_live=2)
  before = _counts(engine_budget)
  used = record_buckets(monkeypatch)
  engine = oracle_engine(block_size=4, num_blocks=64, max_seqs=16, budget=32)
  for seed, count, max_tokens in ((0, 2, 6), (1, 10, 3), (2, 2, 6)):
    prompts = random_prompts(seed, count, 3, 12)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    _check_against_oracle(prompts, outs, max_tokens)
  shapes = set(used)
  after = _counts(engine_budget) - before
  assert len(shapes) >= 4, shapes
  assert len(engine_budget) <= 2
  assert after["released"] >= len(shapes) - 2 and after["created"] > len(shapes), (after, shapes)


def _sweep(engine, *, decoders, sampled, offset, seed):
  """`decoders` requests decode from a 1-token prompt to ORACLE_LEN - 1 tokens (their
  block-table width passes every bucket, 4..64 blocks) while each step adds 1-token
  probes (prompts of at most the decoders' length) sized so the step's tokens land in a
  target token bucket, cycling none / 16 / 64 / 256 from `offset`: steps land on the
  decode-only and mixed buckets of every width. Returns [((prompt, max_tokens), tokens)]."""
  rng = np.random.default_rng(seed)
  reqs, outs = {}, {}

  def add(prompt, max_tokens):
    # top_k=1 samples the argmax: the sampling variant, checkable by the oracle.
    params = (SamplingParams(max_tokens=max_tokens, temperature=0.7, top_k=1,
                             seed=seed + len(reqs)) if sampled else
              SamplingParams(max_tokens=max_tokens, temperature=0.0))
    reqs[engine.add_request(prompt, params)] = (prompt, max_tokens)

  for i in range(decoders):
    add([(7 * i + 3) % VOCAB], ORACLE_LEN - 1)
  step = 0
  while engine.has_unfinished():
    target = (None, 16, 64, 256)[(step + offset) % 4]
    if target is not None and step > 0:
      lo = {16: 2, 64: 17, 256: 65}[target] - decoders   # probe tokens to land on target
      hi = target - decoders
      if hi >= max(lo, 2):
        total = int(rng.integers(max(lo, 2), hi + 1))
        count = -(-total // max(step, 2))            # prompts no longer than the decoders
        if decoders + count <= engine.cache_config.max_seqs:
          for j in range(count):
            size = total // count + (j < total % count)
            add([int(t) for t in rng.integers(0, VOCAB, size)], 1)
    for out in engine.step():
      outs[out.request_id] = out.outputs[0]
    step += 1
  return [(reqs[i], outs[i]) for i in reqs]


# Slow: ~200 step shapes compiled one after another (5-20 s each on a 2-core CPU).
@pytest.mark.slow
def test_one_engine_serves_more_shapes_than_the_map_limit_holds(monkeypatch, engine_budget):
  # The default budget (the process's vm.max_map_count) and one engine driven across
  # more distinct step shapes than the process could map at once without releases
  # (~700 maps each): it finishes, the outputs are the dense oracle's, and the map count
  # stays below the limit throughout.
  engine_budget.configure()
  before = _counts(engine_budget)
  used = record_buckets(monkeypatch)
  # Block size 1: widths 4..64 blocks; 64 slots: rows 8..64; 256 tokens: T 16, 64, 256.
  engine = oracle_engine(block_size=1, num_blocks=64 * ORACLE_LEN, max_seqs=64, budget=256)
  limit, peak, served, oracle = engine_budget.max_maps, 0, 0, {}
  for sampled in (False, True):              # both sampling variants of each shape
    for decoders in (6, 14, 22, 30, 46, 62):   # every row bucket
      for offset in range(4):
        for (prompt, max_tokens), out in _sweep(engine, decoders=decoders, sampled=sampled,
                                                offset=offset, seed=len(used)):
          key = (tuple(prompt), max_tokens)
          if key not in oracle:
            oracle[key] = dense_greedy(PARAMS, prompt, max_tokens)
          assert out == oracle[key], prompt
          served += 1
        peak = max(peak, executables.map_count())
        assert peak < limit
  stats = engine_budget.stats()
  after = _counts(engine_budget) - before
  shapes = set(used)
  print(f"compile budget: {served} requests, {len(shapes)} distinct step shapes, "
        f"{after['created']} executables made, {after['released']} released, "
        f"{stats['maps_per_executable']:.0f} maps per executable, peak "
        f"{max(peak, stats['peak_maps'])} of {limit} maps")
  assert len(shapes) > 150, (len(shapes), sorted(shapes))
  # More than the process could hold at once: without releases it would have died.
  assert len(shapes) * stats["maps_per_executable"] > limit, stats
  assert after["released"] > 0
