"""Scheduling policies through the Engine (`Engine(scheduling_policy=...)`,
`add_request(..., priority=)`): the order requests get their first token follows the
policy on a pool that holds one request at a time, outputs stay those of the dense oracle
under preemption, and bad policies or priorities are one-line errors before anything is
queued."""

import pytest

from paged_jax.engine import EngineOptions, SamplingParams

from engine_oracle import PARAMS, dense_greedy, greedy, oracle_engine, random_prompts


def first_token_order(engine):
  order = []
  while engine.has_unfinished():
    engine.step()
    order += [i for i in engine.last_step.first_token_ids if i not in order]
  return order


@pytest.mark.parametrize("policy, want", [
    ("fcfs", [1, 2, 3]),
    ("priority", [3, 1, 2]),                          # lower value first
    (lambda r: -r.prompt_len, [2, 3, 1]),             # longest prompt first
], ids=["fcfs", "priority", "key"])
def test_requests_start_in_the_policy_order(policy, want):
  # One slot: each request runs alone, so first tokens come in admission order.
  engine = oracle_engine(block_size=4, num_blocks=32, max_seqs=1, budget=32,
                         scheduling_policy=policy)
  prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14]]
  engine.add_request(prompts[0], greedy(3), priority=5)
  engine.step()                # request 0 runs (and holds the one slot) from here
  for p, prio in zip(prompts[1:], (2, 3, 0)):
    engine.add_request(p, greedy(3), priority=prio)
  assert first_token_order(engine) == want


def test_priority_under_preemption_keeps_outputs_exact():
  # 12 blocks of 4 tokens for 6 requests that each grow to ~5 blocks: the pool runs out,
  # the running request of the largest (priority, arrival) is preempted each time.
  prompts = random_prompts(21, 6, lo=6, hi=12)
  engine = oracle_engine(block_size=4, num_blocks=12, max_seqs=4, budget=16,
                         scheduling_policy="priority")
  ids = [engine.add_request(p, greedy(10), priority=prio)
         for p, prio in zip(prompts, (2, 0, 1, 0, 2, 1))]
  outs = {}
  while engine.has_unfinished():
    for o in engine.step():
      outs[o.request_id] = o
  assert engine.num_preemptions > 0
  for i, p in zip(ids, prompts):
    assert outs[i].outputs[0] == dense_greedy(PARAMS, p, 10)


@pytest.mark.parametrize("bad", ["shortest", 7])
def test_a_bad_policy_is_a_one_line_error_naming_it(bad):
  with pytest.raises(ValueError, match="scheduling_policy") as e:
    EngineOptions(scheduling_policy=bad)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [1.5, True, "1", 2**40])
def test_a_bad_priority_is_refused_before_anything_is_queued(bad):
  engine = oracle_engine(block_size=4, num_blocks=12, max_seqs=2, budget=8,
                         scheduling_policy="priority")
  with pytest.raises(ValueError, match="priority") as e:
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority=bad)
  assert "\n" not in str(e.value) and not engine.has_unfinished()
