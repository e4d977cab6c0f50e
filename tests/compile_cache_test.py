"""paged_jax.compile_cache: engine steps compiled in one process load in the next.

The round trip runs two fresh interpreters over one cache directory: the first compiles
and stores the engine's steps, the second must load them (JAX's cache-hit events) and
generate exactly what the first did.
"""

import json
import os
import subprocess
import sys

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import common
from paged_jax import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r"""
import json, sys
from jax import monitoring
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
from paged_jax import compile_cache
from paged_jax.bench import engines
from paged_jax.engine import SamplingParams
compile_cache.enable(sys.argv[1], min_compile_time_s=0)
engine = engines.make_engine(block_size=16, kv_budget_tokens=256, max_seqs=4)
outs = engine.generate([[1, 2, 3, 4, 5], [9, 8, 7]],
                       SamplingParams(max_tokens=6, temperature=0.0))
print(json.dumps({"outputs": [o.outputs[0] for o in outs],
                  "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def _run(cache_dir):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _PROBE, str(cache_dir)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_steps_and_generates_the_same(tmp_path):
  first = _run(tmp_path / "xla")
  assert first["misses"] >= 1 and first["hits"] == 0
  stored = os.listdir(tmp_path / "xla")
  assert any(name.startswith("jit_step-") for name in stored), stored   # the engine step
  second = _run(tmp_path / "xla")
  assert second["hits"] >= first["misses"] - second["misses"] > 0
  assert second["misses"] < first["misses"]
  assert second["outputs"] == first["outputs"]
  assert all(len(o) == 6 for o in first["outputs"])


_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


@pytest.fixture
def restore_cache_setting():
  before = {name: getattr(jax.config, name) for name in _SETTINGS}
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  jax_cache.reset_cache()


def test_a_second_enable_moves_the_cache(tmp_path, restore_cache_setting):
  # JAX opens its cache at the first compile; enable() must make later compiles use the
  # new directory, and disable() must stop them.
  del restore_cache_setting
  compile_cache.enable(tmp_path / "first", min_compile_time_s=0)
  jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
  compile_cache.enable(tmp_path / "second", min_compile_time_s=0, max_bytes=1 << 20)
  assert jax.config.jax_compilation_cache_max_size == 1 << 20
  jax.jit(lambda x: x * 5 - 2)(jnp.arange(6.0)).block_until_ready()
  entries = lambda d: [n for n in os.listdir(tmp_path / d) if n.startswith("jit_")]
  assert entries("first") and entries("second")
  assert not set(entries("first")) & set(entries("second"))
  compile_cache.disable()
  before = len(entries("second"))
  jax.jit(lambda x: x * 7 + 3)(jnp.arange(7.0)).block_until_ready()
  assert len(entries("second")) == before


def test_enable_and_disable(tmp_path, restore_cache_setting):
  del restore_cache_setting
  assert compile_cache.enable(tmp_path / "a" / "b") == tmp_path / "a" / "b"
  assert compile_cache.directory() == str(tmp_path / "a" / "b")
  compile_cache.disable()
  assert compile_cache.directory() is None
  assert common.use_compilation_cache(str(tmp_path / "c")) == str(tmp_path / "c")
  assert common.use_compilation_cache("none") is None
  assert compile_cache.default_directory().name == "xla"


def test_bad_directory_and_time_are_one_line_errors(tmp_path, restore_cache_setting):
  del restore_cache_setting
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  with pytest.raises(ValueError, match="cannot be created"):
    compile_cache.enable(a_file / "xla")
  with pytest.raises(ValueError, match="min_compile_time_s must be >= 0"):
    compile_cache.enable(tmp_path, min_compile_time_s=-1)
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
      compile_cache.enable(tmp_path, max_bytes=bad)
  assert compile_cache.directory() != str(tmp_path)


def test_a_released_executable_loads_from_the_cache_when_its_shape_comes_back(
    tmp_path, restore_cache_setting):
  # paged_jax.executables releases least recently used jits to stay under the map limit;
  # with the persistent cache on, a released shape that comes back is loaded, not compiled.
  del restore_cache_setting
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  from paged_jax import executables  # pylint: disable=g-import-not-at-top
  compile_cache.enable(tmp_path / "xla", min_compile_time_s=0)
  events = []
  listener = lambda name, **kw: events.append(name)
  monitoring.register_event_listener(listener)
  budget = executables.ExecutableBudget(max_live=1)
  step = lambda x, state, *, scale: (state + jnp.sum(jnp.tanh(x * scale)), x.T @ x)
  x = jnp.asarray(np.arange(12.0, dtype=np.float32).reshape(4, 3))
  call = lambda scale: budget.get(scale, lambda: executables.shape_jit(
      step, donate_argnums=(1,), scale=scale))(x, jnp.zeros((2,)))
  try:
    first = [np.asarray(a) for a in call(0.5)]
    call(2.0)                         # releases the 0.5 jit (one live at most)
    assert 0.5 not in budget
    hits = events.count("/jax/compilation_cache/cache_hits")
    again = [np.asarray(a) for a in call(0.5)]
  finally:
    monitoring.unregister_event_listener(listener)
    budget.release()
  assert events.count("/jax/compilation_cache/cache_hits") == hits + 1
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
