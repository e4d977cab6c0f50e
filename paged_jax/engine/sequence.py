"""The scheduler's records: a request (`Group`) and its token streams (`Sequence`), and
what one step runs (`Chunk`s gathered in a `Batch`). Plain host-side dataclasses; the
device's copy of a sequence is its block-table slot (`Sequence.slot`).

Vocabulary:
  Sequence  one token stream (prompt + generated) owning one block-table slot.
  Group     one request: 1 sequence, or n parallel samples, or beam_width beams.
            A group reserves `slots_needed` slots at admission.
  Chunk     the tokens of one sequence computed in a step (a prefill chunk or
            one decode token). A sequence's uncomputed tokens are
            `tokens[num_computed:]`; it samples when its chunk reaches the end.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, List, Optional, Tuple


class GroupStatus(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  SWAPPED = "swapped"
  FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
  """One token stream. `tokens` = prompt + generated (the last may be uncomputed)."""
  seq_id: int
  index: int                    # position in the request's outputs (sample j)
  sample_seed: int              # seed of this sequence's sampling stream
  tokens: List[int]
  prompt_len: int
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
  request_id: Any
  arrival: int
  params: Any                   # engine.SamplingParams
  prompt: List[int]
  seqs: List[Sequence]          # live (unfinished) sequences; seqs[0] leads
  slots_needed: int
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
  """What one step runs. Applied on device in this order: frees, forks, swap-ins
  (before the step, by the engine), reservations + model + sampling, post_forks."""
  chunks: List[Chunk] = dataclasses.field(default_factory=list)
  frees: List[int] = dataclasses.field(default_factory=list)          # slots
  forks: List[Tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)  # (parent, child)
  post_forks: List[Tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)
  swap_out: List[Group] = dataclasses.field(default_factory=list)   # whole groups
  swap_in: List[Group] = dataclasses.field(default_factory=list)
  preempted: List[Group] = dataclasses.field(default_factory=list)
  attaches: List[Sequence] = dataclasses.field(default_factory=list)  # prefix lookups

  @property
  def num_tokens(self) -> int:
    return sum(c.num_tokens for c in self.chunks)
