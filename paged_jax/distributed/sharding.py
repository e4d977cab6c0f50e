"""PartitionSpecs and placement for tensor-parallel decoder params and paged KV.

Megatron-style split of each decoder layer (every family of `models/decoder.py`) over the
mesh's `tp` axis:

    q_proj, k_proj, v_proj, gate_proj, up_proj  kernel [in, out]  P(None, 'tp')  column-parallel
                                                bias [out]        P('tp')        like its outputs
    o_proj, down_proj                           kernel [in, out]  P('tp', None)  row-parallel
                                                bias [out]        P()            added once,
                                                                                 after the psum
    norms (incl. q_norm / k_norm over head_dim), embedding, lm_head              P() replicated

Column-parallel outputs are whole heads (q/k/v kernels are head-major, `out =
head * head_dim + d`), so shard i holds query heads [i*Hq/tp, (i+1)*Hq/tp) and KV
heads [i*Hkv/tp, ...) with their biases: grouped-query attention stays local (query
head h reads KV head h // (Hq/Hkv) on the same shard). Row-parallel outputs are partial
sums, all-reduced once per attention and once per MLP (`tp_forward.py`); their bias
must join once, after that sum, not once per shard.

A parameter this table does not name raises instead of being silently replicated: a new
projection would otherwise compute the wrong thing on every shard.

KV pages (one `[kv_heads, blocks, block_size, head_dim]` array per layer) are split
on the KV-head axis, `P('tp')` (int8 / fp8 scales likewise): each device holds
1/tp of every block, so at a fixed per-device budget the pool holds tp times
more blocks. Block-manager state (block tables, ref counts, free stack) and
attention metadata are replicated: every shard sees the same tables, so
allocation needs no communication.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax import kv_cache
from paged_jax.distributed.mesh import TP_AXIS

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm", "norm", "q_norm", "k_norm")
KV_PAGES_SPEC = P(TP_AXIS)       # each layer's k / v: [KV heads (split), blocks, bs, D]
KV_SCALES_SPEC = P(TP_AXIS)      # each layer's k_scale / v_scale: [KV heads (split), ...]


def path_names(path) -> tuple:
  """A tree_util key path as a tuple of names, e.g. ("params", "lm_head", "kernel")."""
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_spec(names: tuple, ndim: int) -> P:
  """PartitionSpec of one decoder parameter, from its path in the params tree.

  Raises:
    ValueError: a parameter with no known placement (named by its path).
  """
  module, leaf = (names[-2], names[-1]) if len(names) >= 2 else ("", "")
  if module in COLUMN_PARALLEL and (leaf, ndim) in (("kernel", 2), ("bias", 1)):
    return P(None, TP_AXIS) if leaf == "kernel" else P(TP_AXIS)   # split like the outputs
  if module in ROW_PARALLEL and (leaf, ndim) in (("kernel", 2), ("bias", 1)):
    return P(TP_AXIS, None) if leaf == "kernel" else P()          # bias: whole, added once
  if ((module in NORMS and (leaf, ndim) == ("weight", 1))
      or (module, leaf, ndim) in (("embed_tokens", "embedding", 2), ("lm_head", "kernel", 2))):
    return P()
  raise ValueError(
      f"param {'/'.join(names)} (ndim {ndim}) has no tensor-parallel placement: "
      f"column-parallel {COLUMN_PARALLEL}, row-parallel {ROW_PARALLEL} kernels/biases, "
      f"norms {NORMS}, embed_tokens and lm_head are known")


def is_row_parallel_bias(names: tuple) -> bool:
  """True for the bias of o_proj / down_proj (added after the all-reduce, `tp_forward`)."""
  return len(names) >= 2 and names[-2] in ROW_PARALLEL and names[-1] == "bias"


def param_specs(params) -> Any:
  """Pytree of PartitionSpecs matching `params` (a `DecoderForCausalLM` params tree)."""
  found = {n for n in _layer_names(params)}
  if not found & set(COLUMN_PARALLEL) or not found & set(ROW_PARALLEL):
    raise ValueError(
        "params do not look like a DecoderForCausalLM (LlamaForCausalLM) tree: no "
        f"{COLUMN_PARALLEL + ROW_PARALLEL} kernels found (found modules {sorted(found)[:8]})")
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: param_spec(path_names(path), getattr(leaf, "ndim", 0)), params)


def _layer_names(params):
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = path_names(path)
    if len(names) >= 2:
      yield names[-2]


def kv_pages_specs(pages: kv_cache.KVPages) -> kv_cache.KVPages:
  """KVPages of PartitionSpecs (one per layer): pages and scales split by KV head."""
  return pages.map_layers(lambda x: KV_SCALES_SPEC if x.ndim == 3 else KV_PAGES_SPEC)


def named(mesh: Mesh, specs) -> Any:
  """Maps a pytree of PartitionSpecs to NamedShardings on `mesh`."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda x: isinstance(x, P))


def _place(tree, shardings):
  return jax.tree_util.tree_map(jax.device_put, tree, shardings)


def shard_params(params, mesh: Mesh):
  """Params placed Megatron-style on `mesh` (see the module docstring)."""
  return _place(params, named(mesh, param_specs(params)))


def shard_kv_pages(pages: kv_cache.KVPages, mesh: Mesh) -> kv_cache.KVPages:
  """KV pages placed on `mesh`, split by KV head over `tp`."""
  if pages.num_kv_heads % mesh.shape[TP_AXIS]:
    raise ValueError(f"num_kv_heads={pages.num_kv_heads} is not divisible by "
                     f"tp={mesh.shape[TP_AXIS]}")
  return _place(pages, named(mesh, kv_pages_specs(pages)))


def replicate(tree, mesh: Mesh):
  """Every leaf of `tree` fully replicated on `mesh` (block-manager state, metadata)."""
  rep = NamedSharding(mesh, P())
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, rep), tree)


def per_device_bytes(tree) -> dict:
  """{device: bytes of `tree`'s shards held on that device} (addressable shards only)."""
  out = {}
  for leaf in jax.tree_util.tree_leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out
