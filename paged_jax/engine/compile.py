"""The engine's jitted step, compiled: built once per step-shaping options and shared by
the engines that agree on them (`engine_step`), ahead-of-time compilation of its shape
buckets (`CompiledStep.compile_ahead`, public as `Engine.compile_buckets`),
`step_for_compile` for lowering without a device, and `release_compiled`.

Each shape bucket runs on a jit of its own, held in the process's executable budget
(`paged_jax.executables.BUDGET`): `CompiledStep.executable` is the hook every dispatch
calls, and the budget releases the least recently used shapes' executables before the
process runs out of memory maps (XLA:CPU maps each executable's kernels apart: ~650
maps a step shape; Linux allows 65,530). A released shape compiles again when it comes
back, or loads from `paged_jax.compile_cache` when that is on.

    fn, args = step_for_compile(model_config, cache_config, max_num_batched_tokens=256)
    fn.trace(*args).lower().compile()     # no array is allocated

    shapes = reachable_buckets(engine.buckets, max_rows=8, max_len=256)
    engine.compile_buckets(shapes)        # every shape compiled before serving
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
import weakref
from typing import Any, Callable, Dict, Sequence, Tuple

import jax

from paged_jax import executables
from paged_jax import kv_cache
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.engine.buckets import Bucket, StepBuckets, attention_reads_width, step_buckets
from paged_jax.engine.inputs import empty_inputs, input_shapes, lookup_len
from paged_jax.engine.options import EngineOptions
from paged_jax.engine.step import StepInputs, init_state, make_step
from paged_jax.engine.packing import abstract_inputs, pack_inputs, packing
from paged_jax.engine.weights import param_shapes
from paged_jax.pool_sizing import sliding_pool_blocks
from paged_jax.prefix_cache import step as prefix_step

log = logging.getLogger("paged_jax.engine")


class CompiledStep:
  """One engine step, its per-shape jits and the record of what was compiled for it.

  Attributes:
    plain: the step function (`step.make_step(..., jit=False)`, its outputs packed into
      one buffer by `packing.packing`); each shape bucket runs on a jit of it of
      its own (`executable`).
    fn: the step jitted with the bucket's fields static (`step.make_step`), for lowering
      without arrays (`step_for_compile`, cost analysis); None where not needed.
    seen: Buckets the step was called or compiled with (their first call compiles).
  """

  def __init__(self, plain: Callable[..., Any], fn=None):
    self.plain = plain
    self.fn = fn
    self.seen: set = set()
    _LIVE.add(self)

  def executable(self, signature: int, bucket: Bucket):
    """The jit that runs `bucket` for arguments of `signature` (`arg_signature`): one
    call per dispatch. It comes from the process's executable budget, which first
    releases least recently used ones when the memory-map headroom is short; the
    state stays donated (argument 1)."""
    return executables.BUDGET.get((self, signature, bucket), functools.partial(
        executables.shape_jit, self.plain, donate_argnums=(1,), **bucket.step_kw))

  def caller(self, signature: int) -> "StepCall":
    """What an engine whose arguments have `signature` dispatches (see StepCall)."""
    return StepCall(self, signature)

  def note(self, bucket: Bucket, buckets: StepBuckets) -> bool:
    """Logs (INFO) the first call with `bucket`, the call that compiles it; True then."""
    if bucket in self.seen:
      return False
    self.seen.add(bucket)
    log.info("paged_jax engine: compiling step shape tokens=%d rows=%d width=%d blocks "
             "decode_only=%s all_greedy=%s prefix_light=%s prefix_admit_only=%s logprobs=%s "
             "spec=%s (%d shapes so far, at most %d)", *bucket, len(self.seen), buckets.max_variants)
    return True

  def forget(self) -> None:
    self.seen.clear()

  def compile_ahead(self, params, state, shapes, *, lookup_tokens: int,
                    max_seqs: int, all_greedy: Sequence[bool] = (False, True),
                    max_shapes: int) -> Dict[str, Any]:
    """Compiles the step for each shape in `shapes` x sampling variant in `all_greedy`
    whose executable is not live for arguments of `params` / `state`'s shapes:
    `executable(...).trace(abstract args).lower().compile()` fills the jit the engine's
    calls use, so no step of those shapes traces or compiles later (JAX 0.10 and 0.11)
    while the budget holds it (more shapes than the process can map release the
    first ones again). Nothing runs on the device. With prefix caching (`state.prefix`)
    each shape also compiles its `prefix_light` variant, and each mixed shape its
    `prefix_admit_only` one. At most `max_shapes` steps (else ValueError). Returns
    {"compiled", "already", "seconds"}."""
    lights = (((False, False), (True, False), (False, True)) if state.prefix is not None
              else ((False, False),))
    shapes = list(dict.fromkeys(Bucket(*tuple(s)[:4], bool(g), light, admit)
                                for s in shapes for g in dict.fromkeys(all_greedy)
                                for light, admit in lights if not (admit and s[3])))
    if len(shapes) > max_shapes:
      raise ValueError(f"{len(shapes)} shapes to compile, more than the bound {max_shapes}")
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    params = jax.tree_util.tree_map(abstract, params)
    state = jax.tree_util.tree_map(abstract, state)
    signature = arg_signature(params, state, lookup_tokens)
    t0, compiled, already = time.perf_counter(), 0, 0
    for bucket in shapes:
      if (self, signature, bucket) in executables.BUDGET:
        already += 1
        continue
      inputs = StepInputs(**{k: abstract(v) for k, v in empty_inputs(
          bucket.tokens, max_seqs, lookup_tokens, num_rows=bucket.rows).items()})
      t1 = time.perf_counter()
      self.executable(signature, bucket).trace(params, state,
                                               abstract_inputs(inputs)).lower().compile()
      self.seen.add(bucket)
      compiled += 1
      log.info("paged_jax engine: compiled step shape tokens=%d rows=%d width=%d blocks "
               "decode_only=%s all_greedy=%s prefix_light=%s prefix_admit_only=%s logprobs=%s "
               "spec=%s ahead of time in %.2f s (%d of %d)", *bucket,
               time.perf_counter() - t1, compiled + already, len(shapes))
    seconds = time.perf_counter() - t0
    log.info("paged_jax engine: %d step shapes compiled ahead of time (%d already) in %.1f s",
             compiled, already, seconds)
    return {"compiled": compiled, "already": already, "seconds": seconds}


class StepCall:
  """An engine's step call: `(params, state, inputs, *, width=None, decode_only=False,
  all_greedy=False, prefix_light=False, prefix_admit_only=False, logprobs=False,
  spec=False) -> (state, outputs)`, as
  the jitted step takes it, run by the bucket's own jit (`CompiledStep.executable`) with
  numpy inputs sent as one buffer and `outputs` a `packing.Packed` StepOutputs
  (`packing.fetch` brings it to the host in one transfer; its fields read as the
  StepOutputs'); `lower` / `trace` are the unpacked jitted step's, with the bucket's
  fields as static keywords."""

  def __init__(self, compiled: CompiledStep, signature: int):
    self.compiled, self.signature = compiled, signature

  def __call__(self, params, state, inputs: StepInputs, *, width=None, decode_only=False,
               all_greedy=False, prefix_light=False, prefix_admit_only=False, logprobs=False,
               spec=False):
    caching = state.prefix is not None
    bucket = Bucket(inputs.tokens.shape[0], inputs.row_slot.shape[0], width, decode_only,
                    all_greedy, prefix_light and caching, prefix_admit_only and caching,
                    logprobs, spec)
    return self.compiled.executable(self.signature, bucket)(params, state,
                                                            pack_inputs(inputs))

  def lower(self, *args, **kwargs):
    return self.compiled.fn.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self.compiled.fn.trace(*args, **kwargs)


_LIVE: "weakref.WeakSet[CompiledStep]" = weakref.WeakSet()   # for release_compiled
_STEPS: Dict[Tuple, CompiledStep] = {}   # step_key -> the shared step
_SIGNATURES: Dict[Tuple, int] = {}   # argument shapes -> a small int naming them


def arg_signature(params, state, lookup_tokens: int) -> int:
  """A small int naming the shapes and dtypes of (params, state) and the prefix lookup
  length: engines of one model share the step but not their state's shapes (pool,
  max_seqs), and each combination compiles executables of its own."""
  leaves, treedef = jax.tree_util.tree_flatten((params, state))
  key = (str(treedef), lookup_tokens,
         tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
  return _SIGNATURES.setdefault(key, len(_SIGNATURES))


def check_configs(model_config, cache_config) -> None:
  """One-line ValueError unless the configs are of the right types and the cache's
  layer / head shapes match the model's."""
  if not isinstance(model_config, ModelConfig):
    raise ValueError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
  if not isinstance(cache_config, CacheConfig):
    raise ValueError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
  for name in ("num_layers", "num_kv_heads", "head_dim"):
    if getattr(cache_config, name) != getattr(model_config, name):
      raise ValueError(f"cache_config.{name}={getattr(cache_config, name)} does not match "
                       f"the model's {name}={getattr(model_config, name)}")
  if cache_config.hybrid and (cache_config.sliding_layers != model_config.sliding_layers or
                              cache_config.sliding_window != model_config.sliding_window):
    raise ValueError(f"cache_config.sliding_layers={list(cache_config.sliding_layers)} / "
                     f"sliding_window={cache_config.sliding_window} must be the model's "
                     f"{list(model_config.sliding_layers)} / {model_config.sliding_window} "
                     f"(ModelConfig.cache_config(hybrid_kv=True) sets them)")


def check_hybrid(cache_config: CacheConfig, options: EngineOptions) -> None:
  """One-line ValueError unless hybrid KV's sliding pool can never run short for these
  options (the host plans with the main pool only) and preemption recomputes (swapping
  copies the main pool only)."""
  if not cache_config.hybrid:
    return
  if options.preemption_mode != "recompute":
    raise ValueError(f"preemption_mode must be 'recompute' with hybrid KV (sliding_layers), "
                     f"got {options.preemption_mode!r}")
  c = cache_config
  need = sliding_pool_blocks(c.sliding_window, c.block_size, c.max_seqs,
                             options.max_num_batched_tokens, options.decode_steps_per_sync,
                             c.num_blocks)
  if c.num_sliding_blocks < need:
    raise ValueError(f"num_sliding_blocks must be >= {need} (config.sliding_pool_blocks for "
                     f"these max_seqs, max_num_batched_tokens, decode_steps_per_sync, "
                     f"num_blocks), got {c.num_sliding_blocks}")


def step_key(model_config: ModelConfig, cache_config: CacheConfig,
             options: EngineOptions) -> Tuple:
  """What the jitted step depends on: the model, the options that shape its program
  (attention backend, decode steps, beam candidates, the eviction bound prefix caching
  derives from the token budget) and a custom forward. Options that only steer the
  host (preemption, buckets, prefix-table probing) are not in it."""
  candidates = min(model_config.vocab_size, 2 * options.max_beam_width)
  max_evict = (prefix_step.max_new_blocks(options.max_num_batched_tokens, cache_config.max_seqs,
                                          cache_config.block_size, options.decode_steps_per_sync)
               if cache_config.enable_prefix_caching else 0)
  spec = options.speculative_config
  return (model_config, options.attention_backend, options.decode_steps_per_sync, candidates,
          max_evict, options.model_apply, cache_config.sliding_window or 0,
          cache_config.sliding_layers, spec.num_speculative_tokens if spec else 0)


def engine_step(model_config: ModelConfig, cache_config: CacheConfig,
                options: EngineOptions) -> Tuple[CompiledStep, StepBuckets]:
  """The engine's step for these options (shared by engines of one model and the same
  `step_key`, a module-level custom `model_apply` included; one of its own with any other
  custom `model_apply`, e.g. a closure over a mesh) and its shape buckets."""
  from paged_jax.models.llama import LlamaForCausalLM  # pylint: disable=g-import-not-at-top
  check_configs(model_config, cache_config)
  check_hybrid(cache_config, options)
  key = step_key(model_config, cache_config, options)
  _, _, steps, candidates, max_evict, model_apply, _, sliding_layers, num_spec = key
  buckets = step_buckets(cache_config, options.max_num_batched_tokens, steps,
                         options.shape_buckets, options.decode_shape,
                         width_buckets=(options.width_buckets
                                        if options.width_buckets is not None else
                                        attention_reads_width(_resolve_backend(
                                            options.attention_backend, model_config,
                                            cache_config, None))),
                         speculative=num_spec > 0)
  kw = dict(num_decode_steps=steps, num_candidates=candidates, max_evict=max_evict,
            sliding_layers=sliding_layers, num_spec_tokens=num_spec)
  # Dispatches send and fetch one buffer each (packing.py).
  make = lambda apply, **more: CompiledStep(packing(make_step(apply, jit=False, **more, **kw)),
                                            make_step(apply, **more, **kw))
  if model_apply is not None:  # e.g. the tensor-parallel forward (paged_jax.distributed)
    name = getattr(model_apply, "__qualname__", "custom").replace(".", "_")
    if not _module_level(model_apply):   # per-engine state may hide in it: never shared
      return make(model_apply, name=name), buckets
    if key not in _STEPS:   # e.g. models.standin.apply: every engine of a sweep shares it
      _STEPS[key] = make(model_apply, name=name)
    return _STEPS[key], buckets
  if key not in _STEPS:
    model = LlamaForCausalLM(model_config, attention_backend=options.attention_backend)
    _STEPS[key] = make(model.apply)
  return _STEPS[key], buckets


def _module_level(fn) -> bool:
  """A plain function defined at a module's top level (no closure, no bound object)."""
  return (inspect.isfunction(fn) and "<locals>" not in fn.__qualname__
          and fn.__closure__ is None)


def step_for_compile(model_config: ModelConfig, cache_config: CacheConfig, *, sharding=None,
                     **engine_options):
  """The engine's jitted step and `jax.ShapeDtypeStruct` arguments (params, state,
  inputs) for it, so the whole step lowers and compiles for a device that is not
  present: `fn.trace(*args).lower().compile()`. No array is allocated.

  Args:
    sharding: optional `jax.sharding.Sharding` placed on every argument, or a pytree of
      Shardings over a prefix of (params, state, inputs), each placed on the subtree at
      its place (tensor parallelism: `paged_jax.distributed.tp_step_for_compile`). Its
      device decides `attention_backend="auto"` (and a family-"auto" "pallas"): the
      kernels of that device's platform (`attention.resolve_step_backend`), never the
      host's. Without it "auto" decides when the step is traced, by the target device.
    engine_options: as for `Engine` (EngineOptions' fields, or `options=`); the largest
      bucket is used: T = budget, R = max_seqs, W = max_blocks_per_seq, ragged attention.
  """
  options = EngineOptions.of(engine_options.pop("options", None), **engine_options)
  target = _first_sharding(sharding)
  if target is not None and options.model_apply is None:
    options = dataclasses.replace(options, attention_backend=step_backend(
        options.attention_backend, model_config, cache_config, target))
  compiled, buckets = engine_step(model_config, cache_config, options)
  params = param_shapes(model_config)
  # The TPU kernels' scale layout when they run there (kv_cache.scale_rows_for).
  rows = kv_cache.scale_rows_for(options.attention_backend, target)
  state = jax.eval_shape(lambda: init_state(cache_config, scale_rows=rows))
  inputs = input_shapes(buckets.tokens[-1], cache_config.max_seqs,
                        lookup_len(cache_config, options.max_num_batched_tokens))
  args = (params, state, inputs)
  if sharding is not None:   # each Sharding placed on the subtree of args at its place
    put = lambda s, sub: jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sub)
    args = jax.tree_util.tree_map(put, sharding, args, is_leaf=_is_sharding)
  return compiled.fn, args


def step_backend(backend: str, model_config: ModelConfig, cache_config: CacheConfig,
                 where) -> str:
  """The attention spelling `backend` stands for in this model's step on the device of
  `where` (a Device or Sharding); logged at INFO when it differs."""
  chosen = _resolve_backend(backend, model_config, cache_config, where)
  if chosen != backend:
    log.info("paged_jax engine: attention_backend=%s -> %s for %s", backend, chosen,
             getattr(_first_device(where), "device_kind", where))
  return chosen


def _resolve_backend(backend: str, model_config: ModelConfig, cache_config: CacheConfig,
                     where) -> str:
  from paged_jax.attention import resolve_step_backend  # pylint: disable=g-import-not-at-top
  return resolve_step_backend(
      backend, num_q_heads=model_config.num_heads, num_kv_heads=model_config.num_kv_heads,
      head_dim=model_config.head_dim, block_size=cache_config.block_size,
      q_dtype=model_config.dtype, page_dtype=cache_config.dtype,
      quantized=cache_config.quantized, where=where)


def _is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def _first_sharding(sharding):
  """The first Sharding of `sharding` (a Sharding or a pytree of them), or None."""
  leaves = jax.tree_util.tree_leaves(sharding, is_leaf=_is_sharding)
  return next((x for x in leaves if _is_sharding(x)), None)


def _first_device(where):
  devices = getattr(where, "device_set", None)
  return min(devices, key=lambda d: d.id) if devices else where


def release_compiled() -> None:
  """Drops every compiled executable (the budget's per-shape jits, `jax.clear_caches()`)
  and the records of what was compiled, so a long run that moves between engine
  geometries (a serving sweep's systems, the demo's stages) holds only the current one's
  executables. (The budget bounds the engine steps anyway; this also drops every other
  jit's and frees their memory.)"""
  executables.BUDGET.release()
  jax.clear_caches()
  for step in list(_LIVE):
    step.forget()
