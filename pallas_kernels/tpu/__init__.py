"""Pallas TPU (Mosaic) paged-attention kernels: same signatures as pallas_kernels.reference.

  paged_attention(q, k_pages, v_pages, block_tables, lengths, ...)        decode
  ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                         cu_q_lens, num_seqs, ...)                        prefill + decode
  write_kv(k_pages, v_pages, k_new, v_new, slots, ...)                    the step's K/V write

Both keep the engine's head-major pages [Hkv, NB, bs, D] (no copy of the pool), read the
block table and the per-call work list from SMEM (scalar prefetch) and bring pages from HBM
with double-buffered DMAs. `interpret=True` (or a `pltpu.InterpretParams`) runs them in
the TPU interpreter on CPU. Kernel: attention_kernel.py; work lists: work.py; knobs:
tuning.py; int8 / fp8 scale rows: scales.py; the in-place K/V write: kv_write.py (XLA's
TPU scatter copies the pool); deviceless compile for v5e / v6e: compile_target.py and
compile_configs.py; JAX's own kernels on our inputs: jax_baselines.py.
"""

from pallas_kernels.tpu.paged_attention import paged_attention
from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.tpu.kv_write import write_kv
from pallas_kernels.tpu.tuning import TpuTuning
