"""Helpers shared by the prefix-cache tests (tests/prefix_cache*_test.py): a small pool,
the pure ops under one transform, a `Driver` that runs whole requests through them (attach
-> append -> register -> free) with the structural invariants, and the plain-Python model
of the hits: the set of registered block-aligned prefixes."""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import block_manager as bm
from paged_jax import prefix_cache as pc
from paged_jax.config import CacheConfig, OK

BS, NB, S, P = 4, 48, 4, 8
CFG = CacheConfig(block_size=BS, num_blocks=NB, max_seqs=S, max_blocks_per_seq=P)
L = CFG.max_seq_len


class Ops(NamedTuple):
  """The pure prefix-cache ops (and block append) under one transform: `jax.jit`, or a
  `chex.variants` test's `self.variant` (jitted, or run eagerly)."""
  attach: Callable
  register: Callable
  free: Callable
  lookup: Callable
  append: Callable
  ensure_free: Callable
  lru_victims: Callable
  reset: Callable
  uncache: Callable

  @classmethod
  def under(cls, transform: Callable) -> "Ops":
    evict_kw = dict(static_argnames=("max_evict",))
    return cls(attach=transform(pc.attach), register=transform(pc.register),
               free=transform(pc.free), lookup=transform(pc.lookup),
               append=transform(bm.append), ensure_free=transform(pc.ensure_free, **evict_kw),
               lru_victims=transform(pc.lru_victims, **evict_kw), reset=transform(pc.reset),
               uncache=transform(pc.uncache))


JIT = Ops.under(jax.jit)
j_attach, j_register, j_free, j_lookup, j_append, j_ensure, j_victims, j_reset, _ = JIT


def padded(tokens):
  buf = np.zeros((L,), np.int32)
  buf[:len(tokens)] = tokens
  return buf


class Driver:
  """Runs whole requests through the pure ops: admit, prefill the rest, register, free."""

  def __init__(self, cfg=CFG, ops: Ops = JIT, **kw):
    self.cache, self.blocks = pc.init(cfg, **kw), bm.init(cfg)
    self.ops = ops

  def admit(self, slot, tokens, salt=None):
    """Returns hit tokens; the slot then holds all of `tokens`, full blocks registered
    (under cache salt `salt`)."""
    root, tag = pc.salt_key(salt)
    self.cache, self.blocks, hit, status = self.ops.attach(self.cache, self.blocks, slot,
                                                           padded(tokens), len(tokens),
                                                           np.asarray(root, np.uint32), tag)
    assert int(status) == OK
    hit = int(hit)
    rest = np.zeros((S,), np.int32)
    rest[slot] = len(tokens) - hit
    self.blocks, st_, cow = self.ops.append(self.blocks, jnp.asarray(rest > 0),
                                            jnp.asarray(rest))
    assert int(st_[slot]) == OK and np.all(np.asarray(cow) < 0)
    n_full = len(tokens) // BS
    start = hit // BS
    items = np.full((P,), -1, np.int32)
    blk = np.full((P,), -1, np.int32)
    toks = np.zeros((P, BS), np.int32)
    for i, j in enumerate(range(start, n_full)):
      items[i], blk[i], toks[i] = slot, j, tokens[j * BS:(j + 1) * BS]
    self.cache, self.blocks = self.ops.register(self.cache, self.blocks, items, blk, toks,
                                                n_full - start)
    return hit

  def free(self, slot):
    self.cache, self.blocks, status = self.ops.free(self.cache, self.blocks, np.int32(slot))
    assert int(status) == OK

  def lookup(self, tokens, salt=None):
    root, tag = pc.salt_key(salt)
    n, ids = self.ops.lookup(self.cache, padded(tokens), len(tokens),
                             np.asarray(root, np.uint32), tag)
    return int(n), np.asarray(ids)

  def check_invariants(self):
    c, b = jax.device_get(self.cache), jax.device_get(self.blocks)
    free = set(np.asarray(b.free_stack)[:int(b.num_free)].tolist())
    cached = set(np.nonzero(np.asarray(c.cached))[0].tolist())
    assert not free & cached, "a cached block is on the free stack"
    refs = np.zeros((b.ref_count.shape[0],), np.int64)
    tables = np.asarray(b.block_tables)
    for row in tables:
      for blk in row[row >= 0]:
        refs[blk] += 1
    for blk in cached:
      refs[blk] += 1
    np.testing.assert_array_equal(np.asarray(b.ref_count), refs)
    assert len(free) == int(b.num_free) and all(refs[f] == 0 for f in free)
    table = np.asarray(c.table)
    for blk in cached:
      assert table[int(c.table_pos[blk])] == blk
    assert np.sum(table >= 0) == len(cached)


def churn(driver: Driver, rng, make_room, *, steps: int = 150, min_admissions: int = 30):
  """The random admit / free churn the eviction tests share: prompts sharing prefixes of
  one 28-token base, re-hits of released blocks, blocks held by live slots, slots freed
  together; invariants checked after every admission and free. When a prompt's blocks
  are short, `make_room(need)` evicts (updating `driver.cache` / `driver.blocks`) and
  returns how many blocks it evicted. Runs at least `min_admissions` steps and on until
  something was evicted; returns the blocks evicted in all."""
  base = [int(t) for t in rng.integers(0, 4, 28)]
  live, evicted = set(), 0
  for step in range(steps):
    if step >= min_admissions and evicted:
      break
    slot = [s for s in range(S) if s not in live][0]
    cut = int(rng.integers(0, 28))
    toks = base[:cut] + [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 29 - cut)))]
    need = -(-len(toks) // BS)
    if int(driver.blocks.num_free) < need:   # make room the way the engine does
      evicted += make_room(need)
    if int(driver.blocks.num_free) + int(pc.num_evictable(driver.cache, driver.blocks)) < need:
      break
    driver.admit(slot, toks)
    live.add(slot)
    driver.check_invariants()
    if len(live) >= 2 or rng.random() < 0.5:
      gone = [s for s in live if rng.random() < 0.7] or [min(live)]
      driver.cache, driver.blocks, _ = j_free(driver.cache, driver.blocks,
                                              jnp.asarray(gone + [-1] * (S - len(gone))))
      live -= set(gone)
    driver.check_invariants()
  return evicted


def expected_hits(model_prefixes, tokens):
  """Plain-Python model: longest j <= (len - 1) // BS with every prefix registered."""
  j = 0
  while j < (len(tokens) - 1) // BS and tuple(tokens[:(j + 1) * BS]) in model_prefixes:
    j += 1
  return j
