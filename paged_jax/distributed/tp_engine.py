"""The serving `Engine` with its model split over a `tp` mesh.

    mesh = make_mesh(tp=4)
    engine = make_tp_engine(model_config, params, cache_config, mesh=mesh)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))

The engine's device step stays ONE jitted program (`engine.step.make_step`):
block-manager ops run on the replicated `BlockState` (every device sees the
same block tables, no communication), copy-on-write runs on the KV-head-split
pages, and the model forward is `TensorParallelDecoder.apply` (shard_map inside
the jit). Host-side scheduling is untouched: the sharded engine is the same
`Engine` object, so outputs match the one-device engine token for token up to
all-reduce rounding.

How it plugs in: `Engine` takes `model_apply` (the tensor-parallel forward) and
`init_state` (the replicated BlockState and KV-head-split pages, created directly on the
mesh, so the full cache never sits on one device).
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import block_manager as bm
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.distributed.mesh import validate_tp, tp_size
from paged_jax.distributed.sharding import kv_pages_specs, named, param_specs
from paged_jax.distributed.tp_forward import TensorParallelDecoder
from paged_jax.prefix_cache import step as prefix_step

log = logging.getLogger("paged_jax.distributed")


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
  from paged_jax.engine.state import EngineState, KVGroup  # pylint: disable=g-import-not-at-top
  tp = tp_size(mesh)
  validate_tp(model_config, tp, cache_config)
  tp_model = TensorParallelDecoder(model_config, mesh, attention_backend=attention_backend)
  params = params if "params" in params else {"params": params}

  def init_state(cfg: CacheConfig) -> EngineState:
    prefix = None
    if cfg.enable_prefix_caching:   # replicated, like the BlockState
      prefix = jax.jit(lambda: prefix_step.init(cfg), out_shardings=NamedSharding(mesh, P()))()
    return EngineState(groups=(KVGroup(init_replicated_blocks(cfg, mesh),
                                       tp_model.init_pages(cfg)),), prefix=prefix)

  engine = Engine(model_config, tp_model.shard_params(params), cache_config,
                  attention_backend=attention_backend, model_apply=tp_model.apply,
                  init_state=init_state, **engine_kwargs)
  engine.mesh = mesh
  engine.tp_model = tp_model
  log.info("tensor-parallel engine: tp=%d over %s; %d blocks, %.2f MiB KV per device",
           tp, [d.id for d in mesh.devices.flat], cache_config.num_blocks,
           cache_config.kv_cache_bytes / tp / 2**20)
  return engine


def tp_step_for_compile(model_config: ModelConfig, cache_config: CacheConfig, *, mesh: Mesh,
                        **engine_options):
  """`engine.step_for_compile` for the tensor-parallel step on `mesh` (a 1-D `tp` mesh,
  possibly of compile-only devices): (jitted step, ShapeDtypeStruct args placed as
  `make_tp_engine` places them: params Megatron-style, pages split by KV head, block
  state and inputs replicated). "auto" attention is decided by the mesh's devices.
  """
  from paged_jax.engine import compile as engine_compile  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.options import EngineOptions  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.state import EngineState, KVGroup  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.weights import param_shapes  # pylint: disable=g-import-not-at-top
  validate_tp(model_config, tp_size(mesh), cache_config)
  options = EngineOptions.of(engine_options.pop("options", None), **engine_options)
  replicated = NamedSharding(mesh, P())
  backend = engine_compile.step_backend(options.attention_backend, model_config,
                                        cache_config, replicated)
  tp_model = TensorParallelDecoder(model_config, mesh, attention_backend=backend)
  pages = jax.eval_shape(lambda: tp_model.init_pages(cache_config, abstract=True))
  state = EngineState(groups=(KVGroup(replicated, named(mesh, kv_pages_specs(pages))),),
                      prefix=replicated if cache_config.enable_prefix_caching else None)
  params = named(mesh, param_specs(param_shapes(model_config)))
  return engine_compile.step_for_compile(
      model_config, cache_config, sharding=(params, state, replicated), options=options,
      attention_backend=backend, model_apply=tp_model.apply)
