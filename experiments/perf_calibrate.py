r"""The device-time model's constants measured on this machine's accelerator (issue 25 pt 5).

    python -m experiments.perf_calibrate --model=llama-3-8b --gpu=h200 --out=DIR   # on an H200
    python -m experiments.perf_calibrate --dry_run --out=DIR      # CPU: tiny widths, 2 layers

1. Builds `--model`'s shapes (width, heads, FFN, vocabulary; `--num_layers` of its layers,
   so the compile stays short) as a Llama with random weights
   (`paged_jax.models.decoder.init_params`) and the real `Engine` on a KV pool of
   `--kv_budget_tokens` slots, shape buckets on (as served);
2. times every step of a grid of batches (`bench.calibration.measure_steps`: B requests of
   P-token prompts decoding T tokens, all at t = 0; each batch runs once untimed first,
   so every shape it meets is compiled before it is timed): prefill chunks of 32-2,048
   tokens, decode batches of 1-256 rows at contexts 64-2,048;
3. fits the device-time model of exactly those shapes on `--gpu`'s catalogue peaks
   (`perf.fit_efficiency`, starting from the catalogue's efficiencies) to the steps of
   every other batch, and predicts the steps of the rest (held out), beside what the
   catalogue's assumed efficiencies predict for them.

Writes DIR/perf_calibrate.json: {"fit": FitResult.as_dict() (the fitted efficiencies, what
was held), "held_out": {"fitted": errors, "catalog": errors} (|predicted / measured - 1|
mean / max / RMS over held-out steps), "batches", "steps", "model", flags, versions,
machine}. The fitted "efficiency" replaces `perf.catalog.DEFAULT_EFFICIENCY` for that GPU
(`perf.Efficiency(**json["fit"]["efficiency"])`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Tuple

from experiments import common
from experiments import configs
from experiments import provenance
from paged_jax import perf

# (requests, prompt tokens, output tokens): batch 1 to 256, prompts 32-2,048 tokens.
GRID = ((1, 2048, 8), (1, 64, 32), (4, 512, 16), (16, 128, 16), (32, 1024, 8),
        (64, 256, 12), (128, 64, 12), (256, 32, 8))
DRY_GRID = ((1, 96, 6), (2, 24, 8), (4, 48, 6), (8, 16, 8))
# The dry run's model: tiny widths on the CPU's nominal peaks (bench.calibration.CPU).
DRY_WIDTHS = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                  head_dim=16, vocab_size=256)
LLAMA_MODELS = tuple(n for n, s in perf.MODELS.items() if s.gated_mlp)


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.perf_calibrate."""
  model: str = configs.flag("llama-3-8b", "whose shapes the random Llama takes",
                            choices=LLAMA_MODELS)
  gpu: str = configs.flag("h200", "the accelerator this runs on (its catalogue peaks)",
                          choices=tuple(perf.GPUS))
  num_layers: int = configs.flag(4, "layers built (0: all of the model's)", lower=0)
  kv_budget_tokens: int = configs.flag(65536, "KV pool (token slots)", lower=1)
  block_size: int = configs.flag(16, "engine block size", lower=1)
  max_num_batched_tokens: int = configs.flag(2048, "tokens a step (prefill chunk size)",
                                             lower=1)
  dry_run: bool = configs.flag(False, "CPU: tiny widths, 2 layers, a small grid, the CPU's "
                               "nominal peaks (checks this script without a GPU)")
  seed: int = configs.flag(0, "weights and prompts seed")
  out: str = configs.flag("results/perf_calibrate", "output directory")

  def check(self) -> None:
    configs.check_multiple(self, "kv_budget_tokens", "block_size")
    grid = DRY_GRID if self.dry_run else GRID
    need = max(n * -(-(p + t) // self.block_size) for n, p, t in grid) * self.block_size
    if self.kv_budget_tokens < need:
      raise ValueError(f"--kv_budget_tokens must be >= {need} (the largest batch of the "
                       f"grid), got {self.kv_budget_tokens}")


def model_config(f: Config):
  """The random Llama's ModelConfig: the named model's shapes (tiny widths in a dry run)."""
  from paged_jax.config import ModelConfig  # pylint: disable=g-import-not-at-top
  spec = perf.model_spec(f.model)
  layers = f.num_layers or spec.num_layers
  if f.dry_run:
    return ModelConfig(num_layers=2, max_position_embeddings=256, dtype="float32",
                       **DRY_WIDTHS)
  return ModelConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                     intermediate_size=spec.ffn_size, num_layers=layers,
                     num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     head_dim=spec.head_dim, max_position_embeddings=spec.max_context,
                     tie_word_embeddings=spec.tie_word_embeddings, dtype=spec.dtype)


def device_model(f: Config, cfg) -> perf.DeviceTimeModel:
  """The model of the shapes built, on `--gpu` (the CPU's nominal peaks in a dry run)."""
  from paged_jax.bench import calibration  # pylint: disable=g-import-not-at-top
  spec = perf.ModelSpec.from_model_config(cfg, name=f"random-{f.model}-{cfg.num_layers}l")
  return perf.DeviceTimeModel(model=spec, gpu=calibration.CPU if f.dry_run else
                              perf.gpu_spec(f.gpu))


def _engine_fn(f: Config, cfg, params, max_len: int):
  from paged_jax.engine import Engine  # pylint: disable=g-import-not-at-top
  cache = cfg.cache_config(block_size=f.block_size,
                           num_blocks=f.kv_budget_tokens // f.block_size, max_seqs=256,
                           max_blocks_per_seq=-(-max_len // f.block_size),
                           enable_prefix_caching=False)   # the paper's system
  return lambda: Engine(cfg, params, cache, max_num_batched_tokens=f.max_num_batched_tokens)


def measure(f: Config) -> Tuple[object, List[List]]:
  """(ModelConfig, per grid batch its [(StepShape, seconds)] samples)."""
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax.bench import calibration  # pylint: disable=g-import-not-at-top
  from paged_jax.models.decoder import init_params  # pylint: disable=g-import-not-at-top
  cfg = model_config(f)
  params = init_params(cfg, jax.random.key(f.seed))
  grid = DRY_GRID if f.dry_run else GRID
  make = _engine_fn(f, cfg, params, max(p + t for _, p, t in grid))
  per_batch = []
  with common.progress(total=len(grid), desc="calibration batches") as bar:
    for batch in grid:
      per_batch.append(calibration.measure_steps(make, (batch,), seed=f.seed))
      bar.update(1)
  return cfg, per_batch


def run(f: Config) -> Dict:
  from paged_jax.bench import calibration  # pylint: disable=g-import-not-at-top
  start = time.time()
  cfg, per_batch = measure(f)
  fit_samples = [s for k, b in enumerate(per_batch) if k % 2 == 0 for s in b]
  held_samples = [s for k, b in enumerate(per_batch) if k % 2 == 1 for s in b]
  fit_steps, held = calibration.grouped(fit_samples), calibration.grouped(held_samples)
  prior = device_model(f, cfg)
  fit = perf.fit_efficiency(prior, [s for s, _ in fit_steps], [t for _, t in fit_steps],
                            source=f"perf_calibrate: {len(fit_steps)} step groups of a "
                            f"random {f.model} ({cfg.num_layers} layers) on {f.gpu}")
  held_shapes, held_s = [s for s, _ in held], [t for _, t in held]
  grid = DRY_GRID if f.dry_run else GRID
  return {
      "fit": fit.as_dict(),
      "held_out": {"steps": len(held),
                   "fitted": perf.relative_errors(fit.model, held_shapes, held_s),
                   "catalog": perf.relative_errors(prior, held_shapes, held_s)},
      "batches": [{"requests": n, "prompt_tokens": p, "output_tokens": t, "steps": len(b),
                   "role": "fit" if k % 2 == 0 else "held_out",
                   "median_step_s": sorted(s for _, s in b)[len(b) // 2] if b else None}
                  for k, ((n, p, t), b) in enumerate(zip(grid, per_batch))],
      "steps": [{"rows": s.num_rows, "tokens": s.num_tokens, "bucket_tokens": s.bucket_tokens,
                 "context_tokens": sum(s.context_lens), "measured_s": t,
                 "predicted_s": fit.model.step_seconds(s), "catalog_s": prior.step_seconds(s),
                 "role": role}
                for role, group in (("fit", fit_steps), ("held_out", held))
                for s, t in group],
      "model": dict(prior.as_dict(), model_config=dataclasses.asdict(cfg)),
      "seconds": time.time() - start,
  }


def main(f: Config, out):
  result = dict(run(f), **provenance.run_metadata(f))   # run() records its own seconds
  fit, held = result["fit"], result["held_out"]
  common.report(
      result, out, "perf_calibrate.json",
      [[name, f"{v:.3g}"] for name, v in fit["efficiency"].items() if isinstance(v, float)],
      ["constant", "fitted"],
      [f"fit: {fit['num_steps']} step groups, mean |error| {fit['mean_abs_rel_error']:.1%}; "
       f"held out ({held['steps']} groups): fitted {held['fitted']['mean_abs_rel_error']:.1%} "
       f"mean / {held['fitted']['max_abs_rel_error']:.1%} max, catalogue "
       f"{held['catalog']['mean_abs_rel_error']:.1%} mean; held at the prior: "
       f"{', '.join(fit['held']) or 'none'}"],
      wrote_suffix=f" ({result['seconds']:.0f} s)")


if __name__ == "__main__":
  common.run_app(main, Config)
