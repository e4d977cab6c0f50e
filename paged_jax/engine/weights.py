"""The model's parameters checked against its config before an engine takes them
(`check_params`: the first leaf whose path or shape does not fit, in one line)."""

from __future__ import annotations

import jax

from paged_jax.config import ModelConfig


def param_shapes(model_config: ModelConfig):
  """The model's parameter tree as ShapeDtypeStructs ({"params": ...}); allocates nothing."""
  from paged_jax.models import llama  # pylint: disable=g-import-not-at-top
  return jax.eval_shape(lambda: llama.init_params(model_config, jax.random.key(0)))


def check_params(model_config: ModelConfig, params):
  """`params` as {"params": tree}; a one-line ValueError naming the first leaf whose
  path or shape does not fit `model_config`."""
  if not hasattr(params, "keys"):
    raise ValueError(f"params must be a dict of arrays, got {type(params).__name__}")
  params = params if "params" in params else {"params": params}
  want = dict(jax.tree_util.tree_flatten_with_path(param_shapes(model_config))[0])
  got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  name = lambda path: jax.tree_util.keystr(path)
  for path in want:
    if path not in got:
      raise ValueError(f"params lack {name(path)} of shape {want[path].shape} "
                       f"(model_config: {model_config.num_layers} layers, hidden "
                       f"{model_config.hidden_size})")
    shape = tuple(getattr(got[path], "shape", ()))
    if shape != tuple(want[path].shape):
      raise ValueError(f"params{name(path)} has shape {shape}, the model_config needs "
                       f"{tuple(want[path].shape)}")
  extra = [p for p in got if p not in want]
  if extra:
    raise ValueError(f"params hold {name(extra[0])}, which the model_config has no place for")
  return params
