"""experiments/compile_maps on this interpreter, default XLA:CPU setting, one step shape (a
child process): compiling a step adds memory maps (code among them), and with JAX's
persistent cache on, the same shape met again by a fresh jit is a cache hit."""

import sys

import pytest

from experiments import compile_maps


@pytest.mark.slow   # ~35 s on 2 cores: the child compiles the tiny model's step 5 times
def test_one_shape_adds_maps_and_reloads_from_the_cache():
  result = compile_maps.run([sys.executable], ["default"], num_shapes=1)
  assert result["max_map_count"] > 0
  (r,) = result["runs"]
  assert "error" not in r, r.get("error")
  assert r["setting"] == "default" and len(r["maps_per_shape"]) == 1
  (compiled,) = r["compiled"]
  assert compiled["maps"]["total"] > 0 and compiled["maps"].get("r-xp", 0) > 0
  assert compiled["seconds"] > 0
  assert set(r["released"]) == {"drop_compiled_objects", "first_jit_clear_cache",
                                "jax_clear_caches"}
  assert r["shared_jit"]["shapes"] == 2 and r["shared_jit"]["maps"] > 0
  assert r["reload"]["cache_hit"]
  (row,) = compile_maps.summary_rows(result)
  assert row[:3] == [r["jax"], "default", r["mean_maps_per_shape"]]


def test_bad_settings_and_shape_counts_are_refused():
  with pytest.raises(ValueError, match="settings must be among"):
    compile_maps.run([sys.executable], ["fastest"])
  with pytest.raises(ValueError, match="shapes must be in"):
    compile_maps.run([sys.executable], ["default"], num_shapes=0)
