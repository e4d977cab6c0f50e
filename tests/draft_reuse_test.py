"""The draft model's catch-up skips prefix-hit blocks whose draft K/V are whole
(`engine/draft_reuse.py`). With the target drafting for itself every draft must still be
accepted (a block reused with draft K/V that are not its own would draft wrong tokens),
outputs equal the dense oracle, and the tokens skipped are exactly the hit blocks that an
earlier sequence caught the draft up over: none when that sequence never drafted, none
when the blocks were registered again since (a reset, then other tokens in the same block
ids), and the catch-up shrinks by exactly what was skipped."""

import jax
import numpy as np

from paged_jax.prefix_cache import state as pst

from engine_oracle import MC, PARAMS, dense_greedy, greedy, oracle_engine, random_prompts

SELF = {"method": "draft_model", "model": (MC, PARAMS), "num_speculative_tokens": 3}
B = 4
P = random_prompts(21, 1, lo=17, hi=17)[0]            # 4 whole blocks and one token
Q = random_prompts(22, 1, lo=17, hi=17)[0]
SUFFIXES = random_prompts(23, 3, lo=2, hi=5)


def _engine(reuse=True):
  engine = oracle_engine(block_size=B, num_blocks=64, max_seqs=4, budget=128, caching=True,
                         speculative_config=SELF)
  engine._drafter.reuse_prefix = reuse   # pylint: disable=protected-access
  return engine


def _wave(engine, prompts, max_tokens=8):
  outs = engine.generate(prompts, greedy(max_tokens))
  for p, o in zip(prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, max_tokens)


def _all_accepted(engine):
  m = engine.metrics()
  assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0
  return engine._drafter.stats   # pylint: disable=protected-access


def test_hits_over_blocks_the_draft_caught_up_over_are_skipped_exactly():
  runs = {}
  for reuse in (True, False):
    engine = _engine(reuse)
    _wave(engine, [P + [1]])                          # drafts: P's 4 blocks made whole
    _wave(engine, [P + s for s in SUFFIXES])          # each hits those 4 blocks
    assert engine.metrics()["prefix_hit_tokens"] >= len(SUFFIXES) * 4 * B
    runs[reuse] = dict(_all_accepted(engine))
  assert runs[True]["reused_tokens"] == len(SUFFIXES) * 4 * B
  assert runs[False].get("reused_tokens", 0) == 0
  assert (runs[False]["catchup_tokens"] - runs[True]["catchup_tokens"]
          == runs[True]["reused_tokens"])
  assert runs[True]["drafting_rows"] == runs[False]["drafting_rows"]


def test_hit_blocks_without_draft_kv_are_caught_up_over():
  engine = _engine()
  _wave(engine, [P + [1]], max_tokens=1)              # prefilled, registered, never drafted
  _wave(engine, [P + s for s in SUFFIXES])
  assert engine.metrics()["prefix_hit_tokens"] >= len(SUFFIXES) * 4 * B
  assert _all_accepted(engine).get("reused_tokens", 0) == 0


def test_blocks_registered_again_are_not_reused():
  """P's blocks are made whole, the cache is reset, Q (never drafting) is registered in
  the freed block ids (a one-block request first takes the block on top of the free
  stack, one P's draft never made whole): Q's blocks hold P's draft K/V."""
  engine = _engine()
  _wave(engine, [P + [1]])
  engine.reset_prefix_cache()
  _wave(engine, [[7, 8], Q + [1]], max_tokens=1)
  valid = np.asarray(engine._drafter.valid_gen)   # pylint: disable=protected-access
  meta = np.asarray(jax.device_get(engine.state.prefix.cache.block_meta))
  stale = (meta[:, pst.CACHED] != 0) & (valid >= 0) & (valid != meta[:, pst.GEN])
  assert sorted(meta[stale, pst.DEPTH]) == [0, 1, 2, 3]   # the case this test is about
  _wave(engine, [Q + s for s in SUFFIXES])
  assert _all_accepted(engine).get("reused_tokens", 0) == 0


def test_a_dispatch_that_took_the_pages_forgets_which_blocks_were_whole():
  engine = _engine()
  _wave(engine, [P + [1]])
  drafter = engine._drafter   # pylint: disable=protected-access
  real, fired = drafter._propose, []   # pylint: disable=protected-access

  def failing(params, pages, *rest):   # the second wave's first dispatch takes the pages
    if not fired:
      fired.append(1)
      for x in jax.tree_util.tree_leaves(pages):
        x.delete()
      raise RuntimeError("injected")
    return real(params, pages, *rest)

  drafter._propose = failing   # pylint: disable=protected-access
  prompts = [P + s for s in SUFFIXES]
  ids = [engine.add_request(p, greedy(8)) for p in prompts]
  outs, raised = {}, 0
  while engine.has_unfinished():
    try:
      outs.update((o.request_id, o.outputs[0]) for o in engine.step())
    except RuntimeError:
      raised += 1
  assert fired and raised == 1
  for i, p in zip(ids, prompts):
    assert outs[i] == dense_greedy(PARAMS, p, 8)
  stats = _all_accepted(engine)
  assert stats["reused_tokens"] == len(SUFFIXES) * 4 * B   # queried before the fault only
