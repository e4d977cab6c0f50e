"""`prefix_cache.register_runs` (the engine step's registration, depth by depth, slots
that cannot meet at once) against `register` of the same items one by one, in its order.

States come from the real ops: requests with shared prefixes admitted (attach, append,
register), some freed, then several slots attach and append prompts without registering,
so each holds a run of full unregistered blocks (some equal to each other, some to cached
ones). A small table and probe window make slots' windows meet often, and the "constant"
hash mode makes them always meet, so both the at-once and the one-by-one paths run.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from paged_jax import prefix_cache as pc
from paged_jax.config import CacheConfig, OK
from prefix_cache_support import Driver, Ops

BS, NB, S, P = 4, 96, 8, 8
CFG = CacheConfig(block_size=BS, num_blocks=NB, max_seqs=S, max_blocks_per_seq=P)
L = CFG.max_seq_len
OPS = Ops.under(jax.jit)
j_runs = jax.jit(pc.register_runs)


def _attach_append(d: Driver, slot: int, toks) -> None:
  """`slot` takes `toks`' cached prefix and appends the rest (nothing registered)."""
  buf = np.zeros((L,), np.int32)
  buf[:len(toks)] = toks
  d.cache, d.blocks, hit, status = OPS.attach(d.cache, d.blocks, slot, buf, len(toks))
  assert int(status) == OK
  rest = np.zeros((S,), np.int32)
  rest[slot] = len(toks) - int(hit)
  d.blocks, status, _ = OPS.append(d.blocks, jnp.asarray(rest > 0), jnp.asarray(rest))
  assert int(status[slot]) == OK


def _admit(d: Driver, slot: int, toks) -> None:
  """attach, append, register the full blocks (one by one)."""
  _attach_append(d, slot, toks)
  start = int(d.cache.chain_len[slot])
  n = len(toks) // BS - start
  blk = np.full((P,), -1, np.int32)
  item = np.full((P,), -1, np.int32)
  tok = np.zeros((P, BS), np.int32)
  for i in range(max(n, 0)):
    item[i], blk[i] = slot, start + i
    tok[i] = toks[(start + i) * BS:(start + i + 1) * BS]
  d.cache, d.blocks = OPS.register(d.cache, d.blocks, item, blk, tok, max(n, 0))


def _states(seed: int, mode: str):
  """(cache, blocks, first i32[S], count i32[S], history i32[S, L])."""
  rng = np.random.default_rng(seed)
  d = Driver(CFG, OPS, hash_mode=mode, max_probe=4, table_factor=1)
  base = rng.integers(0, 3, L)
  prompt = lambda: [int(t) for t in np.concatenate(
      [base[:int(rng.integers(0, L))], rng.integers(0, 3, L)])[:int(rng.integers(1, L + 1))]]
  for r in range(int(rng.integers(0, 10))):      # a cache with some history
    slot = r % S
    if r >= S:
      d.free(slot)
    _admit(d, slot, prompt())
  for slot in range(S):
    if int(d.blocks.active[slot]) and rng.random() < 0.7:
      d.free(slot)
  history = np.zeros((S, L), np.int32)
  for slot in range(S):                           # attach + append, no registration
    if int(d.blocks.active[slot]) or rng.random() < 0.2:
      continue
    toks = prompt()
    history[slot, :len(toks)] = toks
    _attach_append(d, slot, toks)
  c, b = d.cache, d.blocks
  first = np.asarray(c.chain_len)
  todo = np.where(np.asarray(b.active) & np.asarray(c.chain_ok),
                  np.maximum(np.asarray(b.seq_lens) // BS - first, 0), 0).astype(np.int32)
  # Some slots register only part of their run (the engine's cap on items per step).
  count = np.minimum(todo, rng.integers(0, P + 1, S)).astype(np.int32)
  return c, b, first.astype(np.int32), count, history


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(pc.HASH_MODES))
def test_register_runs_equals_register_of_the_items_depth_by_depth(seed, mode):
  c, b, first, count, history = _states(seed, mode)
  items = [(s, first[s] + k) for k in range(P) for s in range(S) if k < count[s]]
  n = len(items)
  slot = np.full((S * P,), -1, np.int32)
  blk = np.full((S * P,), -1, np.int32)
  toks = np.zeros((S * P, BS), np.int32)
  for i, (s, j) in enumerate(items):
    slot[i], blk[i], toks[i] = s, j, history[s, j * BS:(j + 1) * BS]
  c_ref, b_ref = OPS.register(c, b, slot, blk, toks, n)
  c_new, b_new = j_runs(c, b, first, count, history)
  for want, got in ((c_ref, c_new), (b_ref, b_new)):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want),
                            jax.tree_util.tree_leaves(got)):
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x),
                                    err_msg=f"{jax.tree_util.keystr(path)} ({n} items)")


def test_register_runs_registers_a_run_and_the_next_run_hits_it():
  """A slot's three full blocks register in one call; a later prompt then hits them."""
  d = Driver(CFG, OPS)
  toks = list(range(1, 3 * BS + 2))            # three full blocks and one token
  _attach_append(d, 0, toks)
  history = np.zeros((S, L), np.int32)
  history[0, :len(toks)] = toks
  count = np.zeros((S,), np.int32)
  count[0] = 3
  d.cache, d.blocks = j_runs(d.cache, d.blocks, np.zeros((S,), np.int32), count, history)
  assert int(pc.num_cached_blocks(d.cache)) == 3
  d.check_invariants()
  assert d.lookup(toks + [7])[0] == 3
