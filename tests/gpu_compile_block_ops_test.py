"""Block-manager ops and sampling compiled by XLA for a compile-only H200 (sm_90).

On a GPU every `lax.cond`/`lax.switch` whose predicate lives on the device becomes a
ConditionalThunk, which copies the branch index to the host and blocks; a while loop
without a known trip count does the same for its predicate every iteration. These ops run
every engine step (and inside the multi-step decode loop), so their compiled thunk
sequences must hold no `kConditional` and only known-trip-count loops. With the state
donated they must also update the O(num_blocks) arrays in place: no temp buffer of pool
size (`pallas_kernels.deviceless.target`; nothing is allocated).
"""

import glob
import os
import tempfile

import pytest

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.deviceless import target as ct
from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig
from paged_jax.engine import sampling

pytestmark = pytest.mark.skipif(ct.unavailable_reason() is not None,
                                reason=str(ct.unavailable_reason()))

NB = 1 << 20                       # 4 MiB per O(num_blocks) int32 array
CFG = CacheConfig(block_size=16, num_blocks=NB, max_seqs=64, max_blocks_per_seq=128)
POOL_ARRAY_BYTES = NB * 4


def _compile(fn, *args, donate=True):
  """(report, thunk sequence text, optimized HLO text) of `fn` compiled for sm_90."""
  with tempfile.TemporaryDirectory() as d:
    kw = {"donate_argnums": 0} if donate else {}
    report = ct.compile_report(jax.jit(fn, **kw), *args, dump_dir=d)
    thunks = "".join(open(f).read() for f in glob.glob(os.path.join(d, "*thunk_sequence.txt")))
    hlo = "".join(open(f).read() for f in glob.glob(os.path.join(d, "*after_optimizations.txt"))
                  if "buffer-assignment" not in f and "memory-usage" not in f)
  assert thunks and hlo, "no thunk sequence / optimized HLO dumped"
  return report, thunks, hlo


def _host_readbacks(thunks: str, hlo: str) -> list:
  """Conditional thunks, and while loops XLA could not give a known trip count."""
  out = [l.strip() for l in thunks.splitlines() if "kConditional" in l]
  out += [l.strip()[:200] for l in hlo.splitlines()
          if " while(" in l and "known_trip_count" not in l]
  return out


def _ops():
  state = ct.place(jax.eval_shape(lambda: bm.init(CFG)))
  s = CFG.max_seqs
  i32 = lambda n: ct.abstract((n,), jnp.int32)
  mask = ct.abstract((s,), jnp.bool_)
  return {
      "allocate": (bm.allocate, (state, i32(8), i32(8))),
      "allocate_static": (lambda st, sl: bm.allocate(st, sl, 100), (state, i32(8))),
      "append": (bm.append, (state, mask, i32(s))),
      "append_decode": (lambda st, m: bm.append(st, m, 1), (state, mask)),
      "append_bound": (lambda st, m, n: bm.append(st, m, n, max_new_tokens=40),
                       (state, mask, i32(s))),
      "free": (bm.free, (state, i32(8))),
      "fork": (bm.fork, (state, i32(4), i32(4))),
  }


@pytest.mark.parametrize("name", list(_ops()))
def test_block_op_has_no_host_readback_and_no_pool_sized_temp(name):
  fn, args = _ops()[name]
  report, thunks, hlo = _compile(fn, *args)
  assert _host_readbacks(thunks, hlo) == [], name
  # In place: both O(num_blocks) arrays aliased to the donated state, and no temp buffer
  # anywhere near one of them (what there is scales with max_seqs * max_blocks_per_seq).
  assert report.alias_bytes >= 2 * POOL_ARRAY_BYTES, (name, report)
  assert report.temp_bytes < POOL_ARRAY_BYTES // 4, (name, report.temp_bytes)


def test_token_slots_has_no_host_readback():
  state = ct.place(jax.eval_shape(lambda: bm.init(CFG)))
  t = ct.abstract((256,), jnp.int32)
  report, thunks, hlo = _compile(bm.token_slots, state, t, t, donate=False)
  assert _host_readbacks(thunks, hlo) == []
  assert report.temp_bytes < POOL_ARRAY_BYTES // 4


def test_sampling_has_no_host_readback():
  s, v = 64, 4096
  f32, i32 = (lambda *sh: ct.abstract(sh, jnp.float32)), (lambda *sh: ct.abstract(sh, jnp.int32))
  _, thunks, hlo = _compile(sampling.sample, f32(s, v), f32(s), i32(s), f32(s), i32(s), i32(s),
                            donate=False)
  assert _host_readbacks(thunks, hlo) == []


def test_the_check_finds_a_conditional():
  """The check can fail: a lax.cond on a device predicate is a ConditionalThunk (with a
  branch too costly for XLA to turn the cond into a select, as the block manager's were)."""
  def f(x):
    return lax.cond(jnp.sum(x) > 0, lambda: jnp.sort(x), lambda: x * 2)
  _, thunks, hlo = _compile(f, ct.abstract((1024,), jnp.float32), donate=False)
  assert any("kConditional" in l for l in _host_readbacks(thunks, hlo))
