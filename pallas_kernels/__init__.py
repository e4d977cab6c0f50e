"""Pallas kernels for paged attention: one kernel per file, plain-jnp reference beside them.

Public entries (same signatures as the references in `reference.py`, plus `interpret`,
`gpu_backend="auto" | "triton" | "mosaic_gpu"` and keyword-only tuning knobs; the choice
is made in `backends.py`):
  paged_attention(q, k_pages, v_pages, block_tables, lengths, ...)           decode
  ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                         cu_q_lens, num_seqs, ...)                           prefill + decode

Kernels: paged_attention.py / ragged_paged_attention.py (Triton backend),
mosaic_paged_attention.py (Mosaic GPU, Hopper). The names below are bound after the
modules are imported, so they refer to the dispatching functions and not to the
submodules of the same name.
"""

from pallas_kernels.reference import (dense_attention, paged_attention_reference,
                                      ragged_paged_attention_reference)
from pallas_kernels.backends import GPU_BACKENDS
from pallas_kernels.backends import paged_attention
from pallas_kernels.backends import ragged_paged_attention
