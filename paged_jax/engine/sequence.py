"""The scheduler's records: a request (`Group`) and its token streams (`Sequence`), what
one step runs (`Chunk`s gathered in a `Batch`, the plan) and the counts the last step
reported (`DeviceCounts`). Plain host-side dataclasses; the device's copy of a sequence
is its block-table slot (`Sequence.slot`).

Vocabulary:
  Sequence  one token stream (prompt + generated) owning one block-table slot.
  Group     one request: 1 sequence, or n parallel samples, or beam_width beams.
            A group reserves `slots_needed` slots at admission.
  Chunk     the tokens of one sequence computed in a step (a prefill chunk or
            one decode token), from `Chunk.start`; it samples when it reaches the
            sequence's last known token.

Who writes them: `Scheduler.update` (scheduler.py), and nothing else once a request is
queued. `schedule()` reads them and returns a `Batch` that says what the step will do
(which slots it gives an admitted group, which groups it preempts), so a plan that never
runs changes nothing; `update(batch, outputs)` applies the plan and the step's outputs
together, and commits at once (`commit.Changes`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Tuple

import numpy as np


class GroupStatus(enum.Enum):
  """Which queue a request is in."""
  WAITING = "waiting"
  RUNNING = "running"
  SWAPPED = "swapped"
  FINISHED = "finished"


class SeqState(enum.Enum):
  """A sequence's life, as its device row stands (one state, not a set of flags).

  WAITING   no device row: prefills (or recomputes) its tokens from 0 once admitted.
  FORKING   no device row yet: gets one by a device fork of another sequence's row
            (n > 1 samples from the leader once its prompt is in; a new beam from
            its parent in the next step).
  RUNNING   its slot's row is active on the device, holding `num_computed` tokens.
  SWAPPED   its row's K/V is in host memory (`Group.swapped_kv`), slot given back.
  FINISHED  done (stop id, max_tokens, beam search over, abort).
  """
  WAITING = "waiting"
  FORKING = "forking"
  RUNNING = "running"
  SWAPPED = "swapped"
  FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
  """One token stream. `tokens` = prompt + generated (the last may be uncomputed).

  Attributes:
    seq_id, index (position in the request's outputs), sample_seed (seed of its
      sampling stream), prompt_len: fixed once queued.
    tokens: prompt + generated ids; only ever appended to.
    num_computed: tokens whose K/V are in its device row (the device's seq_len).
    slot: its block-table row (-1: none).
    state: SeqState.
    share_id: >= 0 when its partial last block is shared with the other sequences of
      the same share_id (copy-on-write on their next writes); -1 otherwise.
    cum_logprob: beam score.
    logprobs: per generated token, its log-probability under the model (not beams).
    top_logprobs: per generated token, its position's best (id, log-prob) pairs
      (`SamplingParams.logprobs` of them; empty tuples when 0).
    topk: beam search only: (log-probs, ids) of its next-token candidates, awaiting
      the group's selection (the step sampled it; its siblings may sample later).
    finish_reason: "stop", "length" or "abort" once finished.
    spec_misses / spec_retry_at: speculative decoding's back-off: drafts in a row that
      gained nothing (none accepted), and the generated-token count before which the
      sequence drafts no more (2**misses tokens after the last miss, at most 64).
  """
  seq_id: int
  index: int
  sample_seed: int
  tokens: List[int]
  prompt_len: int
  num_computed: int = 0
  slot: int = -1
  state: SeqState = SeqState.WAITING
  share_id: int = -1
  cum_logprob: float = 0.0
  topk: Optional[Tuple[Any, Any]] = None
  logprobs: List[float] = dataclasses.field(default_factory=list)
  top_logprobs: List[tuple] = dataclasses.field(default_factory=list)
  finish_reason: Optional[str] = None
  spec_misses: int = 0
  spec_retry_at: int = 0

  @property
  def num_generated(self) -> int:
    return len(self.tokens) - self.prompt_len

  @property
  def num_uncomputed(self) -> int:
    return len(self.tokens) - self.num_computed

  @property
  def on_device(self) -> bool:
    return self.state is SeqState.RUNNING


@dataclasses.dataclass(eq=False)
class Group:
  """One request and its live sequences.

  Attributes:
    request_id, arrival (queue order), params (SamplingParams), prompt, priority
      (lower first under the "priority" policy), slots_needed: fixed once queued.
    sort_key: its place in the queues under the engine's scheduling policy
      (`policy.py`; ties broken by arrival), fixed once queued.
    seqs: live (unfinished) sequences; seqs[0] leads. finished: finished ones.
    slots: the slots it holds while running. status: its queue.
    num_preemptions: times it was preempted.
    swapped_kv: while SWAPPED, the host copy of its sequences' pages (`swap.SwappedKV`).
    prompt_scores: with `SamplingParams.prompt_logprobs`, per prompt position i, None
      until computed, then (log p(prompt[i] | prompt[:i]), best (id, log-prob) pairs);
      position 0 stays None. None without.
  """
  request_id: Any
  arrival: int
  params: Any
  prompt: List[int]
  seqs: List[Sequence]
  slots_needed: int
  priority: int = 0
  sort_key: Any = None
  finished: List[Sequence] = dataclasses.field(default_factory=list)
  slots: List[int] = dataclasses.field(default_factory=list)
  status: GroupStatus = GroupStatus.WAITING
  num_preemptions: int = 0
  swapped_kv: Any = None
  prompt_scores: Optional[tuple] = None

  @property
  def is_beam(self) -> bool:
    return self.params.beam_width > 1

  @property
  def leader(self) -> Sequence:
    return self.seqs[0]

  @property
  def prompt_len(self) -> int:
    return len(self.prompt)


@dataclasses.dataclass
class Chunk:
  """`num_tokens` tokens of `seq` from position `start`, computed in slot `slot`."""
  seq: Sequence
  num_tokens: int
  samples: bool                 # the chunk ends at the last known token
  allocate: bool                # the slot is not yet active on device
  start: int = 0
  slot: int = -1
  draft: Tuple[int, ...] = ()   # speculative decoding: proposed tokens after the chunk

  @property
  def end(self) -> int:
    return self.start + self.num_tokens

  @property
  def num_scheduled(self) -> int:
    """Tokens the step computes for this chunk: its own and its drafts."""
    return self.num_tokens + len(self.draft)


@dataclasses.dataclass
class Batch:
  """The plan of one step: everything it will do, built by `schedule()` from the
  scheduler's records and what the last update carried over (`Scheduler.carry`: beam
  forks, frees of dropped beams, a swap-out after a failed step), and applied, with the
  step's outputs, by `update(batch, outputs)`. The order of its device effects is
  written once, in step.py's docstring; the engine runs the swap copies around the
  jitted call.

  Attributes:
    chunks: what each sequence computes.
    frees: slots the step frees (preempted, dropped, finished on the host, aborted).
    forks: (parent, child) beam forks, run before the reservations.
    post_forks: (leader, child): n > 1 samples forked from the leader after its prompt.
    admitted / swapped_in: groups taken from the waiting / swapped queue, with the
      slots the plan gives them (`slot_of`).
    preempted: groups the plan preempts (their slots are in `frees`); those in
      `swap_out` go to host memory first, the others are recomputed later.
    swap_out: group -> the slots its rows are copied from (to host memory, before the
      step frees them): this plan's preempted groups, or a carried one's.
    aborted: requests stopped by `Engine.abort` (their slots are in `frees`).
    attaches / attach_lens: prefix-cache lookups of admitted leaders, tokens each.
    slot_of: the slot of every sequence this plan gives one.
    group_slots: the slots this plan gives each admitted or swapped-in group (all
      `slots_needed` of them: a beam search holds its beams' slots from the start).
    swapped_out: filled by the engine before the dispatch: group -> its host copy.
    bucket: filled by the engine: the compiled shape the step runs on.
    reset_prefix: the engine dropped every cached block (`Engine.reset_prefix_cache`).
  """
  chunks: List[Chunk] = dataclasses.field(default_factory=list)
  frees: List[int] = dataclasses.field(default_factory=list)
  forks: List[Tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)
  post_forks: List[Tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)
  admitted: List[Group] = dataclasses.field(default_factory=list)
  swapped_in: List[Group] = dataclasses.field(default_factory=list)
  preempted: List[Group] = dataclasses.field(default_factory=list)
  swap_out: Dict[Group, List[int]] = dataclasses.field(default_factory=dict)
  aborted: List[Group] = dataclasses.field(default_factory=list)
  attaches: List[Sequence] = dataclasses.field(default_factory=list)
  attach_lens: List[int] = dataclasses.field(default_factory=list)
  slot_of: Dict[Sequence, int] = dataclasses.field(default_factory=dict)
  group_slots: Dict[Group, List[int]] = dataclasses.field(default_factory=dict)
  swapped_out: Dict[Group, Any] = dataclasses.field(default_factory=dict)
  bucket: Any = None
  reset_prefix: bool = False

  @property
  def num_tokens(self) -> int:
    """Tokens the step computes (drafts included)."""
    return sum(c.num_scheduled for c in self.chunks)

  def slot(self, seq: Sequence) -> int:
    """The slot `seq` runs in during this step."""
    return self.slot_of.get(seq, seq.slot)

  @property
  def runs_nothing(self) -> bool:
    """No device work: no chunk, free, fork, prefix attach or swap-in."""
    return not (self.chunks or self.frees or self.forks or self.attaches or self.swapped_in)


@dataclasses.dataclass(frozen=True)
class DeviceCounts:
  """What the last step reported, to plan the next one by (`StepOutputs`' counts).

  Attributes:
    num_free: blocks on the free stack.
    available: free plus evictable (cached, unreferenced) blocks: what a plan may use.
    num_evictable: cached blocks no sequence references.
    prefix_hit_blocks / prefix_query_blocks: running totals of the prefix cache.
    sole_blocks: i32[max_seqs], blocks only that slot references (what freeing it
      alone makes available).
    sliding_free: free blocks of the hybrid-KV sliding pool (0 without hybrid KV; not
      planned with: that pool is sized never to run short).
  """
  num_free: int
  available: int
  num_evictable: int = 0
  prefix_hit_blocks: int = 0
  prefix_query_blocks: int = 0
  sole_blocks: Any = None
  sliding_free: int = 0

  @classmethod
  def empty_pool(cls, num_blocks: int, max_seqs: int,
                 num_sliding_blocks: int = 0) -> "DeviceCounts":
    return cls(num_blocks, num_blocks, sole_blocks=np.zeros((max_seqs,), np.int32),
               sliding_free=num_sliding_blocks)

  @classmethod
  def of(cls, outputs) -> "DeviceCounts":
    """From a step's outputs on the host (numpy)."""
    return cls(**{f.name: int(getattr(outputs, f.name)) for f in dataclasses.fields(cls)
                  if f.name != "sole_blocks"}, sole_blocks=np.asarray(outputs.sole_blocks))
