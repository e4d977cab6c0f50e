"""The paper's settings on the real engine: a named model on named GPUs, at the paper's sizes.

    setting = paper_scale.setting("opt-13b", "a100-40gb")     # tp from the paper's Table 1
    setting.kv_budget_tokens(16)            # 15,792 slots (Table 1: 15.7K)
    engine = setting.make_engine(block_size=16, kv_budget_tokens=15792, max_seqs=64)
    clock = setting.clock(block_size=16)    # virtual time: perf's seconds for each step

What is real here: the `Engine` (scheduler, jitted block manager, prefix cache,
copy-on-write, swapping, sampling), the Orca admission gates, the request streams at
their unscaled lengths (`PAPER`: the paper's 2,048-token context), the KV slots the GPUs
leave after the weights (`perf.kv_budget`, the paper's Table 1) and vLLM v0.1's scheduler
limits (2,560 tokens and 256 sequences a step, block size 16). What stands in: the model's
forward (`models.standin`: no attention, 8-feature pages) and time (`perf.ModelClock`: the
device-time model's seconds for what each step computed, on the named GPUs). A change to
the engine's policy changes these runs; nothing else schedules.

The engine runs without shape buckets (one compiled step per geometry: compiling is the
slow part on a CPU, and the stand-in's step costs about the same at any shape); the clock
charges only the real rows (`padding=False`), as vLLM's prefill runs unpadded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Tuple

from paged_jax import perf
from paged_jax.bench.scale import HarnessScale

# The paper's sizes: unscaled stream lengths, a 2,048-token context (OPT's), parallel
# sampling / beam width up to 6 (Fig. 14), and vLLM v0.1's EngineArgs defaults:
# max_num_batched_tokens 2,560 and max_num_seqs 256 (vllm/engine/arg_utils.py, v0.1.x).
PAPER = HarnessScale("paper", {}, max_len=2048, max_beam_width=6, max_num_batched_tokens=2560)
MAX_NUM_SEQS = 256
BLOCK_SIZE = 16                 # vLLM's default block size (the paper's, sec. 7.2)
VOCAB_SIZE = 256                # the streams' token ids are < 256 (workloads.scaled_requests)

# GPUs per replica in the paper's Table 1 (other pairs: the fewest that hold a context).
PAPER_TP = {(m, g): n for (m, g, n) in perf.catalog.PAPER_TABLE1}


@functools.lru_cache(maxsize=4)
def _standin(max_len: int, sliding_window: Optional[int] = None):
  from paged_jax.models import standin  # pylint: disable=g-import-not-at-top
  return standin.model(VOCAB_SIZE, max_position_embeddings=max_len,
                       sliding_window=sliding_window)


@dataclasses.dataclass(frozen=True)
class PaperSetting:
  """One deployment: `model` on `tp` GPUs of kind `gpu`.

  Attributes:
    model, gpu: catalog names (`perf.MODELS`, `perf.GPUS`).
    tp: GPUs of the replica (tensor parallel).
    device_model: the step-time model of that deployment.
    budget: the KV memory the GPUs leave after the weights (`perf.KvBudget`).
    max_len: the context (tokens a request may hold; Orca(Max)'s reservation).
  """
  model: str
  gpu: str
  tp: int
  device_model: perf.DeviceTimeModel
  budget: perf.KvBudget
  max_len: int

  @property
  def scale(self) -> HarnessScale:
    return dataclasses.replace(PAPER, max_len=self.max_len)

  def kv_budget_tokens(self, block_size: int = BLOCK_SIZE) -> int:
    """Token slots of the whole blocks of `block_size` the budget holds."""
    return self.budget.num_blocks(block_size) * block_size

  def make_engine(self, *, block_size: int, kv_budget_tokens: int, max_seqs: int = 64,
                  max_len: Optional[int] = None, preemption_mode: str = "recompute",
                  attention_backend: str = "reference",
                  max_num_batched_tokens: int = PAPER.max_num_batched_tokens,
                  max_beam_width: int = PAPER.max_beam_width, prefix_caching: bool = False,
                  eviction_policy: str = "lru", scheduling_policy="fcfs",
                  speculative_config=None, num_host_blocks: int = 0,
                  hybrid_kv: Optional[bool] = None, num_sliding_blocks: int = 0):
    """The real Engine with the stand-in forward on a `kv_budget_tokens`-slot pool
    (`engines.make_engine`'s keywords; attention_backend is unused by the stand-in).

    Unbucketed with the decode shape (`EngineOptions.decode_shape`): a mixed step runs
    the largest shape, a decode-only step T = R = max_seqs (two compiled shapes per
    geometry, not one per bucket). The model clock charges what a step computed, not its
    shape, so the shapes change host seconds only, never a latency. `eviction_policy` /
    `scheduling_policy`: `CacheConfig` / `EngineOptions`' (docs/extending.md);
    `speculative_config`: `EngineOptions`' (experiments/speculative_scale.py);
    `num_host_blocks`: the prefix cache's host tier (`CacheConfig`'s;
    experiments/host_tier_scale.py).
    `hybrid_kv` (None: the 1-layer stand-in): a model with sliding-window layers served
    by the 2-layer hybrid stand-in (`standin.hybrid_config`, the model's window) with its
    sliding layer in a pool of `num_sliding_blocks` blocks (True; `perf.budget.pool_config`
    sizes both pools) or in the one pool (False); experiments/hybrid_scale.py."""
    from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
    from paged_jax.models import standin  # pylint: disable=g-import-not-at-top
    del attention_backend
    max_len = max_len or self.max_len
    if kv_budget_tokens % block_size:
      raise ValueError(f"kv_budget_tokens must be a multiple of block_size={block_size}, "
                       f"got {kv_budget_tokens}")
    window = None
    hybrid = {}
    if hybrid_kv is not None:
      window = self.device_model.model.sliding_window
      if window is None:
        raise ValueError(f"hybrid_kv needs a model with sliding-window layers; "
                         f"{self.model} has none")
      hybrid = dict(hybrid_kv=bool(hybrid_kv), max_num_batched_tokens=max_num_batched_tokens)
      if hybrid_kv:
        hybrid["num_sliding_blocks"] = num_sliding_blocks
    config, params = _standin(self.max_len, window)
    cache = config.cache_config(block_size=block_size, num_blocks=kv_budget_tokens // block_size,
                                max_seqs=max_seqs, max_blocks_per_seq=-(-max_len // block_size),
                                enable_prefix_caching=prefix_caching,
                                eviction_policy=eviction_policy,
                                num_host_blocks=num_host_blocks, **hybrid)
    return Engine(config, params, cache, max_num_batched_tokens=max_num_batched_tokens,
                  scheduling_policy=scheduling_policy,
                  preemption_mode=preemption_mode, attention_backend="reference",
                  max_beam_width=max_beam_width, model_apply=standin.apply,
                  shape_buckets=False, decode_shape=True,
                  speculative_config=speculative_config)

  def clock(self, block_size: int = BLOCK_SIZE, *, host_time: bool = False) -> perf.ModelClock:
    """Virtual time from the device-time model (deterministic unless host_time)."""
    return perf.ModelClock(self.device_model, block_size=block_size, host_time=host_time)

  def as_dict(self) -> Dict:
    """What a result records: the deployment, its KV budget and every model constant."""
    table1 = perf.catalog.PAPER_TABLE1.get((self.model, self.gpu, self.tp))
    return {"model": self.model, "gpu": self.gpu, "tp": self.tp, "max_len": self.max_len,
            "kv_budget": self.budget.as_dict(), "paper_table1": table1,
            "scheduler": {"max_num_batched_tokens": PAPER.max_num_batched_tokens,
                          "max_num_seqs": MAX_NUM_SEQS,
                          "source": "vLLM v0.1 EngineArgs defaults"},
            "forward": "paged_jax.models.standin (1 layer, 1 KV head, D 8; no attention)",
            **self.device_model.as_dict()}


def _fits(model: str, gpu: str, tp: int, max_len: int) -> bool:
  try:
    return perf.kv_budget(model, gpu, tp=tp).kv_slots >= max_len
  except ValueError:
    return False


def setting(model: str, gpu: str, tp: Optional[int] = None,
            efficiency: Optional[perf.Efficiency] = None, max_len: int = PAPER.max_len
            ) -> PaperSetting:
  """The deployment of `model` on `gpu` (one-line ValueError for an unknown name, a tp
  that does not divide the heads, or GPUs whose memory holds no `max_len` context after
  the weights). tp=None: the paper's Table 1 count, else the fewest GPUs (a power of two
  dividing the heads) that hold one context."""
  spec, dev = perf.model_spec(model), perf.gpu_spec(gpu)
  max_len = min(max_len, spec.max_context)
  if tp is None:
    tp = PAPER_TP.get((spec.name, dev.name))
    candidates = [t for t in (1, 2, 4, 8, 16, 32) if spec.num_heads % t == 0]
    tp = tp or next((t for t in candidates if _fits(spec.name, dev.name, t, max_len)),
                    candidates[-1])
  budget = perf.kv_budget(spec, dev, tp=tp)   # raises when the weights leave no room
  if budget.kv_slots < max_len:
    raise ValueError(f"{spec.name} on {tp} x {dev.name} leaves KV memory for "
                     f"{budget.kv_slots} tokens, less than one {max_len}-token context; use "
                     f"more GPUs (--tp) or a larger GPU")
  dm = perf.DeviceTimeModel.named(spec, dev, tp=tp, efficiency=efficiency)
  return PaperSetting(spec.name, dev.name, tp, dm, budget, max_len)
