"""Pallas kernels for paged attention: one kernel per file, plain-jnp reference beside them.

Public entries (same signatures as the references in `reference.py`, plus `interpret` and
keyword-only tuning knobs):
  paged_attention(q, k_pages, v_pages, block_tables, lengths, ...)           decode
  ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens,
                         cu_q_lens, num_seqs, ...)                           prefill + decode

The functions are bound eagerly here, after their modules are imported, so the names
refer to the functions and not to the submodules of the same name.
"""

from pallas_kernels.reference import (dense_attention, paged_attention_reference,
                                      ragged_paged_attention_reference)


def _optional(module_name, attr):
  """Imports `attr` from a kernel module that may not exist yet (other work in flight)."""
  import importlib  # pylint: disable=g-import-not-at-top
  full = f"pallas_kernels.{module_name}"
  try:
    module = importlib.import_module(full)
  except ModuleNotFoundError as e:
    if e.name != full:
      raise
    return None
  return getattr(module, attr)


paged_attention = _optional("paged_attention", "paged_attention")
ragged_paged_attention = _optional("ragged_paged_attention", "ragged_paged_attention")
