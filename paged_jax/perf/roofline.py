"""DeviceTimeModel: the seconds one engine step takes on a named GPU for a named model.

A roofline per part of the step, summed (the parts run one after another as kernels):

  step = sum over forward passes of
           max(linear FLOPs / (peak * e_lf),
             (weight + activation bytes) / (HBM * e_wb))                      projections
         + max(attention FLOPs / (peak * e_af), K/V bytes / (HBM * e_kv))     one ragged kernel
         + logits bytes / (HBM * e_el)                                         sampler
         + all-reduce ring bytes / (NVLink * e_nv) + count * allreduce_latency (tp > 1)
         + pass_overhead
       + rows * row_host_s                                                   host, per row
       + copy-on-write bytes / (HBM * e_el)
       + swap bytes / (PCIe * e_pcie) + copies * swap_copy_latency
       + host tier: promoted bytes / (PCIe * e_pcie) + stored and promoted bytes x 2 /
         (HBM * e_el) (staging copies) + 2 batched copies a direction * swap_copy_latency
     the host tier's device -> host download of the stored blocks runs beside the step
     (an asynchronous copy): the step takes max(the above, download bytes / (PCIe * e_pcie)
     + 2 * swap_copy_latency)

Attention's FLOPs and K/V bytes are summed over layers: a sliding-window layer
(`ModelSpec.sliding_layers`) computes and reads at most the window's keys per query
(`attention_extent`), wherever its pages live (hybrid KV or one pool).

Every figure is per GPU under Megatron-style tensor parallelism (weights, heads and K/V
split tp ways). The time is positively homogeneous and piecewise linear in the parameter
vector theta = (1/e_lf, 1/e_wb, 1/e_af, 1/e_kv, 1/e_el, 1/e_pcie, 1/e_nv, pass_overhead_s,
allreduce_latency_s, swap_copy_latency_s, row_host_s): `StepWork` holds the step's
coefficients, which is what `fit.py` fits theta with.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple, Union

import numpy as np

from paged_jax import config as pj_config
from paged_jax.perf import catalog
from paged_jax.perf.specs import Efficiency, GpuSpec, ModelSpec, dtype_bytes
from paged_jax.perf.step import StepShape

# theta's entries, in order: the seven efficiencies (as 1 / efficiency), then four latencies.
PARAMS = Efficiency.FRACTIONS + Efficiency.LATENCIES
_I = {name: i for i, name in enumerate(PARAMS)}

COMBINATION = ("sum over the step's parts (kernels run one after another) of each part's "
               "max(compute time, memory time); per forward pass, plus the host's per-row "
               "work, copy-on-write and swap")

# What `DeviceTimeModel.counts` returns: FLOPs, HBM bytes, all-reduce ring bytes.
COUNTS = ("linear_flops", "attention_flops", "weight_bytes", "activation_bytes", "kv_bytes",
          "logits_bytes", "allreduce_bytes")

# The host tier moves each direction's blocks as one batched copy of K and one of V
# (`paged_jax.engine.tier`: one transfer of the gathered blocks per K/V field).
HOST_TIER_COPIES = 2

PARTS = ("linear", "attention", "sampler", "allreduce", "overhead", "row_host", "copy_on_write",
         "swap", "host_tier")


def theta_of(eff: Efficiency) -> np.ndarray:
  """f64[len(PARAMS)]: 1 / efficiency for the fractions, seconds for the latencies."""
  return np.array([1.0 / getattr(eff, n) for n in Efficiency.FRACTIONS]
                  + [float(getattr(eff, n)) for n in Efficiency.LATENCIES])


def efficiency_of(theta: np.ndarray, source: str) -> Efficiency:
  """Inverse of theta_of."""
  k = len(Efficiency.FRACTIONS)
  vals = {n: 1.0 / float(t) for n, t in zip(Efficiency.FRACTIONS, theta[:k])}
  vals.update({n: float(t) for n, t in zip(Efficiency.LATENCIES, theta[k:])})
  return Efficiency(source=source, **vals)


@dataclasses.dataclass
class StepWork:
  """One step's coefficients: time(theta) = max(serial, beside), serial =
  sum(max(theta[ci] * cv, theta[mi] * mv)) over `pairs` + sum(theta[k] * v) over `terms`,
  beside = sum(theta[k] * v) over `beside` (work that runs concurrently with the step: the
  host tier's asynchronous download; empty: time = serial); each entry is tagged with its
  part name."""

  pairs: List[Tuple[str, int, float, int, float]] = dataclasses.field(default_factory=list)
  terms: List[Tuple[str, int, float]] = dataclasses.field(default_factory=list)
  beside: List[Tuple[str, int, float]] = dataclasses.field(default_factory=list)

  def _serial(self, theta: np.ndarray) -> float:
    t = sum(max(theta[ci] * cv, theta[mi] * mv) for _, ci, cv, mi, mv in self.pairs)
    return float(t + sum(theta[k] * v for _, k, v in self.terms))

  def _beside(self, theta: np.ndarray) -> float:
    return float(sum(theta[k] * v for _, k, v in self.beside))

  def seconds(self, theta: np.ndarray) -> float:
    return max(self._serial(theta), self._beside(theta))

  def gradient(self, theta: np.ndarray) -> np.ndarray:
    """d seconds / d theta (the active side of each max); seconds == gradient @ theta."""
    g = np.zeros(len(PARAMS))
    if self.beside and self._beside(theta) > self._serial(theta):
      for _, k, v in self.beside:
        g[k] += v
      return g
    for _, ci, cv, mi, mv in self.pairs:
      if theta[ci] * cv >= theta[mi] * mv:
        g[ci] += cv
      else:
        g[mi] += mv
    for _, k, v in self.terms:
      g[k] += v
    return g

  def by_part(self, theta: np.ndarray) -> dict:
    """Seconds by part; what `beside` adds past the serial work counts as "host_tier"."""
    out = dict.fromkeys(PARTS, 0.0)
    for part, ci, cv, mi, mv in self.pairs:
      out[part] += float(max(theta[ci] * cv, theta[mi] * mv))
    for part, k, v in self.terms:
      out[part] += float(theta[k] * v)
    if self.beside:
      out["host_tier"] += max(0.0, self._beside(theta) - self._serial(theta))
    return out


def _window_sum(x: np.ndarray, window: Optional[int]) -> np.ndarray:
  """sum over q = 1..x of min(q, window) (window None: x (x + 1) / 2), elementwise."""
  if window is None:
    return x * (x + 1) / 2.0
  inside = np.minimum(x, window)
  return inside * (inside + 1) / 2.0 + np.maximum(x - window, 0) * window


def attention_extent(new: np.ndarray, ctx: np.ndarray, window: Optional[int] = None
                     ) -> Tuple[np.ndarray, np.ndarray]:
  """(query-key pairs, K/V tokens read) of one layer's attention per row, f64[rows] each.

  A row computes `new` tokens whose last attends to `ctx` tokens: its j-th token (j < new)
  sits at position ctx - new + j and sees ctx - new + j + 1 keys, or at most `window` of
  them in a sliding-window layer (None: the whole context). The keys read are the union,
  min(ctx, new + window - 1) for a window, ctx without one."""
  new, ctx = np.asarray(new, np.float64), np.asarray(ctx, np.float64)
  pairs = _window_sum(ctx, window) - _window_sum(ctx - new, window)
  reads = ctx if window is None else np.minimum(ctx, new + window - 1)
  return pairs, reads


def _later_passes(step: StepShape) -> List[Tuple[np.ndarray, np.ndarray]]:
  """(new, context before the pass's index is added) per pass after the first: the
  first pass's decode rows, or `loop_rows` rows at the mean context of its sampled rows."""
  new, ctx = step.arrays()
  if step.loop_rows is None:
    decode = new == 1
    return [(new[decode], ctx[decode])] * (step.decode_iterations - 1)
  # Sampled rows: decode rows first, then chunks (StepShape.from_report's order).
  sampled = ctx[:step.num_sampled] if step.num_sampled else ctx
  mean = float(sampled.mean()) if sampled.size else 0.0
  return [(np.ones(k), np.full(k, mean)) for k in step.loop_rows]


@dataclasses.dataclass(frozen=True)
class DeviceTimeModel:
  """Seconds per engine step for `model` on `tp` GPUs of kind `gpu`.

  Attributes:
    model: the model's shapes (catalog.MODELS or ModelSpec.from_model_config).
    gpu: the accelerator (catalog.GPUS or your own GpuSpec).
    tp: tensor-parallel degree (GPUs per model replica); must divide num_heads.
    efficiency: efficiencies and fixed latencies (catalog.DEFAULT_EFFICIENCY or a fit).
    kv_dtype: K/V page dtype name (None: the model's dtype).
  """

  model: ModelSpec
  gpu: GpuSpec
  tp: int = 1
  efficiency: Efficiency = catalog.DEFAULT_EFFICIENCY
  kv_dtype: Optional[str] = None

  def __post_init__(self):
    pj_config.check_int("tp", self.tp, 1, 1024)
    if self.model.num_heads % self.tp:
      raise ValueError(f"tp must divide {self.model.name}'s num_heads={self.model.num_heads}, "
                       f"got {self.tp}")
    if self.kv_dtype is not None:
      dtype_bytes(self.kv_dtype)

  @classmethod
  def named(cls, model: Union[str, ModelSpec, pj_config.ModelConfig],
            gpu: Union[str, GpuSpec], tp: int = 1, efficiency: Optional[Efficiency] = None,
            kv_dtype: Optional[str] = None) -> "DeviceTimeModel":
    """`DeviceTimeModel.named("opt-13b", "a100-40gb")`; bad names are one-line ValueErrors."""
    return cls(model=catalog.model_spec(model), gpu=catalog.gpu_spec(gpu), tp=tp,
               efficiency=efficiency or catalog.DEFAULT_EFFICIENCY, kv_dtype=kv_dtype)

  def replace(self, **changes) -> "DeviceTimeModel":
    return dataclasses.replace(self, **changes)

  # ---- per-GPU sizes ----

  @property
  def kv_bytes_per_token(self) -> float:
    """K/V bytes of one token held by ONE GPU (its share of the KV heads)."""
    m = self.model
    per_gpu_heads = math.ceil(m.num_kv_heads / self.tp)  # replicated when tp > kv heads
    return m.kv_bytes_per_token(self.kv_dtype) * per_gpu_heads / m.num_kv_heads

  @property
  def weight_bytes_per_gpu(self) -> float:
    return self.model.weight_bytes / self.tp

  # ---- the step ----

  def _passes(self, step: StepShape):
    """(new, ctx, tokens computed, rows sampled) per forward pass of the step."""
    new, ctx = step.arrays()
    if step.num_rows:
      yield new, ctx, max(step.bucket_tokens, step.num_tokens), step.num_sampled
    for i, (rows_new, rows_ctx) in enumerate(_later_passes(step), start=1):
      live = rows_new.size
      if live or step.bucket_rows:
        yield rows_new, rows_ctx + i, max(live, step.bucket_rows), live

  def work(self, step: StepShape) -> StepWork:
    """The step's coefficients in seconds at 100% of each peak (see module docstring)."""
    m, g = self.model, self.gpu
    work = StepWork()
    for new, ctx, tokens, sampled in self._passes(step):
      self._pass(work, self.pass_counts(new, ctx, tokens, sampled))
    if step.num_rows:   # the host plans, packs and updates each row once per step
      work.terms.append(("row_host", _I["row_host_s"], float(step.num_rows)))
    kvb = self.kv_bytes_per_token
    if step.cow_blocks:  # read and write each block
      bytes_ = 2.0 * step.cow_blocks * step.block_size * kvb
      work.terms.append(("copy_on_write", _I["elementwise_bandwidth"], bytes_ / g.hbm_bandwidth))
    if step.swapped_blocks:
      bytes_ = step.swapped_blocks * step.block_size * kvb
      copies = step.swapped_blocks * m.num_layers * catalog.SWAP_COPIES_PER_BLOCK_LAYER
      work.terms.append(("swap", _I["pcie"], bytes_ / g.pcie_bandwidth))
      work.terms.append(("swap", _I["swap_copy_latency_s"], float(copies)))
    self._host_tier(work, step.host_in_blocks, step.host_out_blocks, step.block_size * kvb)
    return work

  def _host_tier(self, work: StepWork, blocks_in: int, blocks_out: int,
                 block_bytes: float) -> None:
    """The host tier's transfers (`StepShape.host_in_blocks` / `host_out_blocks`), each
    direction one batched copy per K and V (HOST_TIER_COPIES): promotions are uploaded
    over PCIe before the step and written into their blocks (a device copy); stored
    blocks are gathered into a staging buffer before the step (a device copy) and
    downloaded over PCIe beside it (`StepWork.beside`)."""
    g = self.gpu
    for n, pcie_terms in ((blocks_in, work.terms), (blocks_out, work.beside)):
      if not n:
        continue
      bytes_ = n * block_bytes
      work.terms.append(("host_tier", _I["elementwise_bandwidth"],
                         2.0 * bytes_ / g.hbm_bandwidth))
      pcie_terms.append(("host_tier", _I["pcie"], bytes_ / g.pcie_bandwidth))
      pcie_terms.append(("host_tier", _I["swap_copy_latency_s"], float(HOST_TIER_COPIES)))

  def counts(self, step: StepShape) -> dict:
    """FLOPs and HBM bytes of the step's forward passes, summed over passes, per GPU: the
    quantities `work` divides by the peaks (`pass_counts`' keys)."""
    total = dict.fromkeys(COUNTS, 0.0)
    for new, ctx, tokens, sampled in self._passes(step):
      for k, v in self.pass_counts(new, ctx, tokens, sampled).items():
        total[k] += v
    return total

  def pass_counts(self, new: np.ndarray, ctx: np.ndarray, tokens: int, sampled: int) -> dict:
    """One forward pass over rows (new, ctx) computing `tokens` tokens, `sampled` of them
    through the LM head: COUNTS (FLOPs; bytes; all-reduce ring bytes), per GPU."""
    m, tp = self.model, self.tp
    # Query-key pairs and K/V tokens read, summed over layers (layer_pairs, layer_kv).
    pairs, reads = attention_extent(new, ctx)
    layer_pairs = m.num_full_layers * pairs
    layer_kv = m.num_full_layers * (reads + new)            # read the context, write new
    if m.num_sliding_layers:
      pairs_w, reads_w = attention_extent(new, ctx, m.sliding_window)
      layer_pairs = layer_pairs + m.num_sliding_layers * pairs_w
      layer_kv = layer_kv + m.num_sliding_layers * (reads_w + new)
    ring = 0.0
    if tp > 1:
      count = catalog.ALLREDUCES_PER_LAYER * m.num_layers
      ring = 2.0 * (tp - 1) / tp * tokens * m.hidden_size * m.dtype_bytes * count
    return dict(
        linear_flops=(2.0 * m.num_layers * m.layer_matmul_params * tokens
                      + 2.0 * m.lm_head_params * sampled) / tp,
        attention_flops=4.0 * (m.num_heads // tp) * m.head_dim * float(layer_pairs.sum()),
        weight_bytes=m.weight_bytes_per_pass / tp,
        activation_bytes=float(tokens * m.activation_bytes_per_token(tp)),
        kv_bytes=float(layer_kv.sum()) * self.kv_bytes_per_token / m.num_layers,
        logits_bytes=float(sampled * m.vocab_size * catalog.SAMPLER_BYTES_PER_LOGIT),
        allreduce_bytes=ring)

  def _pass(self, work: StepWork, c: dict) -> None:
    """Appends one forward pass with counts `c` (pass_counts)."""
    m, g, tp = self.model, self.gpu, self.tp
    peak, hbm = g.tensor_flops, g.hbm_bandwidth
    work.pairs.append(("linear", _I["linear_flops"], c["linear_flops"] / peak,
                       _I["weight_bandwidth"],
                       (c["weight_bytes"] + c["activation_bytes"]) / hbm))
    # One ragged kernel runs every row of the pass (the engine's mixed prefill + decode
    # batch), so a decode row's K/V reads overlap a long chunk's FLOPs: one max per pass.
    work.pairs.append(("attention", _I["attention_flops"], c["attention_flops"] / peak,
                       _I["kv_bandwidth"], c["kv_bytes"] / hbm))
    if c["logits_bytes"]:
      work.terms.append(("sampler", _I["elementwise_bandwidth"], c["logits_bytes"] / hbm))
    if tp > 1:
      count = catalog.ALLREDUCES_PER_LAYER * m.num_layers
      work.terms.append(("allreduce", _I["nvlink"], c["allreduce_bytes"] / g.nvlink_bandwidth))
      work.terms.append(("allreduce", _I["allreduce_latency_s"], float(count)))
    work.terms.append(("overhead", _I["pass_overhead_s"], 1.0))

  @property
  def theta(self) -> np.ndarray:
    return theta_of(self.efficiency)

  def step_seconds(self, step: StepShape) -> float:
    """Seconds the step takes on the device."""
    return self.work(step).seconds(self.theta)

  def breakdown(self, step: StepShape) -> dict:
    """Seconds by part (PARTS) and "total"."""
    out = self.work(step).by_part(self.theta)
    out["total"] = sum(out.values())
    return out

  # ---- memory ----

  def kv_budget(self, gpu_memory_utilization: float = catalog.GPU_MEMORY_UTILIZATION,
                reserve_bytes: int = 0):
    """The KV cache the GPUs leave after the weights (budget.KvBudget)."""
    from paged_jax.perf import budget  # pylint: disable=g-import-not-at-top
    return budget.kv_budget(self.model, self.gpu, tp=self.tp, kv_dtype=self.kv_dtype,
                            gpu_memory_utilization=gpu_memory_utilization,
                            reserve_bytes=reserve_bytes)

  # ---- provenance ----

  def as_dict(self) -> dict:
    """Every constant the model uses, with its source (goes into result JSON)."""
    eff = self.efficiency
    default = catalog.DEFAULT_EFFICIENCY
    efficiency = {}
    for name in PARAMS:
      value = getattr(eff, name)
      source = (catalog.EFFICIENCY_SOURCES[name] if value == getattr(default, name)
                else eff.source)
      efficiency[name] = {"value": value, "source": source}
    return {
        "model": self.model.as_dict(),
        "gpu": self.gpu.as_dict(),
        "tp": self.tp,
        "kv_dtype": self.kv_dtype or self.model.dtype,
        "efficiency": efficiency,
        "efficiency_source": eff.source,
        "structure": {
            "allreduces_per_layer": catalog.ALLREDUCES_PER_LAYER,
            "swap_copies_per_block_layer": catalog.SWAP_COPIES_PER_BLOCK_LAYER,
            "host_tier_copies_per_direction": HOST_TIER_COPIES,
            "sampler_bytes_per_logit": catalog.SAMPLER_BYTES_PER_LOGIT,
            "sources": dict(catalog.STRUCTURE_SOURCES),
        },
        "combination": COMBINATION,
    }

  describe = as_dict
