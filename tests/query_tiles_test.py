"""The one query-tile planner of the ragged kernels (pallas_kernels/tiling.py) vs a
plain-Python enumeration of each sequence's tiles: the Triton kernel's tile classes, the
Mosaic GPU kernel's row -> tile map and the xla path's tiles all come from here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tiling
from ragged_batches import _test_seed

_query_tiles = jax.jit(tiling.query_tiles, static_argnames=(
    "num_tokens", "q_per_tile", "min_q_len", "max_q_len", "num_tiles"))


def _python_tiles(cu, kv_lens, q_lens, num_live, tq, lo=1, hi=None):
  """[(seq, first row, rows, first position)] of every tile, in order."""
  want = []
  for i in range(num_live):
    if q_lens[i] < lo or (hi is not None and q_lens[i] > hi):
      continue
    for start in range(0, int(q_lens[i]), tq):
      want.append((i, int(cu[i]) + start, min(tq, int(q_lens[i]) - start),
                   int(kv_lens[i] - q_lens[i]) + start))
  return want


def test_query_tiles_match_python_model():
  """Tiling metadata vs a plain-Python enumeration of each class's sequences and tiles."""
  num_seqs_max, num_tokens = 6, 200
  classes = [(1, None), (1, 4), (5, None), (2, 16)]
  for i in range(30):
    seed = _test_seed(i)
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(0, 30, num_seqs_max) * (rng.random(num_seqs_max) < 0.8)
    q_lens[rng.random(num_seqs_max) < 0.3] = 1  # decode rows
    num_live = int(rng.integers(0, num_seqs_max + 1))
    kv_lens = q_lens + rng.integers(0, 50, num_seqs_max)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tq = int(rng.choice([1, 4, 16]))
    lo, hi = classes[int(rng.integers(len(classes)))]
    tiles = _query_tiles(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.int32(num_live),
                         num_tokens=num_tokens, q_per_tile=tq, min_q_len=lo, max_q_len=hi)
    got = [(int(s), int(r), int(n), int(p)) for s, r, n, p in zip(*map(np.asarray, tiles))
           if n > 0]
    want = _python_tiles(cu, kv_lens, q_lens, num_live, tq, lo, hi)
    assert got == want, f"seed={seed}"
    bound = tiling.max_query_tiles(num_tokens, num_seqs_max, tq, lo, hi)
    assert len(tiles.seq) == bound >= len(want), f"seed={seed}"
    # Idle tiles come last and hold nothing.
    assert (np.asarray(tiles.num_rows)[len(want):] == 0).all(), f"seed={seed}"


@pytest.mark.parametrize("tq", [1, 3, 8])
def test_token_tiles_invert_query_tiles(tq):
  """Every live row is found in its tile at its row; padding rows are not live."""
  rows, num_tokens = 6, 80                 # static: one compile per tile size

  @jax.jit
  def plan(cu, kv_lens, num_live):
    tiles = tiling.query_tiles(cu, kv_lens, num_live, num_tokens=num_tokens, q_per_tile=tq,
                               num_tiles=-(-num_tokens // tq) + rows)
    return tiles, tiling.token_tiles(cu, num_live, num_tokens=num_tokens, q_per_tile=tq)

  for i in range(20):
    seed = _test_seed(i)
    rng = np.random.default_rng(seed)
    q_lens = rng.integers(0, 12, rows)
    num_live = int(rng.integers(0, rows + 1))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tiles, (tile, row, live) = jax.device_get(plan(
        jnp.asarray(cu), jnp.asarray(q_lens + 5, jnp.int32), jnp.int32(num_live)))
    start, count = tiles.row_start, tiles.num_rows
    for t in range(num_tokens):
      assert live[t] == (t < cu[num_live]), f"seed={seed} row {t}"
      if live[t]:
        assert row[t] < count[tile[t]] and start[tile[t]] + row[t] == t, f"seed={seed}"


def test_query_tiles_have_no_search_loop():
  """Tile -> sequence is a compare-and-sum, not jnp.searchsorted's while loop (on a GPU a
  loop of tiny kernels per forward)."""
  jaxpr = jax.make_jaxpr(lambda cu, kv, n: (
      tiling.query_tiles(cu, kv, n, num_tokens=512, q_per_tile=16),
      tiling.token_tiles(cu, n, num_tokens=512, q_per_tile=16)))(
          jnp.zeros((9,), jnp.int32), jnp.zeros((8,), jnp.int32), jnp.int32(8))
  assert "while" not in str(jaxpr)


def test_tile_classes_cover_every_sequence_once():
  for tokens, tq, short in [(64, 16, 4), (64, 16, 16), (3, 16, 4), (1, 8, 2)]:
    classes = tiling.tile_classes(tokens, tq, short, kv_splits=3)
    for q_len in range(1, tokens + 1):
      owners = [c for c in classes
                if c.min_q_len <= q_len and (c.max_q_len is None or q_len <= c.max_q_len)]
      assert len(owners) == 1, (tokens, tq, short, q_len, classes)
    assert classes[0].kv_splits == 3 and all(c.kv_splits == 1 for c in classes[1:])
