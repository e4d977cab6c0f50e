"""The scheduler's records: a request (`Group`) and its token streams (`Sequence`), what
one step runs (`Chunk`s gathered in a `Batch`, the plan) and the counts the last step
reported (`DeviceCounts`). Plain host-side dataclasses; the device's copy of a sequence
is its block-table slot (`Sequence.slot`).

Vocabulary:
  Sequence  one token stream (prompt + generated) owning one block-table slot.
  Group     one request: 1 sequence, or n parallel samples, or beam_width beams.
            A group reserves `slots_needed` slots at admission.
  Chunk     the tokens of one sequence computed in a step (a prefill chunk or
            one decode token). A sequence's uncomputed tokens are
            `tokens[num_computed:]`; it samples when its chunk reaches the end.

Field metadata for the undo of an interrupted step (`snapshot.Snapshot`, which restores
every field of these records): FIXED fields are set before a request's first step and
never change after (not saved); APPEND_ONLY lists only grow during a step (saved by
length). Every other field is saved and restored whole.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

FIXED = {"fixed": True}
APPEND_ONLY = {"append_only": True}


class GroupStatus(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  SWAPPED = "swapped"
  FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
  """One token stream. `tokens` = prompt + generated (the last may be uncomputed)."""
  seq_id: int = dataclasses.field(metadata=FIXED)
  index: int = dataclasses.field(metadata=FIXED)   # position in the outputs (sample j)
  sample_seed: int = dataclasses.field(metadata=FIXED)   # seed of its sampling stream
  tokens: List[int] = dataclasses.field(metadata=APPEND_ONLY)
  prompt_len: int = dataclasses.field(metadata=FIXED)
  num_computed: int = 0         # tokens whose K/V are in the cache (device seq_len)
  slot: int = -1
  on_device: bool = False       # the slot is active in the device BlockState
  pending_fork: bool = False    # must be forked from the group leader at prompt_len
  last_block_shared: bool = False   # the partial last block is shared (copy-on-write)
  share_id: int = -1            # sequences with equal share_id share that block
  cum_logprob: float = 0.0
  topk: Optional[Tuple[Any, Any]] = None   # beam candidates awaiting selection
  swapped_kv: Any = None        # a leader's host copy of its group's pages (swap.SwappedKV)
  finish_reason: Optional[str] = None

  @property
  def num_generated(self) -> int:
    return len(self.tokens) - self.prompt_len

  @property
  def num_uncomputed(self) -> int:
    return len(self.tokens) - self.num_computed


@dataclasses.dataclass(eq=False)
class Group:
  """One request and its live sequences."""
  request_id: Any = dataclasses.field(metadata=FIXED)
  arrival: int = dataclasses.field(metadata=FIXED)
  params: Any = dataclasses.field(metadata=FIXED)        # engine.SamplingParams
  prompt: List[int] = dataclasses.field(metadata=FIXED)
  seqs: List[Sequence]          # live (unfinished) sequences; seqs[0] leads
  slots_needed: int = dataclasses.field(metadata=FIXED)
  finished: List[Sequence] = dataclasses.field(default_factory=list)
  slots: List[int] = dataclasses.field(default_factory=list)
  status: GroupStatus = GroupStatus.WAITING
  num_preemptions: int = 0

  @property
  def is_beam(self) -> bool:
    return self.params.beam_width > 1

  @property
  def leader(self) -> Sequence:
    return self.seqs[0]


@dataclasses.dataclass
class Chunk:
  """`num_tokens` tokens of `seq` starting at `seq.num_computed`."""
  seq: Sequence
  num_tokens: int
  samples: bool                 # the chunk ends at the last known token
  allocate: bool                # the slot is not yet active on device


@dataclasses.dataclass
class Batch:
  """The plan of one step: everything it will do, built by `Scheduler.schedule()` (which
  starts from what the last `Scheduler.update()` left for it: beam forks, frees of
  dropped beams, a swap-out after a failed step) and applied, with the step's outputs,
  by the next `Scheduler.update()`. The order of its effects is written once, in
  step.py's docstring; the host runs `swap_out` and `swap_in` around the jitted call."""
  chunks: List[Chunk] = dataclasses.field(default_factory=list)
  frees: List[int] = dataclasses.field(default_factory=list)          # slots
  # (parent, child): beam forks, run before the reservations
  forks: List[Tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)
  post_forks: List[Tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)
  # (group, its sequences' slots): preempted by swap, K/V copied to host before the step
  swap_out: List[Tuple[Group, List[int]]] = dataclasses.field(default_factory=list)
  swap_in: List[Group] = dataclasses.field(default_factory=list)
  preempted: List[Group] = dataclasses.field(default_factory=list)
  attaches: List[Sequence] = dataclasses.field(default_factory=list)  # prefix lookups
  attach_lens: List[int] = dataclasses.field(default_factory=list)    # their tokens
  # hit tokens of each attach, set by `Scheduler.update` from the step's outputs
  attach_hits: List[int] = dataclasses.field(default_factory=list)

  @property
  def num_tokens(self) -> int:
    return sum(c.num_tokens for c in self.chunks)

  @property
  def hit_of(self) -> Dict[int, int]:
    """id(sequence) -> hit tokens of its attach (after `Scheduler.update` set them)."""
    return dict(zip(map(id, self.attaches), self.attach_hits))

  @property
  def runs_nothing(self) -> bool:
    """No device work: no chunk, free, fork, prefix attach or swap-in."""
    return not (self.chunks or self.frees or self.forks or self.attaches or self.swap_in)


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
