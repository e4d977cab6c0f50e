"""`EngineOptions`: one frozen, validated record of an engine's knobs. Every bad value is
a one-line ValueError naming the option and its range, raised on construction (before
any device work); `Engine` takes the same keywords as before or `options=`, and
`fresh_copy` / `step_for_compile` go through the same record."""

import dataclasses

import jax
import pytest

from paged_jax.engine import Engine, EngineOptions, step_for_compile

from engine_oracle import MC, PARAMS

CC = MC.cache_config(block_size=16, num_blocks=12, max_seqs=8, max_blocks_per_seq=4)


@pytest.mark.parametrize("kw, name", [
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be an int in \[1, "),
    (dict(max_num_batched_tokens=2**21), "max_num_batched_tokens"),
    (dict(decode_steps_per_sync=True), "decode_steps_per_sync"),
    (dict(decode_steps_per_sync=1.0), "decode_steps_per_sync"),
    (dict(max_beam_width=-1), "max_beam_width"),
    (dict(preemption_mode="drop"), "preemption_mode must be one of recompute, swap, auto"),
    (dict(attention_backend="nope"), "attention_backend"),
    (dict(attention_backend=None), "attention_backend"),
    (dict(max_probe=0), r"max_probe must be an int in \[1, 1024\]"),
    (dict(hash_mode="md5"), "hash_mode"),
    (dict(shape_buckets=1), "shape_buckets"),
    (dict(decode_shape="yes"), "decode_shape must be True or False"),
    (dict(model_apply=3), "model_apply"),
    (dict(init_state="x"), "init_state"),
])
def test_every_bad_option_is_one_line_naming_it(kw, name):
  with pytest.raises(ValueError, match=name) as e:
    EngineOptions(**kw)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=name):   # the engine validates through it
    Engine(MC, PARAMS, CC, **kw)


def test_options_are_frozen_and_keywords_or_options_build_the_same_engine():
  opts = EngineOptions(max_num_batched_tokens=8, attention_backend="reference",
                       preemption_mode="swap")
  with pytest.raises(dataclasses.FrozenInstanceError):
    opts.max_num_batched_tokens = 16
  a = Engine(MC, PARAMS, CC, options=opts)
  b = Engine(MC, PARAMS, CC, max_num_batched_tokens=8, attention_backend="reference",
             preemption_mode="swap")
  assert a.options == b.options == opts
  assert a.max_num_batched_tokens == 8 and a.scheduler.preemption_mode == "swap"
  # Keywords override `options`; the step is shared when the step-shaping options agree.
  c = Engine(MC, PARAMS, CC, options=opts, preemption_mode="recompute")
  assert c.options == dataclasses.replace(opts, preemption_mode="recompute")
  assert c._compiled is a._compiled is b._compiled   # pylint: disable=protected-access
  copy = a.fresh_copy()
  assert copy.options == opts and copy._compiled is a._compiled   # pylint: disable=protected-access
  with pytest.raises(TypeError, match="unknown engine option 'max_batch'"):
    Engine(MC, PARAMS, CC, max_batch=4)
  with pytest.raises(ValueError, match="options must be an EngineOptions"):
    Engine(MC, PARAMS, CC, options={"max_num_batched_tokens": 8})


def test_step_for_compile_takes_options_or_keywords_alike():
  opts = EngineOptions(max_num_batched_tokens=8, attention_backend="reference")
  fn_a, args_a = step_for_compile(MC, CC, options=opts)
  fn_b, args_b = step_for_compile(MC, CC, max_num_batched_tokens=8,
                                  attention_backend="reference")
  assert fn_a is fn_b
  shapes = lambda args: [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)]
  assert shapes(args_a) == shapes(args_b)
  with pytest.raises(ValueError, match="preemption_mode"):
    step_for_compile(MC, CC, preemption_mode="drop")
