"""Helpers of the host-tier tests (host_tier_test, host_tier_transfer_test): a small engine
with a host tier, seeded multi-turn conversations, the caching-off reference, and a
plain-Python model of both tiers fed by the KV events."""

import collections

import jax
import numpy as np

from paged_jax.engine import Engine, SamplingParams
from paged_jax.prefix_cache import events as events_lib
from paged_jax.prefix_cache import state as prefix_state

from engine_oracle import MC, ORACLE_LEN, PARAMS, VOCAB

BS, NUM_BLOCKS, MAX_SEQS, BUDGET, HOST = 4, 10, 4, 16, 24


def make(caching=True, host=HOST, **kw):
  cc = MC.cache_config(block_size=BS, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=ORACLE_LEN // BS, enable_prefix_caching=caching,
                       num_host_blocks=host if caching else 0)
  return Engine(MC, PARAMS, cc, max_num_batched_tokens=BUDGET, attention_backend="reference",
                **kw)


def greedy(n=3, **kw):
  return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def conversations(seed, num=5, turns=3, first=13, later=3):
  """Prompts of `num` seeded conversations, turn by turn: each turn's prompt is the whole
  history (the previous prompt and some new tokens), conversations interleaved."""
  rng = np.random.default_rng(seed)
  hist = [[int(t) for t in rng.integers(0, VOCAB, first)] for _ in range(num)]
  out = []
  for _ in range(turns):
    for h in hist:
      out.append(list(h))
      h += [int(t) for t in rng.integers(0, VOCAB, later)]
  return out


REFERENCE = {}


def reference(prompts):
  """Greedy outputs with caching off (one engine per prompt list, kept)."""
  key = tuple(map(tuple, prompts))
  if key not in REFERENCE:
    eng = make(caching=False)
    REFERENCE[key] = [eng.generate([p], greedy())[0].outputs for p in prompts]
  return REFERENCE[key]


# ---- a plain-Python model of both tiers, fed by the events ------------------------------

class Replay:
  """hash -> count per medium, changed only by events."""

  def __init__(self):
    self.tiers = {m: collections.Counter() for m in events_lib.MEDIA}

  def apply(self, events):
    for e in events:
      assert e.kind in events_lib.KINDS and e.medium in events_lib.MEDIA, e
      tier = self.tiers[e.medium]
      if e.kind == "cleared":
        tier.clear()
      elif e.kind == "stored":
        assert e.parent_block_hash is not None
        tier.update(e.block_hashes)
      else:
        tier.subtract(e.block_hashes)
        assert all(tier[h] >= 0 for h in e.block_hashes), e
      self.tiers[e.medium] = +tier


def truth(engine):
  """What the engine holds now: {medium: Counter of hashes}."""
  cache = jax.device_get(engine.state.prefix.cache)
  meta = np.asarray(cache.block_meta)
  dev = collections.Counter(
      events_lib.hash_int(meta[i, prefix_state.HASH:prefix_state.HASH + 2])
      for i in np.nonzero(np.asarray(cache.cached))[0])
  host = collections.Counter(list(engine._tiers.host.hashes()) if engine._tiers.host else [])  # pylint: disable=protected-access
  return {"device": dev, "host": host}


def assert_counts_exact(engine):
  """metrics() against the device's own counters and the host tier's pool."""
  m, s = engine.metrics(), engine.prefix_stats()
  assert (m["num_free_blocks"], m["num_evictable_blocks"]) == (s["num_free"],
                                                              s["evictable_blocks"])
  held = len(engine._tiers.host.hashes())   # pylint: disable=protected-access
  assert m["num_free_host_blocks"] == HOST - held and m["num_host_blocks"] == HOST


def run(engine, prompts, replay=None, params=None):
  """Adds each prompt once the previous one finished (turn after turn, as a chat client
  does); steps to the end, checking events and metrics after every step."""
  outs = []
  for p in prompts:
    rid = engine.add_request(p, params or greedy())
    while engine.has_unfinished():
      for o in engine.step():
        assert o.request_id == rid
        outs.append(o.outputs)
      if replay is not None:
        replay.apply(engine.kv_events())
        assert replay.tiers == truth(engine)
        assert_counts_exact(engine)
  return outs
