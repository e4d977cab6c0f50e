"""The CPU paths of the two attention ops (not Pallas): what "auto" runs on a CPU.

  custom_calls.py + custom_calls.cc   XLA:CPU FFI custom calls: the block-table walk fused
                                      into an online softmax (f32; C++ built on first use)
  xla_attention.py                    plain jnp laid out for XLA:CPU (any dtype): the
                                      "xla" backend and the custom calls' fallback
"""
