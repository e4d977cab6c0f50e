"""The engines the harness measures: the shipped tiny model on a KV budget, and warm-up.

    engine = engines.make_engine(block_size=16, kv_budget_tokens=2048, max_seqs=64)
    engines.warm_up(engine, requests)              # compile every reachable step shape
    engines.greedy(request)                        # SamplingParams for request.output_len

Sizes default to `scale.TINY` (256-token context, n / beam width up to 6, 256 tokens a
step). Everything here is flag-free (importable from tests and notebooks).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Sequence

from paged_jax.bench.scale import TINY


@functools.lru_cache(maxsize=2)
def tiny_model(checkpoint: Optional[str] = None):
  """(ModelConfig, params) of the shipped tiny byte-level Llama (or `checkpoint`)."""
  from paged_jax.models import DEFAULT_CHECKPOINT, load_hf_checkpoint  # pylint: disable=g-import-not-at-top
  return load_hf_checkpoint(checkpoint or DEFAULT_CHECKPOINT)


def make_engine(*, block_size: int, kv_budget_tokens: int, max_seqs: int = 64,
                max_len: int = TINY.max_len, preemption_mode: str = "recompute",
                attention_backend: str = "auto",
                max_num_batched_tokens: int = TINY.max_num_batched_tokens,
                max_beam_width: int = TINY.max_beam_width, checkpoint: Optional[str] = None,
                prefix_caching: bool = False, standin: bool = False,
                shape_buckets: bool = True, width_buckets: Optional[bool] = None):
  """An Engine over the tiny model whose KV pool holds `kv_budget_tokens` token slots
  (`prefix_caching`: automatic prefix caching on).

  `standin`: the same engine (geometry, shape buckets, scheduler) with the model's forward
  replaced by `models.standin` (nothing heavy to compile or run): it schedules exactly as
  the tiny model does on greedy requests without stop ids, for runs on a virtual clock
  that charge each step by its shape, not by what it computed. `shape_buckets=False`: one
  compiled step (the largest shape) instead of one per bucket; the scheduling is the same.
  `width_buckets`: `EngineOptions.width_buckets`.

  `kv_budget_tokens` must be a multiple of `block_size`. With `block_size ==
  max_len` every sequence takes one max_len-token block at admission: a
  contiguous Orca(Max) reservation served by the same engine.
  """
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  if kv_budget_tokens % block_size:
    raise ValueError(f"kv_budget_tokens must be a multiple of block_size={block_size}, "
                     f"got {kv_budget_tokens}")
  if kv_budget_tokens < max_len:
    raise ValueError(f"kv_budget_tokens must be >= max_len={max_len}, got {kv_budget_tokens}")
  model_config, params = tiny_model(checkpoint)
  extra = {}
  if standin:
    from paged_jax.models import standin as standin_lib  # pylint: disable=g-import-not-at-top
    model_config, params = _standin(model_config.vocab_size,
                                    model_config.max_position_embeddings)
    extra = dict(model_apply=standin_lib.apply)
    attention_backend = "reference"   # unused by the stand-in
  cache_config = model_config.cache_config(
      block_size=block_size, num_blocks=kv_budget_tokens // block_size, max_seqs=max_seqs,
      max_blocks_per_seq=-(-max_len // block_size), enable_prefix_caching=prefix_caching,
      max_num_batched_tokens=max_num_batched_tokens)   # sizes a hybrid model's sliding pool
  return Engine(model_config, params, cache_config, max_num_batched_tokens=max_num_batched_tokens,
                preemption_mode=preemption_mode, attention_backend=attention_backend,
                max_beam_width=max_beam_width, shape_buckets=shape_buckets,
                width_buckets=width_buckets, **extra)


@functools.lru_cache(maxsize=2)
def _standin(vocab_size: int, max_position_embeddings: int):
  from paged_jax.models import standin  # pylint: disable=g-import-not-at-top
  return standin.model(vocab_size, max_position_embeddings=max_position_embeddings)


def greedy(request) -> "SamplingParams":
  """Greedy decoding for `request.output_len` tokens (no stop id)."""
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  return SamplingParams(max_tokens=request.output_len, temperature=0.0)


def warm_up(engine, requests: Optional[Sequence] = None,
            params_fn: Optional[Callable] = None) -> Dict:
  """Compiles `engine`'s step, before anything is timed, for every shape bucket a run
  of `requests` can reach (`paged_jax.engine.reachable_buckets`), ahead of time:
  nothing runs on the device, the engine's state is untouched; logged at INFO.

  The reachable set: at most min(max_seqs, num_blocks) live sequences (each holds a
  block of its own; max_seqs when blocks can be shared: n > 1, beams, prefix caching),
  none longer than the longest request (prompt + output), n sampled lanes per row for
  parallel sampling; the all-greedy step variant if a request is greedy, the sampling
  one if a request samples. Without `requests`, any request the engine takes
  (max_model_len, n up to its max_beam_width, both variants).

  Args:
    engine: a `paged_jax.engine.Engine` (shape buckets on or off).
    requests: the workloads.Request list to be served (lengths), or None.
    params_fn: request -> SamplingParams (default greedy).
  Returns:
    {"shapes": steps in the set (with prefix caching each shape also as its `prefix_light`
    variant and each mixed shape as its `prefix_admit_only` one), "compiled", "already"
    (compiled before), "seconds"}.
  """
  from paged_jax.engine import reachable_buckets  # pylint: disable=g-import-not-at-top
  c = engine.cache_config
  if requests is None:
    max_len, lanes, shared = engine.max_model_len, engine.max_beam_width, True
    variants = (False, True)
  else:
    params = [(params_fn or greedy)(r) for r in requests]
    max_len = min(engine.max_model_len, max(r.total_len for r in requests))
    lanes = max(p.n if p.beam_width == 1 else 1 for p in params)
    shared = any(p.num_seqs > 1 for p in params)
    variants = tuple({p.temperature == 0 for p in params})
  shared = shared or engine.prefix_caching
  max_rows = c.max_seqs if shared else min(c.max_seqs, c.num_blocks)
  shapes = reachable_buckets(engine.buckets, max_rows=max_rows, max_len=max_len,
                             lanes_per_row=lanes)
  # compile_buckets adds each shape's prefix-cache variants: it counts them.
  done = engine.compile_buckets(shapes, all_greedy=variants)
  return dict(done, shapes=done["compiled"] + done["already"])


def generate_text(prompt: str, block_sizes: Sequence[int], *, max_tokens: int = 48,
                  kv_budget_tokens: int = 512) -> Dict[int, str]:
  """Greedy continuation of `prompt` by the shipped tiny model, once per block size.

  Returns {block_size: text}; PagedAttention is exact, so the texts must agree.
  """
  from paged_jax import tokenizer  # pylint: disable=g-import-not-at-top
  from paged_jax.engine import SamplingParams  # pylint: disable=g-import-not-at-top
  ids = tokenizer.encode(prompt)
  texts = {}
  for bs in block_sizes:
    engine = make_engine(block_size=bs, kv_budget_tokens=kv_budget_tokens, max_seqs=4)
    out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                stop_token_ids=(tokenizer.EOS_ID,)))
    texts[bs] = tokenizer.decode(out[0].outputs[0])
  return texts
