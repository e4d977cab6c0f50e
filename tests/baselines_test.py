"""Contiguous baselines: first-fit arena and Orca simulation vs slot-level brute force."""

import collections
import math

import numpy as np
import pytest

from paged_jax.bench.baselines import ContiguousArena, OrcaAllocator, reservation_tokens
from paged_jax.bench import memory
from paged_jax.bench import workloads
from paged_jax.bench.baselines import simulate


# ----------------------------------------------------------------------------- arena
def _runs(owner):
  """Maximal free runs (offset, size) of a slot-owner array (-1 = free)."""
  runs, start = [], None
  for i, o in enumerate(list(owner) + [0]):
    if o == -1 and start is None:
      start = i
    elif o != -1 and start is not None:
      runs.append((start, i - start))
      start = None
  return runs


def test_arena_first_fit_matches_slot_level_brute_force():
  rng = np.random.default_rng(0)
  cap = 97
  arena = ContiguousArena(cap)
  owner = np.full(cap, -1)          # brute force: who owns each slot
  live = []
  for step in range(3000):
    if live and (rng.random() < 0.45 or len(live) > 12):
      rid = live.pop(int(rng.integers(len(live))))
      assert arena.release(rid) == int((owner == rid).sum())
      owner[owner == rid] = -1
    else:
      size = int(rng.integers(1, 30))
      want = next((off for off, n in _runs(owner) if n >= size), None)   # first fit
      got = arena.allocate(step, size)
      assert got == want
      if want is not None:
        owner[want:want + size] = step
        live.append(step)
    assert arena.holes() == _runs(owner)
    assert arena.free == int((owner == -1).sum())
    assert arena.largest_hole() == max((n for _, n in _runs(owner)), default=0)


def test_arena_failed_allocation_changes_nothing_and_bad_input_raises():
  arena = ContiguousArena(10)
  assert arena.allocate("a", 4) == 0 and arena.allocate("b", 4) == 4
  arena.release("a")
  before = arena.holes()
  assert arena.allocate("c", 5) is None   # 6 slots free in total, but the largest hole is 4
  assert arena.holes() == before and "c" not in arena
  with pytest.raises(ValueError, match="size must be"):
    arena.allocate("d", 11)
  with pytest.raises(ValueError, match="already holds"):
    arena.allocate("b", 1)
  with pytest.raises(KeyError):
    arena.release("zz")
  with pytest.raises(ValueError, match="capacity"):
    ContiguousArena(0)


def test_reservation_policies():
  assert reservation_tokens("max", 499, 2048) == 2048
  assert reservation_tokens("pow2", 499, 2048) == 512
  assert reservation_tokens("pow2", 512, 2048) == 512
  assert reservation_tokens("pow2", 513, 2048) == 1024
  assert reservation_tokens("pow2", 1500, 1536) == 1536   # capped at the context limit
  assert reservation_tokens("pow2", 1, 2048) == 1
  assert reservation_tokens("oracle", 499, 2048) == 499
  with pytest.raises(ValueError, match="policy"):
    reservation_tokens("min", 5, 10)
  with pytest.raises(ValueError, match="total_len"):
    reservation_tokens("oracle", 11, 10)
  alloc = OrcaAllocator("pow2", 64, 32)
  assert alloc.try_admit(0, 17) and alloc.reserved(0) == 32
  assert alloc.try_admit(1, 9) and alloc.reserved(1) == 16
  assert not alloc.try_admit(2, 20)   # needs 32, 16 free
  assert 2 not in alloc.arena


# ------------------------------------------------------- Orca simulation brute force
def _brute_force_orca(reqs, policy, budget, max_len):
  """Step-by-step, slot-by-slot model of the simulation (no closed-form skipping)."""
  need = lambda f: reservation_tokens(policy, f, max_len)
  owner = np.full(budget, -1)
  waiting = collections.deque(reqs)   # (id, prompt, final)
  running = {}                        # id -> [cur, final, offset, size]
  sums = collections.Counter()
  steps = sat_steps = peak = sat_running = 0
  while waiting or running:
    for rid in [r for r, v in running.items() if v[0] == v[1]]:
      owner[owner == rid] = -1
      del running[rid]
    for v in running.values():
      v[0] += 1
    while waiting:
      rid, p, f = waiting[0]
      off = next((o for o, n in _runs(owner) if n >= need(f)), None)
      if off is None:
        break
      owner[off:off + need(f)] = rid
      running[rid] = [p, f, off, need(f)]
      waiting.popleft()
    if not running:
      break
    cat = collections.Counter()
    for rid, (c, f, off, size) in running.items():
      for k in range(size):
        cat["token_utilization" if k < c else "reservation" if k < f
            else "internal_fragmentation"] += 1
    free = int((owner == -1).sum())
    ext = 0
    for _, _, f in waiting:              # what a compacting allocator would admit
      if ext + need(f) > free:
        break
      ext += need(f)
    cat["external_fragmentation"] += ext
    cat["free"] += free - ext
    steps += 1
    peak = max(peak, len(running))
    if waiting:
      sat_steps += 1
      sat_running += len(running)
      sums.update(cat)
  keys = ["token_utilization", "reservation", "internal_fragmentation",
          "external_fragmentation", "free"]
  out = {k: sums[k] / (budget * sat_steps) for k in keys}
  out.update(max_concurrent=peak, mean_concurrent=sat_running / sat_steps, steps=steps,
             saturated_steps=sat_steps)
  return out


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
@pytest.mark.parametrize("seed", [0, 1])
def test_orca_simulation_matches_brute_force(policy, seed):
  rng = np.random.default_rng(seed)
  max_len, budget = 48, 150
  reqs = []
  for i in range(40):
    p = int(rng.integers(1, 30))
    reqs.append((i, p, int(rng.integers(1, max_len - p + 1))))   # (id, prompt, output)
  got = simulate.simulate_orca(reqs, policy, budget, max_len)
  want = _brute_force_orca([(i, p, p + o) for i, p, o in reqs], policy, budget, max_len)
  for key, value in want.items():
    assert got[key] == pytest.approx(value, abs=1e-12), key
  total = sum(got[k] for k in ("token_utilization", "reservation", "internal_fragmentation",
                               "external_fragmentation", "free"))
  assert total == pytest.approx(1.0, abs=1e-12)
  if policy != "max":
    assert got["external_fragmentation"] > 0   # holes really block admissions here


def test_orca_simulation_rejects_bad_inputs():
  with pytest.raises(ValueError, match=r"kv_budget_tokens must be >= \d+, got"):
    simulate.simulate_orca([(0, 3, 4)], "max", 16, 32)
  with pytest.raises(ValueError, match="request 0"):
    simulate.simulate_orca([(0, 30, 4)], "max", 64, 32)


def test_sharing_savings_counts_forked_blocks_once():
  import jax.numpy as jnp
  from paged_jax import block_manager
  from paged_jax.config import CacheConfig
  from paged_jax.bench.memory import sharing_savings
  rng = np.random.default_rng(5)
  cfg = CacheConfig(block_size=4, num_blocks=64, max_seqs=6, max_blocks_per_seq=8)
  state = block_manager.init(cfg)
  prompt = int(rng.integers(5, 20))
  state, status = block_manager.allocate(state, jnp.int32(0), jnp.int32(prompt))
  assert int(status) == 0
  for dst in (1, 2, 3):   # three forks share every block of slot 0
    state, status = block_manager.fork(state, jnp.int32(0), jnp.int32(dst))
    assert int(status) == 0
  mask = jnp.zeros(6, bool).at[jnp.array([1, 2])].set(True)
  state, status, _ = block_manager.append(state, mask, 3)   # two writers diverge
  assert (np.asarray(status) == 0).all()
  s = sharing_savings(state)
  blocks = lambda n: -(-n // 4)
  # Independent count: distinct block ids referenced by any table row.
  tables = np.asarray(state.block_tables)
  distinct = len(set(tables[tables >= 0].tolist()))
  unshared = 2 * blocks(prompt) + 2 * blocks(prompt + 3)
  assert s["unshared_blocks"] == unshared and s["used_blocks"] == distinct
  assert s["savings"] == pytest.approx(1 - distinct / unshared)
  assert 0 < s["savings"] < 1


# ----------------------------------------------------------------------------- block tables
def test_block_table_stats_against_counting():
  rng = np.random.default_rng(102)
  reqs = workloads.alpaca(50, seed=int(rng.integers(1 << 30)), max_len=512)
  for bs in (1, 4, 16, 256):
    stats = memory.block_table_stats(reqs, bs, 512)
    blocks = []
    for r in reqs:
      n, held = r.total_len, 0
      while held * bs < n:   # grow one block at a time, as the block manager does
        held += 1
      blocks.append(held)
    assert stats["mean_blocks_per_seq"] == pytest.approx(np.mean(blocks))
    assert stats["block_table_width"] == math.ceil(512 / bs)


def test_simulate_allocators_is_each_simulation_of_the_stream():
  reqs = workloads.alpaca(40, seed=7, max_len=128)
  got = simulate.simulate_allocators(reqs, ("orca_oracle", "paged"), block_size=8,
                                     kv_budget_tokens=512, max_len=128)
  assert list(got) == ["orca_oracle", "paged"]
  assert got["orca_oracle"] == simulate.simulate_orca(reqs, "oracle", 512, 128)
  assert got["paged"] == simulate.simulate_paged(reqs, 8, 512, 128)
  with pytest.raises(ValueError, match="allocator must be"):
    simulate.simulate_allocators(reqs, ("fifo",), block_size=8, kv_budget_tokens=512,
                                 max_len=128)
