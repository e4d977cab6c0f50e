"""The serving `Engine` with its model split over a `tp` mesh.

    mesh = make_mesh(tp=4)
    engine = make_tp_engine(model_config, params, cache_config, mesh=mesh)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))

The engine's device step stays ONE jitted program (`engine.step.make_step`):
block-manager ops run on the replicated `BlockState` (every device sees the
same block tables, no communication), copy-on-write runs on the KV-head-split
pages, and the model forward is `TensorParallelLlama.apply` (shard_map inside
the jit). Host-side scheduling is untouched: the sharded engine is the same
`Engine` object, so outputs match the one-device engine token for token up to
all-reduce rounding.

How it plugs in: `Engine` builds its step from `LlamaForCausalLM.apply` and its
state with `kv_cache.init` on one device, and takes no hook for either. This
module builds the engine with a one-block stand-in cache (so the full cache is
never materialised on one device), then installs the real cache config, the
sharded state, the sharded params and a step made from the tensor-parallel
apply. `_check_engine_layout` fails loudly if the engine's internals move.
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.distributed.mesh import validate_tp, tp_size
from paged_jax.distributed.tp_forward import TensorParallelLlama

log = logging.getLogger("paged_jax.distributed")

_ENGINE_FIELDS = ("_step", "state", "params", "cache_config", "num_free", "decode_steps_per_sync",
                  "_num_candidates")


def _check_engine_layout(engine) -> None:
  missing = [f for f in _ENGINE_FIELDS if not hasattr(engine, f)]
  if missing:
    raise RuntimeError(
        f"paged_jax.engine.Engine no longer has {missing}: update "
        "paged_jax/distributed/tp_engine.py to the engine's new hooks")


def init_replicated_blocks(cache_config: CacheConfig, mesh: Mesh) -> bm.BlockState:
  """BlockState created directly replicated on `mesh` (works across processes too)."""
  return jax.jit(lambda: bm.init(cache_config), out_shardings=NamedSharding(mesh, P()))()


def make_tp_engine(model_config: ModelConfig, params, cache_config: CacheConfig, *,
                   mesh: Mesh, attention_backend: str = "auto", **engine_kwargs):
  """An `Engine` whose model and KV pages are split over `mesh`'s `tp` axis.

  Args:
    model_config, params, cache_config: as for `Engine` (full, unsharded params
      tree, or one already placed by `shard_params`); `cache_config.num_blocks` is
      the pool size, each device holding 1/tp of every block.
    mesh: a 1-D ('tp',) mesh (`make_mesh(tp=...)`, or one of `dp_submeshes`).
    attention_backend, engine_kwargs: passed to `Engine` (max_num_batched_tokens,
      decode_steps_per_sync, preemption_mode, max_beam_width).
  Raises:
    ValueError: the model or cache does not split tp ways (before device work).
  """
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.step import EngineState, make_step  # pylint: disable=g-import-not-at-top
  tp = tp_size(mesh)
  validate_tp(model_config, tp, cache_config)
  tp_model = TensorParallelLlama(model_config, mesh, attention_backend=attention_backend)
  # A one-block stand-in cache: Engine allocates its own (unsharded) pages at init.
  engine = Engine(model_config, params, cache_config.replace(num_blocks=1),
                  attention_backend=attention_backend, **engine_kwargs)
  _check_engine_layout(engine)
  engine.cache_config = cache_config
  engine.num_free = cache_config.num_blocks
  engine.params = tp_model.shard_params(engine.params)
  state = EngineState(blocks=init_replicated_blocks(cache_config, mesh),
                      pages=tp_model.init_pages(cache_config))
  if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(engine.state):
    raise RuntimeError(
        "the engine's state has fields this module does not shard "
        f"({jax.tree_util.tree_structure(engine.state)}): update paged_jax/distributed/tp_engine.py")
  engine.state = state
  engine._step = make_step(tp_model.apply, num_decode_steps=engine.decode_steps_per_sync,  # pylint: disable=protected-access
                           num_candidates=engine._num_candidates, name=f"tp{tp}_engine_step")  # pylint: disable=protected-access
  engine.mesh = mesh
  engine.tp_model = tp_model
  log.info("tensor-parallel engine: tp=%d over %s; %d blocks, %.2f MiB KV per device",
           tp, [d.id for d in mesh.devices.flat], cache_config.num_blocks,
           cache_config.kv_cache_bytes / tp / 2**20)
  return engine
