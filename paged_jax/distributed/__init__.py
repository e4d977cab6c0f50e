"""Scaling paged_jax past one device with JAX's own distributed runtime.

  mesh.py           `make_mesh(tp, dp)`, `validate_tp`, `dp_submeshes`: meshes with clear errors
  sharding.py       PartitionSpecs: Megatron-style params, KV pages split by KV head
  tp_forward.py     `TensorParallelDecoder`: the paged decoder (every family) per shard
  data_parallel.py  `DataParallelEngine`: dp engine replicas behind one router
  multiprocess.py   `jax.distributed.initialize` helpers (CPU gloo collectives, global arrays)

See docs/distributed.md for launching on a multi-host cluster.
"""

from paged_jax.distributed.mesh import (DP_AXIS, TP_AXIS, dp_size, dp_submeshes, make_mesh,
                                        tp_size, validate_tp)
from paged_jax.distributed.sharding import (kv_pages_specs, param_specs, per_device_bytes,
                                            replicate, shard_kv_pages, shard_params)
from paged_jax.distributed.tp_forward import (TensorParallelDecoder, TensorParallelLlama,
                                              cache_config_for_device_budget,
                                              local_model_config)
from paged_jax.distributed.tp_engine import make_tp_engine
from paged_jax.distributed.data_parallel import DataParallelEngine, Router
