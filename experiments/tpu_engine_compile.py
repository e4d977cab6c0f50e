r"""The whole engine step compiled for a TPU v5e / v6e that is not here (issue 27 point 4).

    /work/venvs/tpu/bin/python -m experiments.tpu_engine_compile \
        --out=experiments/results/tpu_engine_compile --compilation_cache=none

Per case (paged_jax/bench/tpu_step_compile.py: 2-layer Llama-3-8B and Gemma-2-like D 256
layers, a pool of 8,192 blocks of 16, 64 sequences to 8K, 256 tokens per step) the step
`paged_jax.engine.step_for_compile` (tp 1) or `paged_jax.distributed.tp_step_for_compile`
(tp 4) builds with `attention_backend="auto"` is compiled by libtpu for a compile-only
chip, as a user on a CPU host would (no TPU default device: the sharding decides "auto").
Recorded per chip: the attention the compiled module runs (its Mosaic kernels), HBM
arguments / outputs / aliased bytes, the temporary arena (`temp_bytes`) and its largest
single value against the chip's share of the K/V pool (the bound: under 1%), the largest
value XLA stages in VMEM, the kernels' VMEM. `--cases=report` adds int8 pages and, with
Llama-3's real 128,256-token vocabulary, "auto" beside the plain-jnp attention and XLA
scatter write that "auto" gave on a CPU host before (the "before" of the issue).

Writes OUT/tpu_engine_compile.json (flags, versions, machine, rows, failures) and prints
a table. Needs libtpu (requirements-compile.txt): without it, a one-line error.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Tuple

import jax

from experiments import common
from experiments import configs


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.tpu_engine_compile."""
  out: str = configs.flag("results/tpu_engine_compile", "output directory")
  cases: str = configs.flag("report", "tests: the slow test's 4 (Llama, v5e / v6e x tp 1 / "
                            "4); report: both models, tp 1 / 4, each chip, plus int8 and the "
                            "before / after pair", choices=("tests", "report"))
  chips: Tuple[str, ...] = configs.flag(("v5e", "v6e"), "TPU generations",
                                        choices=("v5e", "v6e"))
  only: str = configs.flag("", "substring filter on case names (empty: all)")
  layers: int = configs.flag(2, "decoder layers of every case (2: the pool of 2 layers; 32: "
                             "Llama-3-8B's depth, whose weights fit one v6e, not one v5e)")
  vocab: int = configs.flag(0, "LM head size of every case (0: each case's own; 128256: "
                            "Llama-3's)")


def cases(config: Config) -> list:
  from paged_jax.bench import tpu_step_compile as tsc  # pylint: disable=g-import-not-at-top
  if config.cases == "tests":
    chosen = [tsc.StepCase("llama8b", chip=c, tp=tp) for c in config.chips for tp in (1, 4)]
  else:
    chosen = tsc.report_cases(config.chips)
  chosen = [dataclasses.replace(c, layers=config.layers, vocab=config.vocab or c.vocab)
            for c in chosen]
  chosen = [c for c in chosen if config.only in c.name]
  if not chosen:
    raise ValueError(f"--only={config.only!r} matches no case")
  return chosen


HEADERS = ["case", "attention", "pool MiB/chip", "temp MiB", "largest temp MiB",
           "% of pool", "largest temp", "aliased MiB", "VMEM MiB", "compile s"]


def _mib(x):
  return None if x is None else round(x / 2**20, 2)


def _cells(row):
  return [row["case"], row["attention"], _mib(row["pool_bytes"]), _mib(row["temp_bytes"]),
          _mib(row["largest_temp_bytes"]), f"{100 * row['largest_temp_over_pool']:.2f}",
          re.sub(r"\{[^{}]*\}", "", row["largest_temp"] or ""), _mib(row["alias_bytes"]),
          _mib(row["max_vmem_bytes"]), row["compile_s"]]


def summary_rows(result) -> list:
  """The table's rows from a written result (tools/render_results.py)."""
  return [_cells(r) for r in result["rows"]]


def main(config, out):
  from paged_jax.bench import tpu_step_compile as tsc  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tpu import compile_target as ct  # pylint: disable=g-import-not-at-top
  reason = ct.unavailable_reason()
  if reason is not None:
    raise ValueError(reason)
  rows, failures = [], []
  for case in common.progress(cases(config), desc="engine compiles"):
    try:
      row = tsc.measure(case)
    except Exception as e:  # pylint: disable=broad-except
      failures.append({"case": case.name, "error": common.one_line(e)[:500]})
      print(f"FAILED {case.name}: {failures[-1]['error']}")
      continue
    row["under_1pct_of_pool"] = row["largest_temp_bytes"] < row["pool_bytes"] / 100
    rows.append(row)
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  result = dict(common.run_metadata(config),
                target={"chips": list(config.chips), "jax": jax.__version__,
                        "libtpu": metadata.version("libtpu"), "layers": config.layers},
                rows=rows, failures=failures)
  path = common.write_json(out / "tpu_engine_compile.json", result)
  print(common.table([_cells(r) for r in rows], headers=HEADERS))
  bad = [r["case"] for r in rows if not r["under_1pct_of_pool"] and r["attention"]
         == "pallas:tpu"]
  print(f"{len(rows)} compiled, {len(failures)} failed, {len(bad)} TPU-kernel steps with a "
        f"temporary of 1% of the pool or more {bad} -> {path}")


if __name__ == "__main__":
  common.run_app(main, Config)
