"""Pallas kernels on the GPU Triton backend (any CUDA GPU; tuned for sm_90).

  paged_attention.py          decode: one query per sequence, split-K over its pages
  ragged_paged_attention.py   mixed prefill + decode: query tiles, two launches
  tuning.py                   the sm_90 resource model both use: default tiles, warps and
                              stages per dtype / head_dim, the shared-memory budget

Each op file holds its checks, its frozen `TuningConfig`, the kernel, the pallas_call
wrapper and the public entry. JAX deprecates the Triton backend from 0.11.0 (Mosaic GPU:
../mosaic_gpu/); these kernels remain the portable path and the fallback of "auto".
"""
