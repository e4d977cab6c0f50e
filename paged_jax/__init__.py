"""paged_jax: PagedAttention as pure-functional JAX with Pallas kernels.

    import paged_jax as pj
    cfg = pj.CacheConfig(block_size=16, num_blocks=1024)
    state = pj.block_manager.init(cfg)

Submodules are imported on first attribute access, so `import paged_jax` stays
cheap and a notebook can reach every part through `pj.<module>`.
"""

import importlib

from paged_jax.config import (CacheConfig, INVALID, ModelConfig, OK, OUT_OF_BLOCKS,
                              OutOfBlocksError, STATUS_NAMES, TOO_LONG)

_SUBMODULES = ("attention", "bench", "block_manager", "block_manager_host", "config",
               "engine", "kv_cache", "layer_stack", "models", "perf", "prefix_cache", "testing",
               "distributed")

__version__ = "0.1.0"


def __getattr__(name):
  if name in _SUBMODULES:
    return importlib.import_module(f"paged_jax.{name}")
  raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
