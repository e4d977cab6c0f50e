"""Counting what rollback frees under speculative decoding, step by step, and what a
'keep' rule (rejected blocks kept reserved for the next step) would save and hold
instead: `instrument(engine)` wraps an engine's schedule and step and fills a `Tally`.
Used by experiments.speculative_blocks (the keep-vs-free question, issue 39 point 1) and
experiments.speculative_scale (the drafting share of its fixed-rate points).
"""

from __future__ import annotations

import dataclasses


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass
class Tally:
  """Counts over the steps that ran (block counts in blocks, `*_steps` summed per step).

  Attributes:
    steps: steps that ran a plan with chunks; decode_rows / draft_rows / draft_tokens:
      decode rows, those with drafts, and their draft tokens.
    pops: blocks popped under 'free' (the engine); saved_pops: of those, pops 'keep'
      would not make (the slot still held the block); saved_next: saved pops of blocks
      the slot's rollback freed in its previous step.
    rollback_freed: blocks rollback returned (past the accepted length).
    kept_block_steps: blocks 'keep' holds beyond 'free' after each step, summed.
    used_block_steps / seq_steps: blocks held ('free') and running sequences after each
      step, summed (mean blocks per sequence = used / seq).
    checked_steps / mismatched_steps: steps whose used-block count was compared with
      the engine's, and those that differed.
  """
  block_size: int = 16
  steps: int = 0
  decode_rows: int = 0
  draft_rows: int = 0
  draft_tokens: int = 0
  pops: int = 0
  saved_pops: int = 0
  saved_next: int = 0
  rollback_freed: int = 0
  kept_block_steps: int = 0
  used_block_steps: int = 0
  seq_steps: int = 0
  checked_steps: int = 0
  mismatched_steps: int = 0

  def summary(self) -> Dict:
    """The counts per step and the rows 'keep' would cost: kept blocks / blocks per seq."""
    per = lambda x: x / self.steps if self.steps else 0.0
    per_seq = self.used_block_steps / self.seq_steps if self.seq_steps else 0.0
    rows = per(self.kept_block_steps) / per_seq if per_seq else 0.0
    return dict(drafting_share=self.draft_rows / self.decode_rows if self.decode_rows else 0.0,
                freed_per_step=per(self.rollback_freed), pops_per_step=per(self.pops),
                saved_pops_per_step=per(self.saved_pops),
                saved_next_per_step=per(self.saved_next),
                kept_blocks_per_step=per(self.kept_block_steps),
                blocks_per_seq=per_seq, mean_running_seqs=per(self.seq_steps),
                rows_lost=rows,
                rows_lost_share=rows / per(self.seq_steps) if self.seq_steps else 0.0)


def instrument(engine) -> Tally:
  """Counts `engine`'s steps into a new Tally (wraps its `scheduler.schedule` and `step`:
  drive it with `step()`, not `generate`; decode_steps_per_sync 1, no prefix caching)."""
  from paged_jax.engine.sequence import SeqState  # pylint: disable=g-import-not-at-top
  if engine.decode_steps_per_sync != 1 or engine.prefix_caching:
    raise ValueError("speculative_blocks.instrument needs decode_steps_per_sync 1 and no "
                     "prefix caching")
  tally = Tally(block_size=engine.cache_config.block_size)
  b = tally.block_size
  sched, plan, step = engine.scheduler, engine.scheduler.schedule, engine.step
  planned, kept, freed_last = [], {}, {}

  def schedule(*args, **kw):
    batch = plan(*args, **kw)
    planned.append(batch)
    return batch

  def counted_step():
    planned.clear()
    outs = step()
    if planned and engine.last_step.ok and planned[-1].chunks:
      _count(planned[-1])
    running = [q for g in sched.running for q in g.seqs]
    live = set(map(id, running))
    for d in (kept, freed_last):
      for key in [key for key in d if key not in live]:
        del d[key]
    held = [_cdiv(q.num_computed, b) for q in running]
    tally.used_block_steps += sum(held)
    tally.seq_steps += len(running)
    tally.kept_block_steps += sum(max(kept.get(id(q), h), h) - h for q, h in zip(running, held))
    m = engine.metrics()
    tally.checked_steps += 1
    tally.mismatched_steps += (m["num_blocks"] - m["num_free_blocks"]) != sum(held)
    return outs

  def _count(batch):
    tally.steps += 1
    for ch in batch.chunks:
      q = ch.seq
      before, need = _cdiv(ch.start, b), _cdiv(ch.end + len(ch.draft), b)
      held_keep = max(kept.get(id(q), 0), before)
      pops, saved = need - before, need - before - max(0, need - held_keep)
      tally.pops += pops
      tally.saved_pops += saved
      tally.saved_next += min(saved, freed_last.get(id(q), 0))
      if ch.num_tokens == 1 and ch.start >= q.prompt_len:
        tally.decode_rows += 1
        tally.draft_rows += bool(ch.draft)
        tally.draft_tokens += len(ch.draft)
      if q.state is SeqState.RUNNING:
        freed = need - _cdiv(q.num_computed, b)
        tally.rollback_freed += freed
        freed_last[id(q)] = freed
        kept[id(q)] = max(held_keep, need)

  sched.schedule = schedule
  engine.step = counted_step
  return tally
