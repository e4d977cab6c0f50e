"""experiments.perf_calibrate: the random Llama takes the named model's shapes, and the dry
run (CPU, tiny widths) measures, fits and predicts held-out steps end to end."""

from __future__ import annotations

import json

import pytest

from experiments import perf_calibrate
from paged_jax import perf


def test_the_random_llama_has_the_named_models_shapes():
  f = perf_calibrate.Config(model="llama-3-8b", num_layers=0)
  cfg = perf_calibrate.model_config(f)
  spec = perf.model_spec("llama-3-8b")
  built = perf_calibrate.device_model(f, cfg).model
  for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
               "ffn_size", "vocab_size", "dtype"):
    assert getattr(built, name) == getattr(spec, name), name
  assert built.param_count == spec.param_count
  four = perf_calibrate.model_config(perf_calibrate.Config(model="llama-3-8b", num_layers=4))
  assert four.num_layers == 4 and four.hidden_size == spec.hidden_size


def test_every_grid_batch_fits_the_default_pool():
  f = perf_calibrate.Config()
  f.check()   # the default --kv_budget_tokens holds the grid's largest batch
  with pytest.raises(ValueError, match="--kv_budget_tokens must be >= "):
    perf_calibrate.Config(kv_budget_tokens=4096).check()


@pytest.mark.slow
def test_dry_run_fits_and_predicts_held_out_steps(tmp_path):
  f = perf_calibrate.Config(dry_run=True, out=str(tmp_path))
  perf_calibrate.main(f, tmp_path)
  res = json.loads((tmp_path / "perf_calibrate.json").read_text())
  roles = {b["role"] for b in res["batches"]}
  assert roles == {"fit", "held_out"} and len(res["batches"]) == len(perf_calibrate.DRY_GRID)
  fit_steps = [s for s in res["steps"] if s["role"] == "fit"]
  assert len(fit_steps) == res["fit"]["num_steps"] and res["held_out"]["steps"] >= 1
  # The fit starts at the catalogue's efficiencies and only accepts steps that lower the
  # squared relative error of the steps it saw: its RMS error there is at most the prior's.
  rms = lambda key: (sum((s[key] / s["measured_s"] - 1) ** 2 for s in fit_steps)
                     / len(fit_steps)) ** 0.5
  assert rms("predicted_s") == pytest.approx(res["fit"]["rms_rel_error"])
  assert rms("predicted_s") <= rms("catalog_s") * (1 + 1e-9)
  for s in res["steps"]:
    assert s["measured_s"] > 0 and s["predicted_s"] > 0 and s["catalog_s"] > 0
  assert set(res["held_out"]["fitted"]) == {"mean_abs_rel_error", "max_abs_rel_error",
                                            "rms_rel_error"}
