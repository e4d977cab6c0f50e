"""Host scheduler alone (`schedule()` and `update()`), against a simulated device that
holds cdiv(len, bs) blocks per active slot and frees a slot when its sequence finishes
(as the jitted step does): token budget, chunked prefill mixed with decodes, strict
FCFS, newest-first preemption (recompute and swap), and that it never over-commits."""

import collections
import types

import numpy as np
import pytest

from paged_jax.config import cdiv
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine import block_needs
from paged_jax.engine.sequence import Chunk, Group, GroupStatus, SeqState, Sequence


class FakeDevice:
  """Blocks held per active slot (no sharing: single-sequence requests only)."""

  def __init__(self, num_blocks, block_size):
    self.num_blocks, self.bs, self.lens = num_blocks, block_size, {}

  def free(self):
    return self.num_blocks - sum(cdiv(n, self.bs) for n in self.lens.values())

  def sole(self):
    """Blocks each slot alone holds, by slot (no sharing here: all of its blocks)."""
    return collections.defaultdict(int, {s: cdiv(n, self.bs) for s, n in self.lens.items()})


def make_group(i, prompt_len, max_tokens):
  sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
  seq = Sequence(seq_id=i, index=0, sample_seed=0, tokens=list(range(prompt_len)),
                 prompt_len=prompt_len)
  return Group(request_id=i, arrival=i, params=sp, prompt=list(range(prompt_len)), seqs=[seq],
               slots_needed=1)


def copy_out(batch, dev):
  """What the engine's copy of a swapped-out group reports: its blocks."""
  for group in batch.swap_out:
    batch.swapped_out[group] = types.SimpleNamespace(
        num_blocks=sum(cdiv(q.num_computed, dev.bs) for q in group.seqs), nbytes=0)


def run_step(sched, dev, log, report_sole=True, batch=None, fail=False):
  """One step of `batch` (default: the next plan) on the fake device; `fail`: its
  reservations fail (frees and forks stand, nothing else runs)."""
  sole = dev.sole() if report_sole else None
  running_before = sorted(sched.running, key=lambda g: g.sort_key)
  waiting_before = list(sched.waiting)
  planned = batch is None
  if planned:
    batch = sched.schedule(dev.free(), sole)
  if report_sole and planned and not fail:
    # With the freed slots' blocks reported, a shortage preempts the newest groups
    # and the step still serves every group left running, token budget permitting.
    served = {c.seq for c in batch.chunks}
    idle = [g for g in sched.running if g not in batch.preempted
            and any(q.num_uncomputed > 0 and q not in served for q in g.seqs)]
    assert not idle or batch.num_tokens == sched.max_num_batched_tokens, (
        f"requests {[g.request_id for g in idle]} sat out a step with budget left")
  copy_out(batch, dev)
  # As the engine does: swap-ins copy in first (their own dispatch), then the step
  # frees, then it reserves.
  for group in batch.swapped_in:
    for seq in group.seqs:
      assert seq.state is SeqState.SWAPPED and seq.num_computed > 0
      dev.lens[batch.slot(seq)] = seq.num_computed
  assert dev.free() >= 0, "a swap-in was planned on blocks that only the step frees"
  for slot in batch.frees:
    del dev.lens[slot]
  s = sched.max_seqs
  out = types.SimpleNamespace(
      ok=not fail, tokens=np.zeros((1, s), np.int32), valid=np.zeros((1, s), bool),
      logprobs=np.zeros((1, s), np.float32),
      finished=np.zeros((s,), bool), hit_tokens=np.zeros((s,), np.int32),
      loop_out_of_blocks=False, prefix_hit_blocks=0, prefix_query_blocks=0, num_evictable=0,
      sliding_free=0, prompt_pos=np.zeros((0,), np.int32))   # no step scores a prompt
  if not fail:
    for ch in batch.chunks:
      assert ch.allocate == (ch.slot not in dev.lens)
      dev.lens[ch.slot] = ch.end
    assert dev.free() >= 0, "scheduler over-committed blocks"
    assert batch.num_tokens <= sched.max_num_batched_tokens
    # Every sampling chunk draws token 7; a sequence at max_tokens finishes and the
    # device frees its slot in the same step.
    groups = sched.running + batch.admitted + batch.swapped_in
    for ch in batch.chunks:
      if ch.samples:
        q = ch.seq
        out.tokens[0, ch.slot], out.valid[0, ch.slot] = 7, True
        group = next(g for g in groups if q in g.seqs)
        out.finished[ch.slot] = q.num_generated + 1 >= group.params.max_tokens
    for slot in np.flatnonzero(out.finished):
      del dev.lens[slot]
  out.num_free = out.available = dev.free()
  out.sole_blocks = np.array([dev.sole()[i] for i in range(s)], np.int32)
  sched.update(batch, out)
  log.append((batch, running_before, waiting_before))
  return batch


def drain(sched, dev, groups, max_steps=500, report_sole=True):
  log = []
  for g in groups:
    sched.add(g)
  for _ in range(max_steps):
    if not sched.has_unfinished():
      break
    run_step(sched, dev, log, report_sole)
  assert not sched.has_unfinished()
  for slot in sched.carry.frees:
    del dev.lens[slot]
  assert all(g.status == GroupStatus.FINISHED for g in groups)
  return [b for b, _, _ in log], log


def test_chunked_prefill_budget_and_mixing_with_decodes():
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=8)
  dev = FakeDevice(64, 4)
  groups = [make_group(0, 3, 6), make_group(1, 21, 3)]
  log, _ = drain(sched, dev, groups)
  # Step 0: all of prompt 0 (3) + the first 5 of prompt 1; then decodes of 0 mixed
  # with 7-token chunks of prompt 1, until it is done.
  first = log[0]
  assert [(c.seq.seq_id, c.num_tokens) for c in first.chunks] == [(0, 3), (1, 5)]
  assert [(c.seq.seq_id, c.num_tokens, c.samples) for c in log[1].chunks] == [
      (0, 1, True), (1, 7, False)]
  long_chunks = [c.num_tokens for b in log for c in b.chunks if c.seq.seq_id == 1]
  assert long_chunks[:4] == [5, 7, 7, 2] and set(long_chunks[4:]) == {1}
  assert all(b.num_tokens <= 8 for b in log)
  assert dev.free() == 64


def test_strict_fcfs_admission_by_free_blocks():
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=64)
  dev = FakeDevice(10, 4)
  groups = [make_group(0, 16, 8), make_group(1, 30, 2), make_group(2, 2, 2)]
  for g in groups:
    sched.add(g)
  log = []
  batch = run_step(sched, dev, log)
  # Request 1 needs 8 blocks, only 6 are free: request 2 (1 block) must not overtake it.
  assert [c.seq.seq_id for c in batch.chunks] == [0]
  admitted = []
  while sched.has_unfinished():
    batch = run_step(sched, dev, log)
    admitted += [c.seq.seq_id for c in batch.chunks if c.allocate]
  assert admitted == [1, 2]


@pytest.mark.parametrize("report_sole", [True, False], ids=["sole_blocks", "no_counts"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_newest_first_and_everything_completes(mode, seed, report_sole):
  rng = np.random.default_rng(seed)
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=16, preemption_mode=mode)
  dev = FakeDevice(12, 4)
  groups = [make_group(i, int(rng.integers(4, 14)), int(rng.integers(8, 20))) for i in range(6)]
  log, steps = drain(sched, dev, groups, report_sole=report_sole)
  victims = [(b.preempted, running) for b, running, _ in steps if b.preempted]
  assert victims, "the budget was meant to force preemption"
  for preempted, running in victims:       # newest running groups first, in turn
    assert preempted == running[::-1][:len(preempted)]
  assert sum(len(g.finished[0].tokens) - g.finished[0].prompt_len for g in groups) == sum(
      g.params.max_tokens for g in groups)
  assert dev.free() == 12
  if mode == "swap":
    assert sched.num_swaps > 0
    assert any(b.swapped_in for b in log)   # run_step checks each comes back computed
  else:   # "auto" recomputes single-sequence groups, as vLLM V0 does
    assert sched.num_swaps == 0
    assert any(c.allocate and c.seq.num_generated > 0 for b in log for c in b.chunks), (
        "a recomputed request re-prefills prompt + generated tokens")


def _two_groups_after_one_step(max_tokens):
  """A swap-mode scheduler on a 32-block fake device, two groups run for one step."""
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=16,
                    preemption_mode="swap")
  dev = FakeDevice(32, 4)
  groups = [make_group(0, 6, max_tokens), make_group(1, 5, max_tokens)]
  for g in groups:
    sched.add(g)
  log = []
  run_step(sched, dev, log)
  return sched, dev, groups, log


def test_a_group_swapped_after_a_failed_step_returns_once_copied():
  # The engine's path after a device OUT_OF_BLOCKS: update swaps the newest group out
  # outside any plan; its copy is made for the NEXT step (before that step frees its
  # slot), so that plan must not bring it back, and a later one does.
  sched, dev, groups, log = _two_groups_after_one_step(max_tokens=4)
  run_step(sched, dev, log, fail=True)
  victim = groups[1]
  assert victim.status == GroupStatus.SWAPPED and victim.swapped_kv is None
  assert list(sched.carry.swap_out) == [victim]
  batch = run_step(sched, dev, log)
  assert not batch.swapped_in and victim.swapped_kv is not None
  batch = run_step(sched, dev, log)
  assert batch.swapped_in == [victim]
  drain(sched, dev, [], max_steps=50)


def test_the_plan_after_a_failed_step_serves_only_the_running_groups():
  # After a device OUT_OF_BLOCKS the counts still show the room the failed plan trusted:
  # the retry swaps nothing in and admits nothing (else it can bring the shortage
  # straight back, every step); the plan after it does both.
  sched, dev, groups, log = _two_groups_after_one_step(max_tokens=8)
  run_step(sched, dev, log, fail=True)
  victim = groups[1]
  late = make_group(2, 3, 4)
  sched.add(late)
  run_step(sched, dev, log, batch=sched.carried())   # the engine's flush: copy out, frees
  assert victim.status == GroupStatus.SWAPPED and victim.swapped_kv is not None
  batch = run_step(sched, dev, log)
  assert not batch.swapped_in and not batch.preempted and not batch.admitted
  assert {c.seq for c in batch.chunks} == {groups[0].leader}
  assert late.status == GroupStatus.WAITING
  batch = run_step(sched, dev, log)
  assert batch.swapped_in == [victim] and late in sched.running
  drain(sched, dev, [], max_steps=50)


def test_bad_preemption_mode():
  with pytest.raises(ValueError, match="preemption_mode"):
    Scheduler(block_size=4, max_seqs=2, max_num_batched_tokens=8, preemption_mode="drop")


def preempted_samples_group(i, prompt_len, generated, n):
  """An n-sample group as recompute preemption leaves it: every sample keeps its
  tokens, none is computed, the children wait to fork from the leader's prompt."""
  sp = SamplingParams(max_tokens=generated + 4, temperature=1.0, n=n)
  seqs = [Sequence(seq_id=10 * i + j, index=j, sample_seed=j,
                   tokens=list(range(prompt_len)) + [5] * generated, prompt_len=prompt_len,
                   state=SeqState.FORKING if j else SeqState.WAITING) for j in range(n)]
  return Group(request_id=i, arrival=i, params=sp, prompt=list(range(prompt_len)), seqs=seqs,
               slots_needed=n)


def test_group_need_counts_every_sample():
  sched = Scheduler(block_size=4, max_seqs=8, max_num_batched_tokens=64)
  # Fresh: the prompt (6 tokens) has one full block, shared, and each of the 4
  # sequences ends up with its own copy of the partial block: 1 + 4.
  assert sched.group_need(preempted_samples_group(0, 6, 0, 4)) == 5
  # Recomputed: 15 tokens per sample = the shared block + 3 blocks of its own each.
  assert sched.group_need(preempted_samples_group(0, 6, 9, 4)) == 1 + 4 * 3
  assert sched.group_need(make_group(0, 15, 4)) == 4      # one sequence: its length


@pytest.mark.parametrize("free,admitted", [(12, []), (13, [0])])
def test_recomputed_sample_group_waits_for_all_its_blocks(free, admitted):
  """A preempted n = 4 group is not readmitted on its leader's 4 blocks: its samples
  recompute too (13 blocks), and a later single-sequence group does not overtake it."""
  sched = Scheduler(block_size=4, max_seqs=8, max_num_batched_tokens=64)
  sched.add(preempted_samples_group(0, 6, 9, 4))
  sched.add(make_group(1, 3, 2))
  batch = sched.schedule(free, collections.defaultdict(int))
  assert sorted({c.seq.seq_id // 10 for c in batch.chunks if c.allocate}) == admitted
  assert [g.request_id for g in batch.admitted] == admitted


def test_admission_holds_the_blocks_a_group_takes_after_this_step():
  """A fresh n = 4 group with a 6-token prompt prefills 2 blocks this step, but its
  samples' first decode copies the shared partial block for each (5 in all): on 5
  free blocks, a later 1-block request waits rather than take one of those."""
  sched = Scheduler(block_size=4, max_seqs=8, max_num_batched_tokens=64)
  sched.add(preempted_samples_group(0, 6, 0, 4))
  sched.add(make_group(1, 3, 2))
  batch = sched.schedule(5, collections.defaultdict(int))
  assert [(c.seq.seq_id, c.num_tokens) for c in batch.chunks] == [(0, 6)]
  assert [g.request_id for g in batch.admitted] == [0]


@pytest.mark.parametrize("lookahead,free,preempted", [(7, 3, [1]), (7, 4, []), (0, 1, [])])
def test_multi_step_decode_reserves_its_loop_blocks(lookahead, free, preempted):
  """With 8 decode steps per sync (lookahead 7) a decoding row appends up to 7 more
  tokens in the step's decode loop, and the step reserves their blocks (block size 4):
    request 0: 14 of 15 tokens computed; its token 15 takes no new block, its loop
      up to 22 tokens takes 2;
    request 1 (newer): 4 of 5 computed; token 5 takes 1 block, its loop up to 12
      tokens 1 more.
  On 3 free blocks request 0 takes 2 and request 1, the newest, is preempted rather
  than let a loop run out of blocks; on 4 both run. One decode step per sync needs 1."""
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=16, lookahead=lookahead)
  for i, computed in enumerate([14, 4]):
    g = make_group(i, 3, 40)
    g.seqs[0].tokens = list(range(computed + 1))
    g.seqs[0].num_computed, g.seqs[0].slot, g.seqs[0].state = computed, i, SeqState.RUNNING
    g.slots, g.status, g.sort_key = [i], GroupStatus.RUNNING, (i, i)
    sched.running.append(g)
  needs = [block_needs.lookahead_need(
      g, [Chunk(g.leader, 1, samples=True, allocate=False, start=g.leader.num_computed)],
      4, lookahead) for g in sched.running]
  assert needs == ([2, 1] if lookahead else [0, 0])
  batch = sched.schedule(free, collections.defaultdict(int, {0: 4, 1: 1}))
  assert [g.request_id for g in batch.preempted] == preempted


@pytest.mark.parametrize("lookahead,max_tokens,budget,free,admitted", [
    (7, 40, 16, 3, False),   # 2 prompt blocks + 2 for the loop's tokens 9..15
    (7, 40, 16, 4, True),
    (7, 3, 16, 3, True),     # the loop stops at max_tokens: tokens 9..10, 1 block
    (7, 40, 5, 2, True),     # a 5-token chunk of the prompt does not sample: no loop
    (0, 40, 16, 2, True),    # one decode step per sync: the prompt's blocks only
])
def test_admission_reserves_the_decode_loop_of_a_sampling_prompt(
    lookahead, max_tokens, budget, free, admitted):
  """An 8-token prompt (block size 4) admitted whole samples its first token in this
  step, and with a lookahead the decode loop goes on to append up to `lookahead` more:
  admission holds those blocks as step 1 does for running rows, or waits."""
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=budget,
                    lookahead=lookahead)
  sched.add(make_group(0, 8, max_tokens))
  batch = sched.schedule(free, collections.defaultdict(int))
  assert bool(batch.chunks) == admitted
  assert [g.request_id for g in batch.admitted] == ([0] if admitted else [])


# ---- scheduling policies -----------------------------------------------------------------

def shortest_prompt(request):
  return request.prompt_len


@pytest.mark.parametrize("policy", ["fcfs", "priority", shortest_prompt],
                         ids=["fcfs", "priority", "key"])
@pytest.mark.parametrize("seed", [0, 1])
def test_policies_admit_in_key_order_and_preempt_the_largest_keys(policy, seed):
  """Whatever the policy, each plan admits a prefix of the waiting queue in key order
  (no later key overtakes a waiting head), preempts the running groups of the largest
  keys, and every request completes; the keys are the policy's (checked against a
  plain recomputation from each request's attributes)."""
  rng = np.random.default_rng(seed)
  sched = Scheduler(block_size=4, max_seqs=4, max_num_batched_tokens=16,
                    preemption_mode="recompute", policy=policy)
  dev = FakeDevice(12, 4)
  groups = [make_group(i, int(rng.integers(2, 14)), int(rng.integers(6, 20))) for i in range(8)]
  for g in groups:
    g.priority = int(rng.integers(0, 3))
  key = {"fcfs": lambda g: g.arrival, "priority": lambda g: (g.priority, g.arrival),
         }.get(policy, lambda g: g.prompt_len) if isinstance(policy, str) else shortest_prompt
  _, steps = drain(sched, dev, groups)
  for g in groups:
    assert g.sort_key == (key(g), g.arrival)
  preempting = 0
  for batch, running, waiting in steps:
    assert batch.admitted == waiting[:len(batch.admitted)]
    assert [g.sort_key for g in waiting] == sorted(g.sort_key for g in waiting)
    assert batch.preempted == running[::-1][:len(batch.preempted)]
    preempting += bool(batch.preempted)
  assert preempting, "the pool was meant to force preemption"
  assert [len(g.finished[0].tokens) - g.finished[0].prompt_len for g in groups] == [
      g.params.max_tokens for g in groups]


def test_priority_serves_a_later_urgent_request_first():
  """Under "priority" a request queued last with a lower priority value is admitted
  before the earlier ones it outranks; under "fcfs" it waits its turn."""
  orders = {}
  for policy in ("fcfs", "priority"):
    sched = Scheduler(block_size=4, max_seqs=1, max_num_batched_tokens=64, policy=policy)
    dev = FakeDevice(64, 4)
    groups = [make_group(i, 4, 2) for i in range(3)]
    groups[2].priority = -1
    _, steps = drain(sched, dev, groups)
    orders[policy] = [g.request_id for b, _, _ in steps for g in b.admitted]
  assert orders == {"fcfs": [0, 1, 2], "priority": [2, 0, 1]}


@pytest.mark.parametrize("policy", ["lifo", 3, None])
def test_a_bad_policy_is_a_one_line_error(policy):
  with pytest.raises(ValueError, match="scheduling_policy") as e:
    Scheduler(block_size=4, max_seqs=2, max_num_batched_tokens=8, policy=policy)
  assert "\n" not in str(e.value)


def test_a_key_that_fails_or_cannot_order_is_refused_when_queued():
  sched = Scheduler(block_size=4, max_seqs=2, max_num_batched_tokens=8,
                    policy=lambda r: r.params.nonexistent)
  with pytest.raises(ValueError, match="scheduling_policy key failed on request 0"):
    sched.add(make_group(0, 3, 2))
  assert not sched.waiting and not sched.groups
  mixed = Scheduler(block_size=4, max_seqs=2, max_num_batched_tokens=8,
                    policy=lambda r: "a" if r.arrival else 1)
  mixed.add(make_group(0, 3, 2))
  with pytest.raises(ValueError, match="scheduling_policy"):
    mixed.add(make_group(1, 3, 2))
  assert [g.request_id for g in mixed.waiting] == [0]
