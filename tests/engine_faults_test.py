"""The engine's failure modes, each a test: the n=2 / beam hang at the admission
bound, exceptions and KeyboardInterrupt injected at every point of a step,
bad input (sampling params, prompts, params, batches, ids) rejected before
anything changes, outputs never lost, abort, metrics, one dispatch and one host
sync per step, and `step_for_compile`."""

import functools

import jax
import numpy as np
import pytest

from paged_jax.config import ModelConfig
from paged_jax.engine import Engine, SamplingParams, step_for_compile
from paged_jax.engine import engine as engine_mod
from paged_jax.engine import update as update_mod

from engine_oracle import (MC, PARAMS, VOCAB, dense_greedy, greedy, oracle_engine,
                           random_prompts, run_counting_dispatches_and_syncs)

# The cache shape of engine_test.py (its compiled step is reused).
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET = 16, 12, 8, 8


make_engine = functools.partial(oracle_engine, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                max_seqs=MAX_SEQS, budget=BUDGET)
prompts_of = random_prompts


def drain(engine, max_steps=2000):
  outs = {}
  for _ in range(max_steps):
    if not engine.has_unfinished():
      return outs
    for o in engine.step():
      assert o.request_id not in outs, "an output was returned twice"
      outs[o.request_id] = o
  raise AssertionError(f"not finished after {max_steps} steps")


def assert_no_leak(engine):
  engine.flush()
  m = engine.metrics()
  assert m["num_free_blocks"] + m["num_evictable_blocks"] == m["num_blocks"]
  assert m["num_running"] == m["num_waiting"] == m["num_swapped"] == 0
  assert sorted(engine.scheduler.free_slots) == list(range(MAX_SEQS))
  blocks = jax.device_get(engine.state.blocks)
  assert not np.asarray(blocks.active).any()


# ---- 1. the hang at the admission bound ------------------------------------------------

@pytest.mark.parametrize("kind", ["n", "beam"])
def test_n2_and_beam_at_the_exact_admission_bound_finish(kind):
  # 33-token prompt, max_tokens=4, 2 sequences: add_request's bound is exactly
  # 2 + 2 * (3 - 2) = 4 blocks of 16. The scheduler's need (with copy-on-write
  # counted exactly: the last holder writes in place) never exceeds it.
  prompt = prompts_of(1, 1, lo=33, hi=33)[0]
  sp = (SamplingParams(max_tokens=4, temperature=0.0, n=2) if kind == "n"
        else SamplingParams(max_tokens=4, temperature=0.0, beam_width=2, n=2))
  with pytest.raises(ValueError, match="never fit"):
    make_engine(num_blocks=3).add_request(prompt, sp)
  engine = make_engine(num_blocks=4)
  engine.add_request(prompt, sp)
  outs = drain(engine, max_steps=30)
  assert engine.num_preemptions == 0
  want = make_engine().generate([prompt], sp)[0]
  assert list(outs.values())[0].outputs == want.outputs
  if kind == "n":
    assert want.outputs == [dense_greedy(PARAMS, prompt, 4)] * 2
  assert_no_leak(engine)


# ---- 2. faults injected at every point of a step ------------------------------------

def workload():
  prompts = prompts_of(3, 6, lo=10, hi=30)
  params = [greedy(12), SamplingParams(max_tokens=10, temperature=0.9, top_k=20, n=2, seed=5),
            greedy(10, beam_width=2, n=1), greedy(14), greedy(9),
            SamplingParams(max_tokens=8, temperature=1.1, top_p=0.9, seed=11)]
  return prompts, params


POINTS = ("plan", "inputs", "dispatch", "wait", "apply")


class Injector:
  """Raises `exc` at the k-th call of one point of the engine's step."""

  def __init__(self, monkeypatch, engine, point, k, exc):
    self.left, self.exc, self.fired = k, exc, False

    def wrap(fn):
      def wrapped(*a, **kw):
        self.left -= 1
        if self.left == 0:
          self.fired = True
          raise self.exc()
        return fn(*a, **kw)
      return wrapped

    if point == "plan":
      monkeypatch.setattr(engine.scheduler, "schedule", wrap(engine.scheduler.schedule))
    elif point == "inputs":
      monkeypatch.setattr(engine_mod, "build_inputs", wrap(engine_mod.build_inputs))
    elif point == "dispatch":
      engine._step = wrap(engine._step)   # pylint: disable=protected-access
    elif point == "wait":   # the host blocked on the device's outputs
      monkeypatch.setattr(jax, "device_get", wrap(jax.device_get))
    elif point == "apply":   # mid-way: earlier sequences of the step already have tokens
      update = update_mod.Update
      monkeypatch.setattr(update, "finish_seq", wrap(update.finish_seq))


_REF = {}


def reference(caching):
  if caching not in _REF:
    prompts, params = workload()
    ref = make_engine(caching=caching, preemption_mode="swap")
    _REF[caching] = {r.request_id: r.outputs for r in ref.generate(prompts, params)}
    assert ref.num_preemptions > 0   # the small pool preempts: those paths are covered too
  return _REF[caching]


# Default: each point once, caching on or off alternately; all pairs with --slow.
FAULT_CASES = [pytest.param(p, c, marks=[pytest.mark.slow] if (i % 2 == 0) != c else [])
               for i, p in enumerate(POINTS) for c in (False, True)]


@pytest.mark.parametrize("point, caching", FAULT_CASES)
def test_a_fault_anywhere_in_a_step_changes_no_output_and_leaks_nothing(monkeypatch, point,
                                                                        caching):
  prompts, params = workload()
  want = reference(caching)
  ks = (1, 3, 5) if point == "apply" else (2, 7, 19)   # _finish_seq: once per finish
  for k, exc in zip(ks, (KeyboardInterrupt, RuntimeError, KeyboardInterrupt)):
    engine = make_engine(caching=caching, preemption_mode="swap")
    for p, sp in zip(prompts, params):
      engine.add_request(p, sp)
    with monkeypatch.context() as m:
      inj = Injector(m, engine, point, k, exc)
      outs = {}
      with pytest.raises(exc):
        for _ in range(500):
          for o in engine.step():
            outs[o.request_id] = o
      assert inj.fired
    outs.update(drain(engine))
    assert {i: o.outputs for i, o in outs.items()} == want, (point, k)
    assert_no_leak(engine)


# ---- 3. bad input -------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(top_k=2**40), "top_k"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2**31), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"), (dict(seed=-1), "seed"), (dict(seed=2**40), "seed"),
    (dict(n=0), "n must"), (dict(beam_width=0), "beam_width"),
    (dict(stop_token_ids=7), "stop_token_ids"), (dict(stop_token_ids=(1, -1)), "stop_token_ids"),
    (dict(stop_token_ids=tuple(range(9))), "stop_token_ids")])
def test_sampling_params_rejects_every_bad_field_in_one_line(kw, field):
  with pytest.raises(ValueError, match=field) as e:
    SamplingParams(**kw)
  assert "\n" not in str(e.value)


def test_top_k_beyond_vocab_runs_and_the_engine_stays_alive():
  engine = make_engine()
  sp = SamplingParams(max_tokens=3, temperature=0.0, top_k=2**31 - 1)
  assert engine.generate([[1, 2, 3]], sp)[0].outputs[0] == dense_greedy(PARAMS, [1, 2, 3], 3)


def test_prompts_as_numpy_and_jax_arrays_and_bad_prompts():
  engine = make_engine()
  p = [5, 78 % VOCAB, 9]
  outs = engine.generate([np.asarray(p, np.int64), jax.numpy.asarray(p, jax.numpy.int32), p],
                         greedy(3))
  assert [o.outputs for o in outs] == [[dense_greedy(PARAMS, p, 3)]] * 3
  for bad, msg in (([1, VOCAB], r"prompt\[1\]"), ([[1, 2]], "one dimension"), ([], "at least"),
                   ([1, 2.5], r"prompt\[1\]"), ([True, 1], r"prompt\[0\]"), ("ab", "prompt"),
                   (np.zeros((0,), np.int32), "at least")):
    with pytest.raises(ValueError, match=msg):
      engine.add_request(bad, greedy(2))
  assert not engine.has_unfinished()


def test_params_that_do_not_fit_the_model_are_rejected_by_the_constructor():
  cc = MC.cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=4)
  other = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=256)
  from paged_jax.models import llama
  wrong = jax.eval_shape(lambda: llama.init_params(other, jax.random.key(0)))
  wrong = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), wrong)
  with pytest.raises(ValueError, match="shape"):
    Engine(MC, wrong, cc, attention_backend="reference")
  with pytest.raises(ValueError, match="params"):
    Engine(MC, {"params": {}}, cc, attention_backend="reference")
  Engine(MC, PARAMS["params"], cc, attention_backend="reference")   # the bare tree is fine


def test_a_batch_with_one_bad_request_queues_nothing():
  engine = make_engine()
  with pytest.raises(ValueError, match=r"prompt\[0\]"):
    engine.generate([[1, 2, 3], [VOCAB]], greedy(3))
  assert not engine.has_unfinished()
  with pytest.raises(ValueError, match="top_k"):
    engine.generate([[1, 2], [3]], [greedy(2), SamplingParams(top_k=-5)])
  assert not engine.has_unfinished()
  assert engine.generate([[4, 5]], greedy(2))[0].outputs[0] == dense_greedy(PARAMS, [4, 5], 2)


def test_automatic_ids_never_collide_with_user_ids():
  engine = make_engine()
  assert engine.add_request([1, 2], greedy(2), request_id=0) == 0
  assert engine.add_request([1, 2], greedy(2), request_id=2) == 2
  auto = [engine.add_request([3], greedy(2)) for _ in range(3)]
  assert len(set(auto) | {0, 2}) == 5
  with pytest.raises(ValueError, match="already in use"):
    engine.add_request([1], greedy(2), request_id=auto[0])
  assert set(drain(engine)) == {0, 2, *auto}


def test_outputs_finished_during_another_generate_are_returned_by_the_next_step():
  engine = make_engine()
  early = engine.add_request([7, 8, 9], greedy(2), request_id="early")
  outs = engine.generate([[1, 2, 3, 4]], greedy(12))
  assert [o.request_id for o in outs] != ["early"] and len(outs) == 1
  assert engine.has_unfinished()
  kept = engine.step()
  assert [o.request_id for o in kept] == [early]
  assert kept[0].outputs[0] == dense_greedy(PARAMS, [7, 8, 9], 2)
  assert engine.step() == [] and not engine.has_unfinished()


# ---- 4. abort -------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_blocks_returns_partial_output_and_others_stay_exact(where):
  prompts = prompts_of(5, 6, lo=20, hi=30)
  engine = make_engine(preemption_mode="swap")
  ids = [engine.add_request(p, greedy(20)) for p in prompts]
  victim = None
  for _ in range(200):
    engine.step()
    s = engine.scheduler
    queue = {"waiting": s.waiting, "running": s.running, "swapped": s.swapped}[where]
    mine = [g for g in queue if g.request_id in ids and (where != "waiting" or g.num_preemptions
                                                         or g is s.waiting[-1])]
    if mine and (where != "running" or mine[-1].seqs[0].num_generated > 0):
      victim = mine[-1].request_id
      break
  assert victim is not None, f"no {where} request to abort"
  out = engine.abort(victim)
  assert out.request_id == victim and out.finish_reasons == ["abort"]
  full = dense_greedy(PARAMS, prompts[ids.index(victim)], 20)
  assert full[:len(out.outputs[0])] == out.outputs[0]
  assert engine.abort(victim) is None
  rest = drain(engine)
  assert victim not in rest
  for i, p in zip(ids, prompts):
    if i != victim:
      assert rest[i].outputs[0] == dense_greedy(PARAMS, p, 20)
  assert_no_leak(engine)


def test_abort_of_a_finished_unreturned_request_returns_its_output():
  engine = make_engine()
  engine.add_request([1, 2], greedy(2), request_id="a")
  engine.generate([[3, 4, 5]], greedy(6))
  out = engine.abort("a")
  assert out.finish_reasons == ["length"] and not engine.has_unfinished()


# ---- 5. metrics, one dispatch + one sync per step, step_for_compile -----------------

@pytest.mark.parametrize("caching", [False, True])
def test_one_dispatch_and_one_host_sync_per_step(monkeypatch, caching):
  engine = make_engine(caching=caching)
  prefix = prompts_of(7, 1, lo=40, hi=40)[0]
  for i in range(6):
    engine.add_request(prefix + [i], greedy(5))
  run_counting_dispatches_and_syncs(engine, monkeypatch)
  m = engine.metrics()
  assert m["num_preemptions"] == 0
  if caching:
    assert m["prefix_hit_blocks"] >= 5 * 2 and m["prefix_query_blocks"] >= m["prefix_hit_blocks"]


def test_metrics_report_kv_usage_queues_and_hits():
  engine = make_engine(caching=True)
  keys = {"num_blocks", "num_free_blocks", "num_evictable_blocks", "num_running",
          "num_waiting", "num_swapped", "num_preemptions", "prefix_hit_blocks",
          "prefix_query_blocks"}
  assert keys <= set(engine.metrics())
  prefix = prompts_of(8, 1, lo=33, hi=33)[0]
  engine.generate([prefix + [1]], greedy(2))
  m = engine.metrics()
  assert m["num_evictable_blocks"] == 2 and m["num_free_blocks"] == NUM_BLOCKS - 2
  engine.generate([prefix + [2]], greedy(2))
  m = engine.metrics()
  assert (m["prefix_hit_blocks"], m["prefix_query_blocks"]) == (2, 4)


@pytest.mark.parametrize("caching", [False, True])
def test_step_for_compile_lowers_without_allocating(caching):
  cc = MC.cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=4, enable_prefix_caching=caching)
  fn, args = step_for_compile(MC, cc, max_num_batched_tokens=BUDGET,
                              attention_backend="reference")
  leaves = jax.tree_util.tree_leaves(args)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  text = fn.trace(*args).lower().as_text()
  assert "func" in text
