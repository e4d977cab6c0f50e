"""How many KV blocks a scheduling decision takes: the scheduler's arithmetic, exact.

The device allocates (`block_manager.append`); the host plans from the free count the
last step reported, so it must count every block the step will take, or the step's
reservation fails on device and the engine re-plans. Counted here:

  appended_blocks an append of n tokens to a sequence of L tokens (new blocks only);
  chunks_need     a step's chunks of one group: new blocks, plus a copy for every
                  writer into a shared partial last block except its last holder
                  (copy-on-write);
  lookahead_need  the blocks a multi-step decode loop appends after a sampling chunk
                  (vLLM's lookahead slots);
  group_need      a waiting group brought back to its current tokens: the prompt's
                  full blocks once (shared by the forks), each sequence's past them;
  forked_blocks   that rule for any lengths (also `requests.prepare_group`'s worst
                  case, which decides whether a request can ever fit).

All counts are in blocks of `block_size` tokens. Pure functions of the scheduler's
records (`sequence.py`); no device state.
"""

from __future__ import annotations

import collections
from typing import Iterable, List

from paged_jax.config import cdiv
from paged_jax.engine.sequence import Chunk, Group


def forked_blocks(prompt_len: int, seq_lens: Iterable[int], block_size: int) -> int:
  """Blocks of sequences forked from one prompt, `seq_lens` tokens each: the prompt's
  full blocks once (shared), plus each sequence's blocks past them (a partial last
  prompt block is each sequence's own after copy-on-write)."""
  shared = prompt_len // block_size
  return shared + sum(cdiv(n, block_size) - shared for n in seq_lens)


def appended_blocks(length: int, num_tokens: int, block_size: int) -> int:
  """New blocks an append of `num_tokens` to a `length`-token sequence takes
  (copy-on-write not included)."""
  return cdiv(length + num_tokens, block_size) - cdiv(length, block_size)


def group_need(group: Group, block_size: int) -> int:
  """Blocks that bring every sequence of a waiting group to its current tokens.

  One sequence: its whole length. A fresh n-sample group: the prompt plus a
  copy-on-write copy of a partial last prompt block per child. A group preempted by
  recompute: every sample's or beam's generated tokens too, which it recomputes after
  the fork. Never more than `prepare_group`'s worst case, which the pool holds.
  """
  return forked_blocks(group.leader.prompt_len, [len(q.tokens) for q in group.seqs],
                       block_size)


def chunks_need(group: Group, chunks: List[Chunk], block_size: int) -> int:
  """Exact blocks the group's chunks take in one step: new blocks, plus a copy for
  every writer into a shared partial last block except the last holder (the device's
  copy-on-write rule, `block_manager.append`)."""
  need, writers = 0, None
  for c in chunks:
    need += appended_blocks(c.start, c.num_scheduled, block_size)
    if c.seq.share_id >= 0 and c.start % block_size and not c.allocate:
      writers = writers or collections.Counter()
      writers[c.seq.share_id] += 1
  if writers:
    holders = collections.Counter(q.share_id for q in group.seqs
                                  if q.share_id >= 0 and q.num_computed % block_size)
    need += sum(w - (w == holders[sid]) for sid, w in writers.items())
  return need


def lookahead_need(group: Group, chunks: List[Chunk], block_size: int,
                   lookahead: int) -> int:
  """Blocks the step's decode loop appends after the chunks that sample: up to
  `lookahead` (= decode_steps_per_sync - 1) more tokens each, capped by what is left of
  the request's `max_tokens`. Beams sample on the host, once per step: none."""
  if not lookahead or group.is_beam:
    return 0
  need = 0
  for c in chunks:
    if c.samples:   # a speculating row's loop starts after its drafts, all accepted at worst
      end = c.end + len(c.draft)
      left = group.params.max_tokens - c.seq.num_generated - 1 - len(c.draft)
      need += appended_blocks(end, max(0, min(lookahead, left)), block_size)
  return need
