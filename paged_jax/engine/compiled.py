"""The engine's jitted step built from its options (shared across engines of one
model), parameter checks, and `step_for_compile` for ahead-of-time lowering.

    fn, args = step_for_compile(model_config, cache_config, max_num_batched_tokens=256)
    fn.trace(*args).lower().compile()     # no array is allocated

    shapes = reachable_buckets(engine._buckets, max_rows=8, max_len=256)
    compile_buckets(engine, shapes)       # every shape compiled before serving (both
                                          # sampling variants unless all_greedy= says)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax

from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.engine.inputs import Bucket, StepBuckets, empty_inputs, input_shapes
from paged_jax.engine.scheduler import PREEMPTION_MODES
from paged_jax.engine.step import StepInputs, init_state, make_step
from paged_jax.prefix_cache import step as prefix_step

log = logging.getLogger("paged_jax.engine")
_STEP_CACHE: Dict[Any, Any] = {}   # options -> jitted step
_SEEN_BUCKETS: Dict[Any, set] = {}   # id(jitted step) -> shape buckets it was called with
_AOT_DONE: set = set()   # (id(jitted step), argument shapes, bucket) compiled ahead of time


def note_bucket(step_fn, bucket, buckets: StepBuckets) -> bool:
  """Logs (INFO) the first call of `step_fn` with `bucket` (T, R, W, decode_only,
  all_greedy), i.e. the call that compiles it; True then. Engines sharing a step share
  the record."""
  seen = _SEEN_BUCKETS.setdefault(id(step_fn), set())
  if bucket in seen:
    return False
  seen.add(bucket)
  log.info("paged_jax engine: compiling step shape tokens=%d rows=%d width=%d blocks "
           "decode_only=%s all_greedy=%s (%d shapes so far, at most %d)", *bucket, len(seen),
           buckets.max_variants)
  return True


def _check_options(model_config, cache_config, max_num_batched_tokens, decode_steps_per_sync,
                   preemption_mode, max_beam_width) -> None:
  if not isinstance(model_config, ModelConfig):
    raise ValueError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
  if not isinstance(cache_config, CacheConfig):
    raise ValueError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
  for name in ("num_layers", "num_kv_heads", "head_dim"):
    if getattr(cache_config, name) != getattr(model_config, name):
      raise ValueError(f"cache_config.{name}={getattr(cache_config, name)} does not match "
                       f"the model's {name}={getattr(model_config, name)}")
  for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                      ("decode_steps_per_sync", decode_steps_per_sync),
                      ("max_beam_width", max_beam_width)):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**20:
      raise ValueError(f"{name} must be an int in [1, {2**20}], got {value!r}")
  if preemption_mode not in PREEMPTION_MODES:
    raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                     f"got {preemption_mode!r}")


def step_buckets(cache_config: CacheConfig, max_num_batched_tokens: int,
                 decode_steps_per_sync: int, shape_buckets: bool = True) -> StepBuckets:
  """The step's shape buckets (tokens, rows, block-table widths; see StepBuckets)."""
  return StepBuckets.make(max_seqs=cache_config.max_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_blocks_per_seq=cache_config.max_blocks_per_seq,
                          block_size=cache_config.block_size,
                          decode_steps=decode_steps_per_sync, enabled=shape_buckets)


def lookup_len(cache_config: CacheConfig, max_num_batched_tokens: int) -> int:
  """LK: prompt tokens looked up in the prefix cache per step (1 without caching)."""
  if not cache_config.enable_prefix_caching:
    return 1
  return max(max_num_batched_tokens, cache_config.max_seq_len)


def engine_step(model_config: ModelConfig, cache_config: CacheConfig, *,
                max_num_batched_tokens: int = 256, decode_steps_per_sync: int = 1,
                preemption_mode: str = "recompute", attention_backend: str = "auto",
                max_beam_width: int = 4, model_apply: Optional[Callable[..., Any]] = None,
                shape_buckets: bool = True, jit: bool = True
                ) -> Tuple[Callable[..., Any], StepBuckets]:
  """Validates the engine options and returns (jitted step, its shape buckets)."""
  from paged_jax.attention import resolve_backend  # pylint: disable=g-import-not-at-top
  from paged_jax.models.llama import LlamaForCausalLM  # pylint: disable=g-import-not-at-top
  _check_options(model_config, cache_config, max_num_batched_tokens, decode_steps_per_sync,
                 preemption_mode, max_beam_width)
  resolve_backend(attention_backend)
  candidates = min(model_config.vocab_size, 2 * max_beam_width)
  max_evict = (prefix_step.max_new_blocks(max_num_batched_tokens, cache_config.max_seqs,
                                          cache_config.block_size, decode_steps_per_sync)
               if cache_config.enable_prefix_caching else 0)
  kw = dict(num_decode_steps=decode_steps_per_sync, num_candidates=candidates,
            max_evict=max_evict, jit=jit)
  buckets = step_buckets(cache_config, max_num_batched_tokens, decode_steps_per_sync,
                         shape_buckets)
  if model_apply is not None:  # e.g. the tensor-parallel forward (paged_jax.distributed)
    name = getattr(model_apply, "__qualname__", "custom").replace(".", "_")
    return make_step(model_apply, name=name, **kw), buckets
  key = (model_config, attention_backend, decode_steps_per_sync, candidates, max_evict, jit)
  if key not in _STEP_CACHE:  # engines of one model share compiled steps
    model = LlamaForCausalLM(model_config, attention_backend=attention_backend)
    _STEP_CACHE[key] = make_step(model.apply, **kw)
  return _STEP_CACHE[key], buckets


def param_shapes(model_config: ModelConfig):
  """The model's parameter tree as ShapeDtypeStructs ({"params": ...}); allocates nothing."""
  from paged_jax.models import llama  # pylint: disable=g-import-not-at-top
  return jax.eval_shape(lambda: llama.init_params(model_config, jax.random.key(0)))


def check_params(model_config: ModelConfig, params):
  """`params` as {"params": tree}; a one-line ValueError naming the first leaf whose
  path or shape does not fit `model_config`."""
  if not hasattr(params, "keys"):
    raise ValueError(f"params must be a dict of arrays, got {type(params).__name__}")
  params = params if "params" in params else {"params": params}
  want = dict(jax.tree_util.tree_flatten_with_path(param_shapes(model_config))[0])
  got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  name = lambda path: jax.tree_util.keystr(path)
  for path in want:
    if path not in got:
      raise ValueError(f"params lack {name(path)} of shape {want[path].shape} "
                       f"(model_config: {model_config.num_layers} layers, hidden "
                       f"{model_config.hidden_size})")
    shape = tuple(getattr(got[path], "shape", ()))
    if shape != tuple(want[path].shape):
      raise ValueError(f"params{name(path)} has shape {shape}, the model_config needs "
                       f"{tuple(want[path].shape)}")
  extra = [p for p in got if p not in want]
  if extra:
    raise ValueError(f"params hold {name(extra[0])}, which the model_config has no place for")
  return params


def step_for_compile(model_config: ModelConfig, cache_config: CacheConfig, *, sharding=None,
                     **engine_options):
  """The engine's jitted step and `jax.ShapeDtypeStruct` arguments (params, state,
  inputs) for it, so the whole step lowers and compiles for a device that is not
  present: `fn.trace(*args).lower().compile()`. No array is allocated.

  Args:
    sharding: optional `jax.sharding.Sharding` placed on every argument.
    engine_options: as for `Engine` (max_num_batched_tokens, decode_steps_per_sync,
      attention_backend, max_beam_width, ...; the largest bucket is used: T = budget,
      R = max_seqs, W = max_blocks_per_seq, ragged attention).
  """
  opts = dict(engine_options)
  for k in ("max_probe", "hash_mode", "init_state"):
    opts.pop(k, None)
  fn, buckets = engine_step(model_config, cache_config, **opts)
  budget = engine_options.get("max_num_batched_tokens", 256)
  params = param_shapes(model_config)
  state = jax.eval_shape(lambda: init_state(cache_config))
  inputs = input_shapes(buckets.tokens[-1], cache_config.max_seqs,
                        lookup_len(cache_config, budget))
  args = (params, state, inputs)
  if sharding is not None:
    args = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
  return fn, args


def reachable_buckets(buckets: StepBuckets, *, max_rows: int, max_len: int,
                      lanes_per_row: int = 1) -> List[Bucket]:
  """The shape buckets (T, R, W, decode_only; all_greedy False) a step can land on when at most `max_rows`
  sequences are live and none is longer than `max_len` tokens (as `StepBuckets.pick`
  would choose them), smallest first.

  `lanes_per_row` > 1 (parallel sampling: n children sample from their leader's row)
  lets the sampled lanes outnumber the chunks; with 1, a mixed step of T tokens has
  at most T - 1 rows (one chunk has >= 2 tokens), which drops (T, R) pairs with
  R > T. A frees-only step is decode_only at the smallest row bucket.
  """
  if max_rows < 1 or max_len < 1 or lanes_per_row < 1:
    raise ValueError(f"max_rows, max_len and lanes_per_row must be >= 1, got "
                     f"{max_rows}, {max_len}, {lanes_per_row}")
  if not buckets.enabled:   # one shape: the largest
    return [Bucket(buckets.tokens[-1], buckets.rows[-1], buckets.widths[-1], False)]
  max_rows = min(max_rows, buckets.rows[-1])
  rows = sorted({buckets.pick(1, k, 1, True).rows for k in range(1, max_rows + 1)})
  width_max = buckets.pick(1, 1, max_len, False).width
  out = []
  for w in (w for w in buckets.widths if w <= width_max):
    for r in rows:
      out.append(Bucket(r, r, w, True))
      fewest_rows = max([b for b in buckets.rows if b < r], default=0) + 1
      for t in (t for t in buckets.tokens if t >= 2):
        # A mixed step has a chunk of >= 2 tokens, so <= T - 1 chunks, each sampling
        # at most lanes_per_row slots.
        if fewest_rows <= min((t - 1) * lanes_per_row, max_rows):
          out.append(Bucket(t, r, w, False))
  return sorted(out, key=lambda b: (b.decode_only, b.tokens, b.rows, b.width))


def release_compiled() -> None:
  """Drops every compiled executable (`jax.clear_caches()`) and the records of what was
  compiled, so a long run that moves between engine geometries (a serving sweep's
  systems, the demo's stages) holds only the current one's executables. XLA:CPU maps
  each executable's code into memory regions of its own: a process that keeps compiling
  reaches Linux's per-process map limit (vm.max_map_count, 65,530) and LLVM aborts
  ("Cannot allocate memory"), as two serving sweeps of ~90 compiled steps each did."""
  jax.clear_caches()
  _AOT_DONE.clear()
  _SEEN_BUCKETS.clear()


def compile_buckets(engine, shapes, *, all_greedy: Sequence[bool] = (False, True),
                    max_shapes: Optional[int] = None) -> Dict[str, Any]:
  """Compiles `engine`'s step ahead of time for each shape bucket in `shapes` (from
  `reachable_buckets`) and each sampling variant in `all_greedy` (False: sampling
  requests run; True: every running request is greedy), not yet compiled for
  arguments of its shapes (params, state):
  `jit(...).trace(abstract args).lower().compile()` fills the cache the engine's calls
  use, so no step of those shapes traces or compiles later (JAX 0.10 and 0.11). Nothing
  runs on the device; the state is untouched.

  Bounded: at most `max_shapes` (default the engine's `max_variants`) compiled steps;
  logged at INFO per step and in total. Returns {"compiled", "already", "seconds"}.
  """
  step_fn, buckets = engine._step, engine._buckets   # pylint: disable=protected-access
  bound = buckets.max_variants if max_shapes is None else max_shapes
  shapes = list(dict.fromkeys(Bucket(*tuple(s)[:4], bool(g)) for s in shapes
                              for g in dict.fromkeys(all_greedy)))
  if len(shapes) > bound:
    raise ValueError(f"{len(shapes)} shapes to compile, more than the bound {bound}")
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  params = jax.tree_util.tree_map(abstract, engine.params)
  state = jax.tree_util.tree_map(abstract, engine.state)
  seen = _SEEN_BUCKETS.setdefault(id(step_fn), set())
  lk = engine._lookup_len   # pylint: disable=protected-access
  # Engines of one model share the jitted step but not their state's shapes (pool,
  # max_seqs): a compiled shape is keyed by both.
  leaves, treedef = jax.tree_util.tree_flatten((params, state))
  signature = (id(step_fn), str(treedef), lk,
               tuple((x.shape, str(x.dtype)) for x in leaves))
  t0, compiled, already = time.perf_counter(), 0, 0
  for bucket in shapes:
    if (signature, bucket) in _AOT_DONE:
      already += 1
      continue
    tokens, rows, width, decode_only, greedy = bucket
    inputs = StepInputs(**{k: abstract(v) for k, v in empty_inputs(
        tokens, engine.cache_config.max_seqs, lk, num_rows=rows).items()})
    t1 = time.perf_counter()
    step_fn.trace(params, state, inputs, width=width, decode_only=decode_only,
                  all_greedy=greedy).lower().compile()
    seen.add(bucket)
    _AOT_DONE.add((signature, bucket))
    compiled += 1
    log.info("paged_jax engine: compiled step shape tokens=%d rows=%d width=%d blocks "
             "decode_only=%s all_greedy=%s ahead of time in %.2f s (%d of %d)", *bucket,
             time.perf_counter() - t1, compiled + already, len(shapes))
  seconds = time.perf_counter() - t0
  log.info("paged_jax engine: %d step shapes compiled ahead of time (%d already) in %.1f s",
           compiled, already, seconds)
  return {"compiled": compiled, "already": already, "seconds": seconds}
