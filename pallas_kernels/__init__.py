"""Paged attention kernels, grouped by backend, with one backend table and one oracle.

Where each thing lives (one op per file: its checks, a frozen `TuningConfig`, the kernel,
its wrapper and public entry, and the plain-jnp reference it is tested against):

  reference.py                 the plain-jnp oracle every backend is tested against
  backends.py                  THE backend table, keyed by (implementation, kernel family,
                               interpret), the "auto" choice, and the entries below
  targets.py                   the device a call runs / is compiled on ("auto" decides by it)
  checks.py                    shape / dtype / argument checks every backend runs first
  common.py, tiling.py         shared helpers; the one query-tile planner of ragged kernels
  triton/                      Pallas on the GPU Triton backend (any CUDA GPU)
    paged_attention.py           decode
    ragged_paged_attention.py    mixed prefill + decode
    tuning.py                    sm_90 resource model: defaults and knob budgets
  mosaic_gpu/                  Pallas on Mosaic GPU (Hopper, sm_90a)
    paged_attention.py, ragged_paged_attention.py, pipeline.py (their shared KV loop)
  tpu/                         Pallas on TPU (Mosaic TPU)
  cpu/                         not Pallas: the CPU paths of the same two ops
    custom_calls.py + .cc        XLA:CPU FFI kernels (C++ built on first use), f32
    xla_attention.py             plain jnp laid out for XLA:CPU (any dtype; their fallback)
  deviceless/                  compile for an H200 that is not there (tests, one experiment)
    target.py, cases.py, triton_configs.py, mosaic_configs.py

The CPU paths stay in this package (not beside it) so the one backend table can name
every implementation without an import going up from pallas_kernels to paged_jax.

Public entries (signatures of the references, plus `interpret`, `backend="auto" |
"triton" | "mosaic_gpu" | "tpu"` (`gpu_backend=` still accepted) and keyword-only knobs):
  paged_attention(q, k_pages, v_pages, block_tables, lengths, ...)           decode
  ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                         cu_q_lens, num_seqs, ...)                           prefill + decode
`paged_jax.attention` takes the implementation spellings ("auto", "reference", "xla",
"cpu", "pallas", "pallas_interpret", "pallas:triton", ...) through the same table.
"""

from pallas_kernels.reference import (dense_attention, paged_attention_reference,
                                      ragged_paged_attention_reference)
from pallas_kernels.backends import BACKENDS, GPU_BACKENDS, KERNEL_FAMILIES
from pallas_kernels.backends import paged_attention
from pallas_kernels.backends import ragged_paged_attention
