"""Pallas kernels on the Mosaic GPU backend (Hopper, sm_90a: TMA, wgmma).

  paged_attention.py          decode
  ragged_paged_attention.py   mixed prefill + decode (query tiles of 64 logit rows)
  pipeline.py                 the KV loop both share (TMA ring, wgmma, online softmax),
                              what the kernels support and their shared-memory model

Interpret mode (the kernels on a CPU, races checked) needs jax >= 0.11.2.
"""
