"""Online serving pieces against independent references: Poisson arrivals, Orca admission
gates, latency metrics, the clocks, and the arrival-driven serve loop on a scripted fake
engine that has `recorder.EngineLike`'s surface (a virtual step clock, so no wall-clock
assertion)."""

import dataclasses
import math
import types

import numpy as np
import pytest
from scipy import stats

from paged_jax.bench import arrivals
from paged_jax.bench import clocks
from paged_jax.bench import latency
from paged_jax.bench import recorder
from paged_jax.bench import serving
from paged_jax.bench import workloads
from paged_jax.bench.baselines import gate as gate_lib
from paged_jax.engine.report import StepReport


# ---- arrivals ----------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.5, 7.0, 40.0])
def test_arrivals_are_poisson(rate):
  duration = 4000 / rate                     # ~4000 arrivals
  t = arrivals.arrival_times(rate, duration, seed=3)
  assert np.all(np.diff(t) > 0) and t[0] >= 0 and t[-1] < duration
  # Count ~ Poisson(rate * duration): within 4 sd.
  assert abs(t.size - rate * duration) < 4 * math.sqrt(rate * duration)
  gaps = np.diff(np.concatenate([[0.0], t]))
  # Gaps ~ Exp(rate): Kolmogorov-Smirnov against scipy's exponential.
  assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 1e-3
  # Counts in unit-mean windows: variance / mean ~ 1 (Poisson dispersion).
  counts = np.bincount((t * rate).astype(int), minlength=int(duration * rate))
  assert 0.85 < counts.var() / counts.mean() < 1.15


def test_arrivals_seeded_and_rate_scaled():
  a = arrivals.arrival_times(4.0, 50.0, seed=1)
  np.testing.assert_array_equal(a, arrivals.arrival_times(4.0, 50.0, seed=1))
  assert not np.array_equal(a[:10], arrivals.arrival_times(4.0, 50.0, seed=2)[:10])
  # A faster rate is the same stream compressed: common random numbers across a sweep.
  np.testing.assert_allclose(arrivals.arrival_times(8.0, 25.0, seed=1), a / 2)
  for bad in (0.0, -1.0, math.inf, math.nan):
    with pytest.raises(ValueError, match="rate"):
      arrivals.arrival_times(bad, 1.0, seed=0)
  with pytest.raises(ValueError, match="duration_s"):
    arrivals.arrival_times(1.0, 0.0, seed=0)


def test_arrivals_by_count_are_the_same_stream():
  # The first n arrivals of a window are the n-arrival stream: one generator, two ways.
  seed = int(np.random.default_rng(31).integers(1 << 20))
  window = arrivals.arrival_times(3.0, 40.0, seed=seed)
  np.testing.assert_array_equal(
      arrivals.arrival_times(3.0, num_requests=window.size, seed=seed), window)
  np.testing.assert_array_equal(arrivals.arrival_times(math.inf, num_requests=4, seed=seed),
                                np.zeros(4))
  for kw in ({}, {"duration_s": 1.0, "num_requests": 3}):
    with pytest.raises(ValueError, match="exactly one"):
      arrivals.arrival_times(1.0, seed=0, **kw)
  with pytest.raises(ValueError, match="request_rate"):
    arrivals.arrival_times(0.0, num_requests=3, seed=0)
  with pytest.raises(ValueError, match="request_rate"):
    arrivals.arrival_times(math.inf, 1.0, seed=0)   # a window needs a finite rate


# ---- gates -------------------------------------------------------------------------------
def reference_reservation(policy, total, max_len, num_seqs):
  per = {"max": max_len, "oracle": total,
         "pow2": min(max_len, 2 ** math.ceil(math.log2(total)))}[policy]
  return num_seqs * per


class FirstFitModel:
  """Slot-occupancy reference: a request takes the lowest run of free slots that fits."""

  def __init__(self, capacity):
    self.free = np.ones(capacity, bool)
    self.where = {}

  def try_take(self, rid, size):
    run = 0
    for i, f in enumerate(self.free):
      run = run + 1 if f else 0
      if run == size:
        self.free[i - size + 1:i + 1] = False
        self.where[rid] = (i - size + 1, size)
        return True
    return False

  def give_back(self, rid):
    off, size = self.where.pop(rid)
    self.free[off:off + size] = True


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_orca_gate_matches_first_fit_model(policy):
  rng = np.random.default_rng(7)
  cap, max_len = 1024, 256
  gate = gate_lib.OrcaGate(policy, cap, max_len)
  model, queue, live = FirstFitModel(cap), [], []
  admitted_total = 0
  for rid in range(400):
    num_seqs = int(rng.choice([1, 1, 2]))
    total = int(rng.integers(2, max_len // num_seqs + 1))
    assert gate.reservation(total, num_seqs) == reference_reservation(policy, total, max_len,
                                                                       num_seqs)
    gate.offer(rid, total, num_seqs)
    queue.append((rid, reference_reservation(policy, total, max_len, num_seqs)))
    if live and rng.random() < 0.45:          # a random running request finishes
      done = live.pop(int(rng.integers(len(live))))
      gate.release(done)
      model.give_back(done)
    got = gate.admit()
    want = []
    while queue and model.try_take(*queue[0]):   # FCFS with head-of-line blocking
      want.append(queue.pop(0)[0])
    assert got == want
    live += got
    admitted_total += len(got)
    assert gate.reserved_tokens == sum(s for _, s in model.where.values()) <= cap
    assert gate.num_waiting == len(queue)
    for r in live:
      assert gate.arena.span(r) == model.where[r]
  assert admitted_total > 50


def test_gates_reject_bad_input():
  with pytest.raises(ValueError, match="system"):
    gate_lib.make_gate("orca_fifo", 512, 256)
  with pytest.raises(ValueError, match="arena"):
    gate_lib.OrcaGate("max", 512, 256).offer(0, 10, num_seqs=3)
  g = gate_lib.make_gate("paged", 512, 256)
  for i in range(3):
    g.offer(i, 10 ** 6)                         # the open gate never refuses
  assert g.admit() == [0, 1, 2] and g.admit() == []


# ---- latency metrics ---------------------------------------------------------------------
def test_summarize_by_hand():
  arrival = [0.0, 1.0, 2.0, 2.0]
  first = [0.5, 1.5, 4.0, 3.0]
  finish = [2.5, 1.5, 6.0, 5.0]
  out_len = [5, 1, 3, 9]
  s = latency.summarize(arrival, first, finish, out_len)
  assert s["normalized_latency_s_per_token"] == pytest.approx(
      np.mean([2.5 / 5, 0.5 / 1, 4.0 / 3, 3.0 / 9]))
  assert s["mean_latency_s"] == pytest.approx((2.5 + 0.5 + 4 + 3) / 4)
  ttft = [0.5, 0.5, 2.0, 1.0]
  assert s["ttft_p50_s"] == pytest.approx(0.75)
  assert s["ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99))
  tpot = [2.0 / 4, 2.0 / 2, 2.0 / 8]            # the 1-token request has no TPOT
  assert s["tpot_p50_s"] == pytest.approx(0.5)
  assert s["tpot_p99_s"] == pytest.approx(np.percentile(tpot, 99))
  assert s["throughput_req_s"] == pytest.approx(4 / 6.0)
  assert s["throughput_tok_s"] == pytest.approx(18 / 6.0)
  with pytest.raises(ValueError):
    latency.summarize([1.0], [1.0], [0.5], [3])


def test_slo_rule_and_max_rate():
  assert latency.slo_from_unloaded([0.01, 0.03, math.nan], 3) == pytest.approx(0.09)
  rates = [8, 1, 2, 4]
  lat = [1.0, 0.1, 0.2, 0.6]
  got = latency.max_rate_at_slo(rates, lat, 0.4)
  assert got["swept"] == 2 and got["interpolated"] == pytest.approx(3.0)
  assert latency.max_rate_at_slo(rates, lat, 5.0) == {"swept": 8.0, "interpolated": None}
  assert latency.max_rate_at_slo(rates, lat, 0.05)["swept"] == 0.0
  # A dip after the first miss does not count: the rate must hold at every lower rate.
  assert latency.max_rate_at_slo([1, 2, 3], [0.1, 0.9, 0.1], 0.5)["swept"] == 1.0


# ---- the serve loop on a scripted engine -------------------------------------------------
@dataclasses.dataclass
class _Seq:
  num_generated: int = 0


@dataclasses.dataclass
class _Group:
  request_id: int
  seqs: list
  left: int


class _Out:
  def __init__(self, rid):
    self.request_id = rid


class FakeEngine:
  """Every running request gains one token per step (its first in the step after it is
  added); at most `max_running` run, the rest wait FCFS. Has EngineLike's surface."""

  def __init__(self, max_running):
    self.max_running, self.waiting, self.running, self.added = max_running, [], [], []
    self.last_step = StepReport()
    self.cache_config = types.SimpleNamespace(block_size=16)
    self.stats, self.timing = {"steps": 0}, {}
    self.num_preemptions = self.num_swaps = 0
    self.peak = 0

  def add_request(self, prompt, params=None, request_id=None):
    self.waiting.append(_Group(request_id, [_Seq()], params.max_tokens))
    self.added.append(request_id)
    return request_id

  def has_unfinished(self):
    return bool(self.waiting or self.running)

  def flush(self):
    pass

  def step(self, swapped_blocks=0):
    run = self.running
    while self.waiting and len(run) < self.max_running:
      run.append(self.waiting.pop(0))
    self.peak = max(self.peak, len(run))
    self.stats["steps"] += 1
    done, first = [], []
    for g in list(run):
      g.seqs[0].num_generated += 1
      if g.seqs[0].num_generated == 1:
        first.append(g.request_id)
      g.left -= 1
      if g.left == 0:
        run.remove(g)
        done.append(_Out(g.request_id))
    self.last_step = StepReport(first_token_ids=tuple(first),
                                finished_ids=tuple(o.request_id for o in done),
                                num_running_groups=len(run), num_running_seqs=len(run),
                                swapped_blocks=swapped_blocks)
    return done


def _requests(n, rate, seed=0):
  base = workloads.scaled_requests("alpaca", n, seed=seed, max_len=64, scale=4)
  times = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
  return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(base, times)]


def test_serve_online_times_on_an_uncontended_engine():
  reqs = _requests(30, rate=0.5)
  clock = clocks.StepClock(0.1)
  clock.wait_until(1000.0)                     # a used clock: serving restarts it at 0
  res = serving.serve_online(FakeEngine(max_running=100), reqs, gate_lib.OpenGate(),
                             clock=clock)
  arr = np.array([r.arrival_time for r in reqs])
  n = np.array([r.output_len for r in reqs])
  # Steps run every 0.1 s from the first arrival on: a request that arrives at time a is
  # added before the first step that starts at or after a; its k-th token lands one step
  # later each. Reference: start = a rounded up to the step grid of a continuously busy
  # engine, or a itself when the engine was idle. Bound it instead of replaying the loop.
  assert np.all(res["first_token"] >= arr + 0.1 - 1e-9)
  assert np.all(res["first_token"] <= arr + 0.2 + 1e-9)
  np.testing.assert_allclose(res["finish"] - res["first_token"], (n - 1) * 0.1, atol=1e-9)
  assert res["summary"]["requests"] == 30 and res["preemptions"] == 0


def test_serve_online_through_orca_gate_respects_reservations():
  reqs = _requests(60, rate=50.0, seed=4)
  cap, max_len = 256, 64
  gate = gate_lib.OrcaGate("max", cap, max_len)
  eng = FakeEngine(max_running=100)
  res = serving.serve_online(eng, reqs, gate, clock=clocks.StepClock(0.01))
  assert eng.peak == cap // max_len            # Orca(Max): exactly 4 at a time
  assert sorted(eng.added) == [r.request_id for r in reqs]
  assert gate.reserved_tokens == 0 and gate.num_waiting == 0
  assert np.all(res["finish"] >= res["first_token"])
  open_res = serving.serve_online(FakeEngine(max_running=100), reqs, gate_lib.OpenGate(),
                                  clock=clocks.StepClock(0.01))
  assert (open_res["summary"]["normalized_latency_s_per_token"]
          < res["summary"]["normalized_latency_s_per_token"])


class SwappingEngine(FakeEngine):
  """FakeEngine whose every third step swaps `blocks` blocks (as Engine.stats and
  Engine.last_step count them)."""

  def __init__(self, max_running, blocks):
    super().__init__(max_running)
    self.blocks, self.steps = blocks, 0
    self.stats["swapped_blocks"] = 0

  def step(self, swapped_blocks=0):
    self.steps += 1
    moved = self.blocks if self.steps % 3 == 0 else 0
    self.stats["swapped_blocks"] += moved
    return super().step(swapped_blocks=moved)


def test_step_clock_charges_swapped_tokens():
  reqs = _requests(20, rate=50.0, seed=5)   # a busy engine: no idle gaps to absorb time
  free = serving.serve_online(SwappingEngine(4, 3), reqs, gate_lib.OpenGate(),
                              clock=clocks.StepClock(0.01, swap_s_per_token=0.0))
  paid = serving.serve_online(SwappingEngine(4, 3), reqs, gate_lib.OpenGate(),
                              clock=clocks.StepClock(0.01, swap_s_per_token=1e-4))
  assert paid["swapped_blocks"] == free["swapped_blocks"] == 3 * (free["steps"] // 3)
  assert paid["steps"] == free["steps"]
  # Each finish moves by the swaps of the steps up to it: 3 blocks x 16 tokens x 1e-4 s.
  extra = paid["finish"] - free["finish"]
  assert extra.max() == pytest.approx((free["steps"] // 3) * 3 * 16 * 1e-4)
  assert np.all(extra >= 0) and len(set(np.round(extra, 9))) > 1
  for bad in (-1.0, math.nan, math.inf):
    with pytest.raises(ValueError, match="swap_s_per_token"):
      clocks.StepClock(0.01, swap_s_per_token=bad)


def test_serve_online_rejects_duplicate_ids():
  r = workloads.Request(0, np.array([1, 2], np.int32), 3)
  with pytest.raises(ValueError, match="unique"):
    serving.serve_online(FakeEngine(4), [r, r], gate_lib.OpenGate(),
                         clock=clocks.StepClock(0.1))


def test_serve_online_counts_the_engines_work_and_running_requests():
  reqs = _requests(24, rate=80.0, seed=6)
  eng = FakeEngine(max_running=3)
  eng.stats["steps"] = 100                      # counters before the run do not count
  res = serving.serve_online(eng, reqs, gate_lib.OpenGate(), clock=clocks.StepClock(0.01))
  assert res["steps"] == eng.stats["steps"] - 100
  assert res["max_running"] == eng.peak == 3
  # Busy from the first to the last step (arrivals far faster than service): mean near 3.
  assert 2.5 < res["mean_running"] <= 3


class MetricsEngine(FakeEngine):
  """FakeEngine with Engine.metrics()'s queue counts."""

  def metrics(self):
    return {"num_waiting": len(self.waiting), "num_swapped": 0}


@pytest.mark.parametrize("engine_cls", [FakeEngine, MetricsEngine])
def test_serve_online_counts_running_and_waiting_per_step(engine_cls):
  reqs = _requests(40, rate=60.0, seed=7)
  eng = engine_cls(max_running=3)
  res = serving.serve_online(eng, reqs, gate_lib.OpenGate(), clock=clocks.StepClock(0.01))
  run, wait = res["running_per_step"], res["waiting_per_step"]
  assert run.shape == wait.shape == (res["steps"],)
  assert run.mean() == pytest.approx(res["mean_running"])
  # Reference: replay the same loop by hand (FCFS admission of at most 3, one token a
  # step, arrivals added before the step that starts at or after them).
  arrival = sorted(r.arrival_time for r in reqs)
  left = {r.request_id: r.output_len for r in reqs}
  order = [r.request_id for r in sorted(reqs, key=lambda r: r.arrival_time)]
  t, nxt, queue, running, ref_run, ref_wait = 0.0, 0, [], [], [], []
  while len(ref_run) < res["steps"]:
    while nxt < len(arrival) and arrival[nxt] <= t:
      queue.append(order[nxt])
      nxt += 1
    if not queue and not running:
      t = arrival[nxt]
      continue
    while queue and len(running) < 3:
      running.append(queue.pop(0))
    for rid in list(running):
      left[rid] -= 1
      if left[rid] == 0:
        running.remove(rid)
    t += 0.01
    ref_run.append(len(running))
    ref_wait.append(len(queue))
  np.testing.assert_array_equal(run, ref_run)
  np.testing.assert_array_equal(wait, ref_wait)
  assert wait.max() > 0 and run[wait > 0].mean() > run.mean()   # saturated: fuller batches


def test_loop_recorder_refuses_what_is_not_an_engine_or_a_clock():
  with pytest.raises(TypeError, match="EngineLike"):
    recorder.LoopRecorder(object(), clocks.StepClock(0.1))
  with pytest.raises(TypeError, match="Clock"):
    recorder.LoopRecorder(FakeEngine(1), object())


def test_clocks_follow_the_protocol():
  assert isinstance(clocks.WallClock(), clocks.Clock)
  assert isinstance(clocks.StepClock(0.1), clocks.Clock)
  assert clocks.StepClock(0.1).virtual and not clocks.WallClock().virtual
  c = clocks.StepClock(0.5, swap_s_per_token=0.01)
  c.stepped(clocks.StepSample())
  c.stepped(clocks.StepSample(swapped_tokens=10))
  c.wait_until(0.2)                             # in the past: no effect
  assert c.now() == pytest.approx(0.5 + 0.5 + 10 * 0.01)
  c.wait_until(3.0)
  assert c.now() == 3.0
  c.start()
  assert c.now() == 0.0
  with pytest.raises(ValueError, match="step_s"):
    clocks.StepClock(0.0)
