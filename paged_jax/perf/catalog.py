"""Every constant of the device-time model, each with its source: the one place to read them.

Named GPUs (vendor datasheets), named models (model cards / configs and papers), the default
efficiencies and fixed latencies (literature figures or stated assumptions, to be replaced
by a fit: `paged_jax.perf.fit`), and the paper's Table 1 the KV budgets are checked against.

Units: bytes, bytes/s, FLOP/s, seconds. "GB/s" in a source is 1e9 bytes/s; memory sizes
are the driver-reported totals in MiB (2**20 bytes).
"""

from __future__ import annotations

from typing import Dict, Union

from paged_jax import config as pj_config
from paged_jax.perf.specs import Efficiency, GpuSpec, ModelSpec

MIB = 2**20
GB = 1e9

# ---------------------------------------------------------------------------------------
# GPUs. Datasheet bandwidths for NVLink and PCIe are bidirectional totals; the model uses
# one direction (half), which is what a ring all-reduce step or a one-way copy can use.
# ---------------------------------------------------------------------------------------

_A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 tensor core 312 "
               "TFLOPS dense; NVLink 600 GB/s; PCIe Gen4 64 GB/s (both bidirectional)")
_HOPPER_SHEET = ("BF16/FP16 tensor core 1,979 TFLOPS with sparsity = 989.4 dense; NVLink "
                 "900 GB/s; PCIe Gen5 128 GB/s (both bidirectional)")

GPUS: Dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec(
        name="a100-40gb", hbm_bytes=40960 * MIB, hbm_bandwidth=1555 * GB,
        tensor_flops=312e12, nvlink_bandwidth=300 * GB, pcie_bandwidth=32 * GB,
        source=_A100_SHEET + "; 40GB HBM2 at 1,555 GB/s (SXM4); 40,960 MiB as nvidia-smi "
        "reports it. The paper's OPT-13B / 66B GPUs (GCP A2, arXiv:2309.06180 sec. 6.1)"),
    "a100-80gb": GpuSpec(
        name="a100-80gb", hbm_bytes=81920 * MIB, hbm_bandwidth=2039 * GB,
        tensor_flops=312e12, nvlink_bandwidth=300 * GB, pcie_bandwidth=32 * GB,
        source=_A100_SHEET + "; 80GB HBM2e at 2,039 GB/s (SXM4); 81,920 MiB as nvidia-smi "
        "reports it. The paper's OPT-175B GPUs (8x, Table 1)"),
    "h100-sxm": GpuSpec(
        name="h100-sxm", hbm_bytes=81559 * MIB, hbm_bandwidth=3350 * GB,
        tensor_flops=989.4e12, nvlink_bandwidth=450 * GB, pcie_bandwidth=64 * GB,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80GB HBM3 at 3.35 TB/s; "
        + _HOPPER_SHEET + "; 81,559 MiB as nvidia-smi reports it"),
    "h200": GpuSpec(
        name="h200", hbm_bytes=143771 * MIB, hbm_bandwidth=4800 * GB,
        tensor_flops=989.4e12, nvlink_bandwidth=450 * GB, pcie_bandwidth=64 * GB,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM): 141GB HBM3e at 4.8 TB/s; "
        + _HOPPER_SHEET + "; 143,771 MiB, the device memory of the H200 compile target "
        "(pallas_kernels/compile_target.py)"),
}

# ---------------------------------------------------------------------------------------
# Models: the shapes of each config.json / paper table. reported_params is the publisher's
# stated size (OPT and LLaMA papers round to the nominal size).
# ---------------------------------------------------------------------------------------

_OPT_PAPER = "OPT paper (Zhang et al. 2022, arXiv:2205.01068) Table 1"
_OPT_COMMON = dict(vocab_size=50272, gated_mlp=False, linear_bias=True, norm_vectors=2,
                   learned_positions=2048 + 2, tie_word_embeddings=True, dtype="float16",
                   max_context=2048)
_LLAMA_COMMON = dict(gated_mlp=True, linear_bias=False, norm_vectors=1,
                     tie_word_embeddings=False)   # SwiGLU, no biases, RMSNorm, own lm_head

# Gemma-2: RMSNorm with four norms a layer (pre / post attention and MLP), GeGLU (gated),
# no biases, tied embeddings, local (sliding, 4,096 tokens) and global attention layers
# alternating from a local layer 0 (HF Gemma2: layer i slides iff i is even), bfloat16.
_GEMMA2_REPORT = ("Gemma 2 report (Gemma Team 2024, arXiv:2408.00118) Tables 1-2 and sec. 2 "
                  "(sliding window 4,096 tokens on every other layer, global span 8,192)")
_GEMMA2_COMMON = dict(gated_mlp=True, linear_bias=False, norm_vectors=1, norms_per_layer=4,
                      tie_word_embeddings=True, dtype="bfloat16", sliding_window=4096)

MODELS: Dict[str, ModelSpec] = {
    "opt-13b": ModelSpec(
        name="opt-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40,
        head_dim=128, ffn_size=20480, reported_params=13e9, **_OPT_COMMON,
        source="facebook/opt-13b config.json (hidden 5120, 40 layers, 40 heads, ffn_dim "
        "20480, vocab 50272, ReLU MLP with biases, LayerNorm, learned positions with offset "
        "2, tied lm_head, float16); " + _OPT_PAPER),
    "opt-66b": ModelSpec(
        name="opt-66b", num_layers=64, hidden_size=9216, num_heads=72, num_kv_heads=72,
        head_dim=128, ffn_size=36864, reported_params=66e9, **_OPT_COMMON,
        source="facebook/opt-66b config.json (hidden 9216, 64 layers, 72 heads, ffn_dim "
        "36864); " + _OPT_PAPER),
    "opt-175b": ModelSpec(
        name="opt-175b", num_layers=96, hidden_size=12288, num_heads=96, num_kv_heads=96,
        head_dim=128, ffn_size=4 * 12288, reported_params=175e9, **_OPT_COMMON,
        source=_OPT_PAPER + " (96 layers, 96 heads, d_model 12288; FFN 4 x d_model as every "
        "OPT size); weights not on the Hub"),
    "llama-13b": ModelSpec(
        name="llama-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40,
        head_dim=128, ffn_size=13824, vocab_size=32000, dtype="float16", max_context=2048,
        reported_params=13.0e9, **_LLAMA_COMMON,
        source="LLaMA paper (Touvron et al. 2023, arXiv:2302.13971) Table 2 (13.0B: dim "
        "5120, 40 heads, 40 layers); HF llama-13b config.json (intermediate_size 13824, "
        "vocab 32000). The paper's Fig. 16 model"),
    "llama-3-8b": ModelSpec(
        name="llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, ffn_size=14336, vocab_size=128256, dtype="bfloat16", max_context=8192,
        reported_params=8.03e9, **_LLAMA_COMMON,
        source="meta-llama/Meta-Llama-3-8B config.json (hidden 4096, 32 layers, 32 heads, "
        "8 KV heads, intermediate 14336, vocab 128256, bfloat16); 8.03B parameters "
        "(model card)"),
    # Sliding-window models (issue 38, point 4(c)): hybrid KV prices and sizes these.
    "gemma-2-9b": ModelSpec(
        name="gemma-2-9b", num_layers=42, hidden_size=3584, num_heads=16, num_kv_heads=8,
        head_dim=256, ffn_size=14336, vocab_size=256000, max_context=8192,
        reported_params=9.24e9, sliding_layers=tuple(range(0, 42, 2)), **_GEMMA2_COMMON,
        source="google/gemma-2-9b config.json (hidden 3584, 42 layers, 16 heads, 8 KV heads, "
        "head_dim 256, intermediate 14336, vocab 256000, max positions 8192, sliding_window "
        "4096, GeGLU, tied embeddings); " + _GEMMA2_REPORT + ": 917,504,000 embedding + "
        "8,324,201,984 non-embedding parameters = 9.24B"),
    "gemma-2-27b": ModelSpec(
        name="gemma-2-27b", num_layers=46, hidden_size=4608, num_heads=32, num_kv_heads=16,
        head_dim=128, ffn_size=36864, vocab_size=256000, max_context=8192,
        reported_params=27.2e9, sliding_layers=tuple(range(0, 46, 2)), **_GEMMA2_COMMON,
        source="google/gemma-2-27b config.json (hidden 4608, 46 layers, 32 heads, 16 KV "
        "heads, head_dim 128, intermediate 36864, vocab 256000, max positions 8192, "
        "sliding_window 4096); " + _GEMMA2_REPORT + ": 27.2B parameters (model card: 27B)"),
    "mistral-7b": ModelSpec(
        name="mistral-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        head_dim=128, ffn_size=14336, vocab_size=32000, dtype="bfloat16", max_context=32768,
        reported_params=7.24e9, sliding_window=4096, sliding_layers=tuple(range(32)),
        **_LLAMA_COMMON,
        source="mistralai/Mistral-7B-v0.1 config.json (hidden 4096, 32 layers, 32 heads, 8 "
        "KV heads, intermediate 14336, vocab 32000, max positions 32768, sliding_window 4096 "
        "on every layer); Mistral 7B paper (Jiang et al. 2023, arXiv:2310.06825) Table 1 "
        "(window 4096, context 8192); 7.24B parameters (model card). Every layer slides, so "
        "hybrid KV (sliding and full layers) does not apply: one pool, window-capped reads"),
}

# ---------------------------------------------------------------------------------------
# Efficiencies and fixed latencies. Defaults, to be replaced by a fit on the real device
# (experiments/gpu_check.sh on an H200). Two single-GPU figures fix two of them: a 13B GPT
# with OPT-13B's shapes in FasterTransformer on one A100-40GB, batch 1, 512-token context
# (kipply, "Transformer Inference Arithmetic", 2022, "comparing against real benchmarks"):
# prefill 63.17 ms, decode 22.0 ms a token. See LITERATURE_STEP_TIMES.
# ---------------------------------------------------------------------------------------

DEFAULT_EFFICIENCY = Efficiency(
    linear_flops=0.67, weight_bandwidth=0.80, attention_flops=0.40, kv_bandwidth=0.65,
    elementwise_bandwidth=0.80, pcie=0.80, nvlink=0.80, pass_overhead_s=1.0e-3,
    allreduce_latency_s=10e-6, swap_copy_latency_s=5e-6, row_host_s=0.0,
    source="catalog defaults")

EFFICIENCY_SOURCES: Dict[str, str] = {
    "linear_flops": "kipply 2022 FasterTransformer 13B prefill, 512 tokens in 63.17 ms on "
                    "one A100-40GB: 12.9 TFLOP of projections in ~61 ms = 0.67 of 312 TFLOPS",
    "weight_bandwidth": "kipply 2022 FasterTransformer 13B decode, 22.0 ms a token on one "
                        "A100-40GB: 25.7 GB of weights in ~20.6 ms (1 ms overhead assumed) "
                        "= 0.80 of 1,555 GB/s",
    "attention_flops": "FlashAttention-2 paper (Dao 2023, arXiv:2307.08691): FlashAttention "
                       "reaches 25-40% of A100 peak, FlashAttention-2 50-73%; 0.40 for the "
                       "paper's 2023 kernels",
    "kv_bandwidth": "vLLM paper sec. 7.1 (Fig. 18a): the paged attention kernel is 20-26% "
                    "slower than FasterTransformer's; FasterTransformer's taken at the weight "
                    "read efficiency: 0.80 / 1.23 = 0.65",
    "elementwise_bandwidth": "assumption: streaming kernels (logits, block copies) read as "
                             "fast as the weight GEMVs, 0.80",
    "pcie": "assumption shared with paged_jax.bench.arrivals: ~25 GB/s achieved of PCIe "
            "4.0 x16's 32 GB/s one way, pinned host memory",
    "nvlink": "assumption: NCCL ring all-reduce bus bandwidth ~0.8 of NVLink one way",
    "pass_overhead_s": "assumption: 1 ms a forward pass (kernel launches, host sync); the "
                       "decode figure above cannot separate it from weight_bandwidth",
    "allreduce_latency_s": "assumption: ~10 us NCCL small-message all-reduce on NVLink; "
                           "checked out of sample against kipply's 2-GPU decode (13.5 ms)",
    "row_host_s": "assumption: 0 on a GPU (not separated from pass_overhead_s by the "
                  "figures above); the host's per-request work is real there too (vLLM's "
                  "profile of v0.5.3, Llama 3 8B on one H100: 29% of the time in scheduling "
                  "and input preparation; vLLM blog 'vLLM v0.6.0: 2.7x Throughput "
                  "Improvement', 2024-09-05). Fitted where measured: ~0.1 ms a row for the "
                  "tiny model on this CPU (experiments.perf_validation)",
    "swap_copy_latency_s": "assumption: ~5 us per cudaMemcpyAsync of one block of one "
                           "layer's K or V (vLLM v0 swaps block by block, csrc "
                           "swap_blocks), so small blocks swap slowly as the paper's Fig. 19a",
}

# ---------------------------------------------------------------------------------------
# Structure of the step (not efficiencies).
# ---------------------------------------------------------------------------------------

ALLREDUCES_PER_LAYER = 2        # Megatron-LM tensor parallelism (Shoeybi et al. 2019,
#                                 arXiv:1909.08053 sec. 3): one after attention, one after
#                                 the MLP, each of tokens x hidden activations.
SWAP_COPIES_PER_BLOCK_LAYER = 2  # K and V are separate tensors per layer in vLLM v0's
#                                  cache; swap issues one copy per block of each.
SAMPLER_BYTES_PER_LOGIT = 16     # assumption: f32 logits written once, read ~3 times
#                                  (max / softmax, top-k / top-p, draw).
GPU_MEMORY_UTILIZATION = 0.9    # vLLM's default gpu_memory_utilization (EngineArgs docs):
#                                 the fraction of each GPU's memory vLLM may use.

STRUCTURE_SOURCES: Dict[str, str] = {
    "allreduces_per_layer": "Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053) sec. 3",
    "swap_copies_per_block_layer": "vLLM v0 KV cache: separate K and V tensors per layer",
    "sampler_bytes_per_logit": "assumption: f32 logits written once, read about 3 times",
    "gpu_memory_utilization": "vLLM default gpu_memory_utilization = 0.9",
}

# ---------------------------------------------------------------------------------------
# Reference figures the tests compare with.
# ---------------------------------------------------------------------------------------

PAPER = "Kwon et al., SOSP 2023, arXiv:2309.06180"

# Table 1 of the paper: (model, gpu, number of GPUs) -> sizes; GB as the paper prints them.
PAPER_TABLE1 = {
    ("opt-13b", "a100-40gb", 1): dict(total_gb=40, param_gb=26, kv_gb=12, kv_slots=15.7e3),
    ("opt-66b", "a100-40gb", 4): dict(total_gb=160, param_gb=132, kv_gb=21, kv_slots=9.7e3),
    ("opt-175b", "a100-80gb", 8): dict(total_gb=640, param_gb=346, kv_gb=264,
                                       kv_slots=60.1e3),
}
PAPER_KV_BYTES_PER_TOKEN = {"opt-13b": 800 * 1024}  # sec. 3: "800 KB" a token for OPT-13B

# FasterTransformer, a 13B GPT of OPT-13B's shapes, batch 1, 512-token context, A100-40GB
# (kipply 2022, as above): seconds of the 512-token prefill and of one decode step.
LITERATURE_STEP_TIMES = (
    dict(model="opt-13b", gpu="a100-40gb", tp=1, phase="prefill", tokens=512, seconds=63.17e-3),
    dict(model="opt-13b", gpu="a100-40gb", tp=1, phase="decode", tokens=512, seconds=22.0e-3),
    dict(model="opt-13b", gpu="a100-40gb", tp=2, phase="prefill", tokens=512, seconds=45.45e-3),
    dict(model="opt-13b", gpu="a100-40gb", tp=2, phase="decode", tokens=512, seconds=13.5e-3),
)
LITERATURE_SOURCE = ("kipply, 'Transformer Inference Arithmetic' (2022), FasterTransformer "
                     "on 1 and 2 A100-40GB")


def _key(name: str) -> str:
  return str(name).strip().lower().replace("_", "-")


def gpu_spec(name: Union[str, GpuSpec]) -> GpuSpec:
  """The named GPU (case and '_' / '-' ignored); a GpuSpec passes through."""
  if isinstance(name, GpuSpec):
    return name
  key = _key(name)
  if key not in GPUS:
    raise ValueError(f"gpu must be one of {', '.join(GPUS)}; got {name!r}")
  return GPUS[key]


def model_spec(name: Union[str, ModelSpec, pj_config.ModelConfig]) -> ModelSpec:
  """The named model, or the shapes of a ModelConfig; a ModelSpec passes through."""
  if isinstance(name, ModelSpec):
    return name
  if isinstance(name, pj_config.ModelConfig):
    return ModelSpec.from_model_config(name)
  key = _key(name)
  if key not in MODELS:
    raise ValueError(f"model must be one of {', '.join(MODELS)} (or a ModelConfig); "
                     f"got {name!r}")
  return MODELS[key]
