r"""The device-time model's FLOPs and bytes per step beside XLA's cost analysis of the step
compiled deviceless for an A100 / H100 / H200 and a TPU v5e / v6e (issue 42 point 3).

    python -m experiments.cost_analysis --out=experiments/results/cost_analysis

Per model (Llama-style catalog models) and target: one forward pass compiled with
`--layers` of the model's layers (its real layer shapes and vocabulary; a fewer-layer
compile keeps each under a minute here, and the model side is cut to the same layers, so
the figures compare per layer) for a decode step (`--decode_rows` sequences at
`--context` tokens) and a prefill step (`--prefill_rows` prompts of `--context` tokens),
plus the decode step with twice the K/V pool (XLA's charge per pool byte). The library is
`paged_jax/bench/cost_analysis.py` (how each target's cost analysis is read: the
compile-only GPU client has none, so the compiled GPU module is analysed through the CPU
client, and the GPU Pallas lowerings drop the kernels' `pl.CostEstimate`s).

Writes OUT/cost_analysis.json (flags, versions, machine, rows, failures) and prints the
table docs/paper_scale.md renders (tools/render_results.py, section cost_analysis).
Needs the compile extras (requirements-compile.txt): jax-cuda12 plugin and libtpu; a
target whose compiler is missing is a failure row naming why.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

from experiments import common
from experiments import configs


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.cost_analysis."""
  out: str = configs.flag("results/cost_analysis", "output directory")
  models: Tuple[str, ...] = configs.flag(("llama-3-8b", "llama-13b"),
                                         "Llama-style paged_jax.perf.catalog models")
  targets: Tuple[str, ...] = configs.flag(("a100", "h100", "h200", "v5e", "v6e"),
                                          "compile targets",
                                          choices=("a100", "h100", "h200", "v5e", "v6e"))
  layers: int = configs.flag(2, "decoder layers compiled (and modelled)")
  context: int = configs.flag(2048, "tokens of each row's context (decode) / prompt "
                              "(prefill)")
  decode_rows: int = configs.flag(8, "sequences of the decode step")
  prefill_rows: int = configs.flag(1, "prompts of the prefill step")
  block_size: int = configs.flag(16, "tokens per K/V page")


HEADERS = ["model", "target", "step", "attention", "linear GFLOP model / XLA",
           "attention GFLOP model / kernels", "weights+act MB model / XLA net",
           "K/V MB model / kernels", "XLA charges MB", "XLA total GB", "compile s"]


def _cells(row):
  e, m, c = row["explained"], row["perf_model"], row["compiled"]
  g, mb = lambda x: round(x / 1e9, 2), lambda x: round(x / 1e6, 1)
  ratio = lambda r: f" ({r:.3g}x)" if r is not None else ""
  return [row["model"], row["target"], row["phase"], c["backend"].split(":")[-1],
          f"{g(m['linear_flops'])} / {g(e['rest_flops'])}{ratio(e['linear_flops_ratio'])}",
          f"{g(m['attention_flops'])} / {g(c['declared']['flops'])}"
          f"{ratio(e['attention_flops_ratio'])}",
          f"{mb(m['weight_bytes'] + m['activation_bytes'])} / {mb(e['rest_net_bytes'])}"
          f"{ratio(e['rest_bytes_ratio'])}",
          f"{mb(m['kv_bytes'])} / {mb(c['declared']['bytes_accessed'])}"
          f"{ratio(e['kernel_bytes_ratio'])}",
          f"{mb(e['whole_operand_charges'])} (pool x{e['pool_slope']:.2g})",
          g(row["compiled_total_bytes"]), c["compile_s"]]


def summary_rows(result) -> list:
  """The table's rows from a written result (tools/render_results.py)."""
  return [_cells(r) for r in result["rows"]]


def run(config: Config) -> dict:
  """Rows (decode and prefill per model and target, each with `explained`) and
  failures; the library call behind main (tests call it at a tiny size)."""
  from paged_jax.bench import cost_analysis as ca  # pylint: disable=g-import-not-at-top
  rows, failures = [], []
  jobs = [(m, t) for m in config.models for t in config.targets]
  for model, target in common.progress(jobs, desc="compiles"):
    base = ca.CostCase(model, "decode", target=target, layers=config.layers,
                       rows=config.decode_rows, context=config.context,
                       block_size=config.block_size)
    try:
      decode = ca.measure(base)
      bigger = ca.measure(dataclasses.replace(base, pool_scale=2))
      prefill = ca.measure(dataclasses.replace(base, phase="prefill",
                                               rows=config.prefill_rows))
    except Exception as e:  # pylint: disable=broad-except
      failures.append({"model": model, "target": target, "error": common.one_line(e)[:500]})
      print(f"FAILED {model} {target}: {failures[-1]['error']}")
      continue
    slope = ca.pool_slope(decode, bigger)
    for row in (decode, prefill):
      row["explained"] = ca.explain(row, slope)
      rows.append(row)
  return dict(rows=rows, failures=failures)


def main(config, out):
  import jax  # pylint: disable=g-import-not-at-top
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  found = run(config)
  libs = {}
  for pkg in ("libtpu", "jax-cuda12-plugin"):
    try:
      libs[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      libs[pkg] = None
  result = dict(common.run_metadata(config),
                target={"jax": jax.__version__, **libs, "layers": config.layers,
                        "scaled": f"{config.layers} layers of each model compiled and "
                                  "modelled (per-layer figures compare; the LM head and "
                                  "embedding are the model's)"},
                **found)
  path = common.write_json(out / "cost_analysis.json", result)
  print(common.table(summary_rows(result), headers=HEADERS))
  print(f"{len(found['rows'])} rows, {len(found['failures'])} failed -> {path}")


if __name__ == "__main__":
  common.run_app(main, Config)
