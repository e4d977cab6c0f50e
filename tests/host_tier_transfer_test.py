"""Where the host tier's K/V live and how they move (`prefix_cache/host_tier.py`).

On a CPU the pool is plain numpy (the engine's pages' device lists a `pinned_host`
memory, but its device memory is host memory already). On a GPU / TPU the pool is staged
in pinned host memory and `_fetch` (host -> device) / `_stash` (device -> host) copy one
step's blocks in one jitted call each. Checked here:

  - the CPU chooses numpy; a pinned pool (forced on the CPU, whose jax runs pinned_host
    arrays) stores and returns exactly the blocks it was given, and an engine with it
    keeps greedy outputs equal to no caching with exact events;
  - compiled without a device for an H200 and a TPU v6e, at two host-pool sizes: the
    pool is a host-memory buffer (layout memory space S(5)), the copies are the
    compiler's asynchronous dynamic-slice / dynamic-update-slice starts on it, every
    array of the pool's shape is in host memory, and the device's argument, output and
    temp bytes do not grow with the pool while its host argument bytes do.

The H200 compile-only device lists no memories (jax 0.10.2 / 0.11.2), so a sharding on it
loses its memory kind: the transfers are lowered for CUDA with the CPU's memory kinds and
the module is compiled for the H200 (`jax._src.compiler`, private: the version pins
keep it stable here).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paged_jax.prefix_cache import host_tier
from pallas_kernels.deviceless import target as gt
from pallas_kernels.tpu import compile_target as tt

# A bf16 K block [layers, kv heads, block size, head dim] and an f32 scale block.
FIELDS = {"k": ((2, 2, 16, 64), jnp.bfloat16), "k_scale": ((2, 2, 16), jnp.float32)}
STEP_BLOCKS = 8
POOLS = (96, 384)


def _meta(hashes, bs):
  n = len(hashes)
  return dict(hash=list(hashes), parent=[0] * n, depth=np.zeros(n, np.int32),
              tokens=np.zeros((n, bs), np.int32))


def _blocks(rng, n):
  """field -> [L, Hkv, n, bs(, D)] seeded values (`read_blocks`' form), numpy."""
  return {f: rng.standard_normal(shape[:2] + (n,) + shape[2:]).astype(dtype)
          for f, (shape, dtype) in FIELDS.items()}


# ---- on this CPU ------------------------------------------------------------------------

def test_the_cpu_keeps_a_numpy_pool():
  cpu = jax.devices("cpu")[0]
  assert "pinned_host" in {m.kind for m in cpu.addressable_memories()}  # listed, not used
  assert host_tier.host_memory_kind(cpu) is None
  assert host_tier.host_memory_kind(None) is None
  tier = host_tier.HostTier(4, 16, FIELDS, device=cpu)
  assert tier.memory_kind is None
  assert all(isinstance(p, np.ndarray) and p.shape == (4,) + FIELDS[f][0]
             for f, p in tier.pages.items())


@pytest.mark.parametrize("pinned", [False, True])
def test_a_pool_returns_exactly_the_blocks_it_stored(monkeypatch, pinned):
  """Stores 7 blocks into 4 entries (evicting the oldest within the batch, a block
  repeated), from a shuffled device buffer; what comes back is the source blocks."""
  cpu = jax.devices("cpu")[0]
  if pinned:
    monkeypatch.setattr(host_tier, "host_memory_kind", lambda d: "pinned_host")
  tier = host_tier.HostTier(4, 16, FIELDS, device=cpu)
  assert tier.memory_kind == ("pinned_host" if pinned else None)
  rng = np.random.default_rng(0)
  src = _blocks(rng, 9)
  index = rng.permutation(9)[:7]
  hashes = [11, 12, 13, 12, 14, 15, 16]       # 12 again: only marked used
  pages = jax.device_put(src, cpu) if pinned else src
  tier.store(_meta(hashes, 16), pages, index=index)
  held = tier.hashes()
  assert sorted(held) == [12, 14, 15, 16]     # LRU: 11 then 13 left
  entries = [tier._lru[h] for h in (12, 14, 15, 16)]  # pylint: disable=protected-access
  got = tier.gather(entries, 8)
  for f, (shape, _) in FIELDS.items():
    g = np.asarray(got[f])
    assert g.shape == shape[:2] + (8,) + shape[2:]
    for j, h in enumerate((12, 14, 15, 16)):
      i = hashes.index(h)
      np.testing.assert_array_equal(g[:, :, j], src[f][:, :, index[i]])
  if pinned:
    assert all(p.sharding.memory_kind == "pinned_host" for p in tier.pages.values())


def test_an_engine_with_a_pinned_pool_equals_no_caching(monkeypatch):
  """The pinned path end to end on this CPU: greedy outputs equal no caching, host hits
  happen, events replayed equal both tiers after every step."""
  import host_tier_support as ht  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(host_tier, "host_memory_kind", lambda d: "pinned_host")
  prompts = ht.conversations(1, num=4, turns=2)
  eng = ht.make()
  assert eng._tiers.host.memory_kind == "pinned_host"  # pylint: disable=protected-access
  assert ht.run(eng, prompts, ht.Replay()) == ht.reference(prompts)
  assert eng.metrics()["prefix_host_hit_tokens"] > 0


def _consume_then_fail(real, fail_on):
  """A `_stash` that fails on its `fail_on`-th call after taking the donated pool (as a
  device error inside the copy would): the pool's arrays deleted, then an error."""
  calls = {"n": 0}

  def stash(pools, *args):
    calls["n"] += 1
    if calls["n"] == fail_on:
      for p in pools.values():
        p.delete()
      raise RuntimeError("injected: the device-to-host copy failed")
    return real(pools, *args)
  return stash, calls


def test_a_store_whose_copy_took_the_pool_and_failed_leaves_an_empty_usable_tier(
    monkeypatch):
  """The pinned pool is donated to `_stash`: when the copy fails after taking it, the
  blocks it held are gone, so the tier starts again empty ("removed" for the blocks of
  the failed store, then "cleared"), its pool live in pinned memory, and stores again."""
  cpu = jax.devices("cpu")[0]
  monkeypatch.setattr(host_tier, "host_memory_kind", lambda d: "pinned_host")
  tier = host_tier.HostTier(4, 16, FIELDS, device=cpu)
  rng = np.random.default_rng(1)
  src = jax.device_put(_blocks(rng, 3), cpu)
  tier.store(_meta([1, 2], 16), src, index=[0, 1])
  tier.take_events()
  stash, calls = _consume_then_fail(host_tier._stash, fail_on=1)  # pylint: disable=protected-access
  monkeypatch.setattr(host_tier, "_stash", stash)
  with pytest.raises(RuntimeError, match="injected"):
    tier.store(_meta([3], 16), src, index=[2])
  assert calls["n"] == 1 and tier.hashes() == {} and tier.num_free == 4
  assert [(e.kind, e.block_hashes) for e in tier.take_events()] == [
      ("stored", (3,)), ("removed", (3,)), ("cleared", ())]
  assert all(not p.is_deleted() and p.sharding.memory_kind == "pinned_host"
             for p in tier.pages.values())
  tier.store(_meta([4], 16), src, index=[2])          # the rebuilt pool serves
  got = tier.gather([tier._lru[4]], 2)  # pylint: disable=protected-access
  for f in FIELDS:
    np.testing.assert_array_equal(np.asarray(got[f])[:, :, 0], np.asarray(src[f])[:, :, 2])


def test_an_engine_whose_host_store_fails_keeps_serving_exactly(monkeypatch):
  """The same failure inside an engine step: the step raises it, the device's counts and
  the blocks it brought back still stand, the events still equal both tiers, and every
  request then finishes with the outputs of no caching."""
  import host_tier_support as ht  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(host_tier, "host_memory_kind", lambda d: "pinned_host")
  prompts = ht.conversations(2, num=3, turns=2)
  ref = ht.reference(prompts)
  eng, replay = ht.make(), ht.Replay()
  stash, calls = _consume_then_fail(host_tier._stash, fail_on=2)  # pylint: disable=protected-access
  monkeypatch.setattr(host_tier, "_stash", stash)
  ids = [eng.add_request(p, ht.greedy()) for p in prompts]
  outs, failures = {}, 0
  while eng.has_unfinished():
    try:
      outs.update({o.request_id: o.outputs for o in eng.step()})
    except RuntimeError as e:
      assert "injected" in str(e)
      failures += 1
    replay.apply(eng.kv_events())
    assert replay.tiers == ht.truth(eng)
    ht.assert_counts_exact(eng)
  assert failures == 1 and calls["n"] > 2        # it failed once, then stored again
  assert [outs[i] for i in ids] == ref


# ---- compiled for an H200 and a TPU v6e, without a device -----------------------------

def _avals(device, num_host_blocks):
  mesh = Mesh(np.array([device]), ("x",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  sds = jax.ShapeDtypeStruct
  pools = {f: sds((num_host_blocks, host_tier.block_rows(s), host_tier.LANES), d,
                  sharding=host) for f, (s, d) in FIELDS.items()}
  idx = sds((STEP_BLOCKS,), jnp.int32, sharding=dev)
  blocks = {f: sds(s[:2] + (STEP_BLOCKS,) + s[2:], d, sharding=dev)
            for f, (s, d) in FIELDS.items()}
  return pools, idx, blocks


def _traced(direction, device, num_host_blocks):
  pools, idx, blocks = _avals(device, num_host_blocks)
  if direction == "fetch":
    shapes = tuple((f, s) for f, (s, _) in FIELDS.items())
    return host_tier._fetch.trace(  # pylint: disable=protected-access
        pools, idx, shapes=shapes)
  return host_tier._stash.trace(pools, idx, idx, blocks)  # pylint: disable=protected-access


def _compile(target, direction, num_host_blocks):
  """(optimized HLO text, memory stats) of one transfer compiled for `target`."""
  if target == "v6e":
    with tt.tpu_target("v6e") as dev:
      c = _traced(direction, dev, num_host_blocks).lower().compile()
      return c.as_text(), c.memory_analysis()
  from jax._src import compiler  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client as xc  # pylint: disable=g-import-not-at-top
  lowered = _traced(direction, jax.devices("cpu")[0], num_host_blocks).lower(
      lowering_platforms=("cuda",))
  dev = gt.gpu_device("h200")
  options = compiler.get_compile_options(1, 1, device_assignment=np.array([[dev]]),
                                         backend=dev.client)
  exe = compiler.backend_compile_and_load(dev.client, lowered.compiler_ir("stablehlo"),
                                          xc.DeviceList((dev,)), options, [])
  return exe.hlo_modules()[0].to_string(), exe.get_compiled_memory_stats()


def _pool_arrays(text, num_host_blocks):
  """Every array type of the pool's shape in the HLO text, with its layout."""
  shape = rf"\b(?:bf16|f32)\[{num_host_blocks},\d+,{host_tier.LANES}\]"
  return re.findall(shape + r"\{[^}]*\}", text)


TARGETS = [
    pytest.param("h200", marks=pytest.mark.skipif(gt.unavailable_reason() is not None,
                                                  reason=str(gt.unavailable_reason()))),
    pytest.param("v6e", marks=pytest.mark.skipif(tt.unavailable_reason() is not None,
                                                 reason=str(tt.unavailable_reason()))),
]


@pytest.mark.parametrize("direction", ["fetch", "stash"])
@pytest.mark.parametrize("target", TARGETS)
def test_deviceless_transfers_are_host_memory_copies(target, direction):
  stats = {}
  for nh in POOLS:
    text, stats[nh] = _compile(target, direction, nh)
    pool = _pool_arrays(text, nh)
    assert pool and all("S(5)" in a for a in pool), (target, direction, nh, pool[:4])
    op = "dynamic-slice" if direction == "fetch" else "dynamic-update-slice"
    # The copy: an asynchronous start of the slice (GPU: a fusion-start calling the
    # wrapped op; TPU: the op's own -start) on the host buffer.
    starts = [l for l in text.splitlines() if re.search(r"-start\b|fusion-start\(", l)
              and op in l and "S(5)" in l]
    assert starts, (target, direction)
  small, big = (stats[nh] for nh in POOLS)
  pool_bytes = lambda nh: sum(nh * host_tier.block_rows(s) * host_tier.LANES
                              * np.dtype(d).itemsize for s, d in FIELDS.values())
  assert big.host_argument_size_in_bytes - small.host_argument_size_in_bytes >= (
      pool_bytes(POOLS[1]) - pool_bytes(POOLS[0]))
  for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
    grow = getattr(big, name) - getattr(small, name)
    # TPU temp varies a little with scheduling; a pool-sized buffer would add 4x the
    # smaller pool.
    assert grow <= pool_bytes(POOLS[0]) // 8, (target, direction, name, small, big)
