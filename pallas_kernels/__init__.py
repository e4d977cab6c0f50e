"""Pallas kernels for paged attention: one kernel per file, plain-jnp reference beside them."""
