"""`EngineOptions`: every knob of an `Engine` besides its model, params and cache, named,
frozen and validated once, on construction.

    opts = EngineOptions(max_num_batched_tokens=512, decode_steps_per_sync=4)
    engine = Engine(model_config, params, cache_config, options=opts)
    engine = Engine(model_config, params, cache_config, max_num_batched_tokens=512)  # same

`Engine`, `step_for_compile` and `Engine.fresh_copy` all take these; the jitted step is
shared by engines whose options agree on what it compiles (`compile.step_key`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

from paged_jax.engine import policy

# recompute: drop K/V, prefill again; swap: copy K/V to host and back; auto: swap
# groups of several sequences, recompute single ones (vLLM V0's default rule).
PREEMPTION_MODES = ("recompute", "swap", "auto")
MAX_OPTION = 2**20   # bound on the integer options (tokens per step, decode steps, beams)
MAX_PROBE = 1024     # `prefix_cache.init`'s bound


def check_preemption_mode(value: Any) -> None:
  """The one check of a preemption mode (EngineOptions and Scheduler call it)."""
  if value not in PREEMPTION_MODES:
    raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                     f"got {value!r}")


def _need_int(name: str, value: Any, lo: int, hi: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
    raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """How an Engine schedules and runs its step (the model and cache are its arguments).

  Attributes:
    max_num_batched_tokens: tokens per step (prefill chunks + decodes), in [1, 2**20].
    decode_steps_per_sync: decode steps per device call (multi-step decoding), [1, 2**20].
    preemption_mode: "recompute", "swap" (to host memory, a group's shared blocks once)
      or "auto" (swap groups of several sequences, recompute single ones: vLLM V0's rule).
    attention_backend: a name `paged_jax.attention` accepts: "auto", "reference", "xla",
      "cpu", "pallas", "pallas_interpret", or with the kernel family forced
      ("pallas:triton", "pallas:mosaic_gpu", "pallas_interpret:triton", ...).
    max_beam_width: largest beam_width accepted (sets the candidate count), [1, 2**20].
    model_apply: replaces `LlamaForCausalLM(...).apply` in the jitted step (same
      signature); `paged_jax.distributed` passes its tensor-parallel forward.
    init_state: `cache_config -> EngineState`, e.g. pages created already sharded.
    max_probe: prefix-cache hash-table slots probed per block, [1, 1024].
    hash_mode: prefix-cache hashing, "chained" (or "constant", for collision tests).
    shape_buckets: True: each step runs on the smallest shape bucket holding what is
      live; False: every step at the largest shape (for comparisons).
    decode_shape: with shape_buckets=False, a decode-only step (every row one new token)
      runs on a second shape, T = R = max_seqs and W = max_blocks_per_seq with the
      decode kernel, instead of the largest one: two compiled shapes (x sampling
      variants), and no step of a long decode phase pays for the token budget's arrays
      (the paper-scale engines). Outputs are the same either way. No effect with
      shape_buckets=True (decode-only steps always run the decode buckets there).
    width_buckets: the block-table width W as a shape bucket (True), or every step at
      W = max_blocks_per_seq (False); None: as `buckets.attention_reads_width` says for
      the step's attention (one width with the CPU kernels, where W costs nothing).
    speculative_config: speculative decoding, vLLM's keys: {"method": "ngram",
      "num_speculative_tokens": k, "prompt_lookup_max": m, "prompt_lookup_min": n}
      (`speculative.py`; held as a `speculative.SpeculativeConfig`), or None (off).
    scheduling_policy: the order requests are served, admitted and preempted in:
      "fcfs" (arrival), "priority" (`add_request(..., priority=)`, lower first, ties by
      arrival) or a callable `key(request) -> sortable` (`policy.py`).
  """
  max_num_batched_tokens: int = 256
  decode_steps_per_sync: int = 1
  preemption_mode: str = "recompute"
  attention_backend: str = "auto"
  max_beam_width: int = 4
  model_apply: Optional[Callable[..., Any]] = None
  init_state: Optional[Callable[..., Any]] = None
  max_probe: int = 16
  hash_mode: str = "chained"
  shape_buckets: bool = True
  decode_shape: bool = False
  width_buckets: Optional[bool] = None
  scheduling_policy: Union[str, Callable[[Any], Any]] = "fcfs"
  speculative_config: Any = None

  def __post_init__(self):
    from paged_jax.engine import speculative  # pylint: disable=g-import-not-at-top
    object.__setattr__(self, "speculative_config", speculative.parse(self.speculative_config))
    from paged_jax.attention import resolve_backend  # pylint: disable=g-import-not-at-top
    from paged_jax.prefix_cache.state import HASH_MODES  # pylint: disable=g-import-not-at-top
    for name in ("max_num_batched_tokens", "decode_steps_per_sync", "max_beam_width"):
      _need_int(name, getattr(self, name), 1, MAX_OPTION)
    _need_int("max_probe", self.max_probe, 1, MAX_PROBE)
    check_preemption_mode(self.preemption_mode)
    policy.resolve(self.scheduling_policy)
    if not isinstance(self.attention_backend, str):
      raise ValueError(f"attention_backend must be a backend name, got "
                       f"{self.attention_backend!r}")
    try:
      resolve_backend(self.attention_backend)
    except ValueError as e:
      raise ValueError(f"attention_backend: {e}") from None
    if self.hash_mode not in HASH_MODES:
      raise ValueError(f"hash_mode must be one of {', '.join(HASH_MODES)}, "
                       f"got {self.hash_mode!r}")
    for name in ("model_apply", "init_state"):
      if getattr(self, name) is not None and not callable(getattr(self, name)):
        raise ValueError(f"{name} must be callable or None, got {getattr(self, name)!r}")
    for name in ("shape_buckets", "decode_shape"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    if not (self.width_buckets is None or isinstance(self.width_buckets, bool)):
      raise ValueError(f"width_buckets must be True, False or None, got {self.width_buckets!r}")

  @classmethod
  def of(cls, options: Optional["EngineOptions"] = None, **overrides) -> "EngineOptions":
    """`options` with `overrides` (keyword names of the fields) applied, validated; a
    one-line TypeError names an unknown keyword."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
      raise TypeError(f"unknown engine option {unknown[0]!r}; options are "
                      f"{', '.join(sorted(names))}")
    if options is None:
      return cls(**overrides)
    if not isinstance(options, cls):
      raise ValueError(f"options must be an EngineOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **overrides) if overrides else options
