r"""The whole engine step compiled for a TPU v5e / v6e that is not here (issue 27 point 4).

    /work/venvs/tpu/bin/python -m experiments.tpu_engine_compile \
        --out=experiments/results/tpu_engine_compile --compilation_cache=none

Per case (`StepCase`: 2-layer Llama-3-8B and Gemma-2-like D 256 layers, a pool of 8,192
blocks of 16, 64 sequences to 8K, 256 tokens per step) the step
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
a table. Needs libtpu (requirements-compile.txt): without it, a one-line error. The
slow tests (tests/tpu_engine_test.py) call `measure` on single cases.

What "no copy of the pool" means here: XLA's HBM temporaries (`temp_bytes`) hold every
buffer the step allocates besides its arguments and outputs, so a copy of a layer's pool
(XLA's TPU scatter transposes it; plain-jnp attention gathers K/V per sequence) shows
there; `pool_bytes` is the chip's share of the K/V pool (pages and scales, all layers).
The donated pages must come back aliased (`alias_bytes`). `vocab` stays small by default:
the LM head and sampling are not under test, and at Llama-3's 128,256 tokens their
[64, vocab] f32 logits and sort buffers alone take 1% of this pool.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Dict, Tuple

import jax
import numpy as np

from experiments import common
from experiments import configs
from paged_jax.config import ModelConfig
from paged_jax.distributed import tp_step_for_compile
from paged_jax.engine import step_for_compile
from pallas_kernels.tpu import compile_target


LAYERS = 2
SMALL_VOCAB = 1024
# Layer shapes (Llama-3-8B; a Gemma-2-9B-like D 256 with its soft caps and window).
MODELS: Dict[str, Dict[str, Any]] = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_heads=32,
                    num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "gemma_d256": dict(hidden_size=3584, intermediate_size=14336, num_heads=16,
                       num_kv_heads=8, head_dim=256, model_type="gemma2",
                       hidden_act="gelu_pytorch_tanh", rms_norm_unit_offset=True,
                       sandwich_norms=True, embedding_multiplier=3584 ** 0.5,
                       query_pre_attn_scalar=256.0, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, sliding_window=4096,
                       layer_types=("sliding_attention", "full_attention"),
                       tie_word_embeddings=True),
}


@dataclasses.dataclass(frozen=True)
class StepCase:
  """One compile of the engine step.

  Attributes:
    model: a MODELS key. chip: "v5e" | "v6e" (compile_target.CHIPS). tp: chips the model
    is split over (1: one chip). page_dtype: K/V pages ("bfloat16", "int8", ...).
    attention_backend: the engine option ("auto": decided by the chip).
    num_blocks, block_size, max_seqs, context, tokens: the pool (blocks of block_size
    tokens), sequences, longest sequence, tokens per step. vocab: LM head size.
    spec: speculative decoding's k (0: off): the step's variant verifying k n-gram drafts
      per row (`speculative_config`, `spec=True`).
  """
  model: str
  chip: str = "v5e"
  tp: int = 1
  page_dtype: str = "bfloat16"
  attention_backend: str = "auto"
  num_blocks: int = 8192
  block_size: int = 16
  max_seqs: int = 64
  context: int = 8192
  tokens: int = 256
  vocab: int = SMALL_VOCAB
  layers: int = LAYERS
  spec: int = 0

  @property
  def name(self) -> str:
    extra = "" if self.attention_backend == "auto" else f":{self.attention_backend}"
    return (f"{self.chip}:tp{self.tp}:{self.model}:{self.page_dtype}:bs{self.block_size}"
            f":vocab{self.vocab}{extra}" + ("" if self.layers == LAYERS else f":L{self.layers}")
            + (f":spec{self.spec}" if self.spec else ""))

  def model_config(self) -> ModelConfig:
    return ModelConfig(vocab_size=self.vocab, num_layers=self.layers, dtype="bfloat16",
                       **MODELS[self.model])

  def cache_config(self):
    return self.model_config().cache_config(
        num_blocks=self.num_blocks, block_size=self.block_size, max_seqs=self.max_seqs,
        max_blocks_per_seq=self.context // self.block_size, dtype=self.page_dtype,
        enable_prefix_caching=False,   # the step the committed compiles measured
        hybrid_kv=False)


def pool_bytes(case: StepCase) -> int:
  """One chip's share of the K/V pool: pages and scales of every layer."""
  return case.cache_config().kv_cache_bytes // case.tp


def step_and_args(case: StepCase, **engine_options):
  """(jitted step, ShapeDtypeStruct args) of `case` on compile-only `case.chip` devices."""
  devices = compile_target.tpu_devices(case.chip)
  options = dict(max_num_batched_tokens=case.tokens,
                 attention_backend=case.attention_backend, **engine_options)
  if case.spec:
    options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": case.spec}
  if case.tp == 1:
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    return step_for_compile(case.model_config(), case.cache_config(), sharding=sharding,
                            **options)
  if case.tp > len(devices):
    raise ValueError(f"tp={case.tp} needs more than the {len(devices)} chips of "
                     f"{compile_target.CHIPS[case.chip]}")
  mesh = jax.sharding.Mesh(np.array(devices[:case.tp]), ("tp",))
  return tp_step_for_compile(case.model_config(), case.cache_config(), mesh=mesh, **options)


def measure(case: StepCase, *, decode_only: bool = False,
            keep_report: bool = False) -> Dict[str, Any]:
  """Compiles `case`'s step (the largest bucket; `decode_only`: its decode-kernel form)
  and returns its row: memory figures (bytes, per chip), the Mosaic kernels in the module
  (names and VMEM), and the largest HBM temporary (`largest_temp_*`: one value of XLA's
  HBM temporary arena; `temp_bytes` is the whole arena, values of disjoint lifetimes
  sharing it) and, for reference, the largest value XLA stages in VMEM. `keep_report`:
  the CompileReport too, under "report" (not JSON)."""
  fn, args = step_and_args(case)
  t0 = time.perf_counter()
  # As a user compiles on a CPU host: no TPU default device, the shardings name the chip.
  report = compile_target.compile_report(fn, *args, chip=case.chip, as_default=False,
                                         temp_values=True, decode_only=decode_only,
                                         **({"spec": True} if case.spec else {}))
  pool = pool_bytes(case)
  hbm = [b for b in report.temp_values if b.memory_space == 0]
  vmem = [b for b in report.temp_values if b.memory_space == 1]
  largest = hbm[0] if hbm else None
  row = dict(case=case.name, **dataclasses.asdict(case), decode_only=decode_only,
             compile_s=round(time.perf_counter() - t0, 1), pool_bytes=pool,
             temp_bytes=report.temp_bytes, argument_bytes=report.argument_bytes,
             output_bytes=report.output_bytes, alias_bytes=report.alias_bytes,
             temp_over_pool=round(report.temp_bytes / pool, 5),
             largest_temp_bytes=largest.nbytes if largest else 0,
             largest_temp=f"{largest.name} {largest.shape}" if largest else None,
             largest_temp_over_pool=round((largest.nbytes if largest else 0) / pool, 5),
             largest_vmem_temp=f"{vmem[0].name} {vmem[0].shape} {vmem[0].nbytes}"
             if vmem else None,
             kernels=sorted({k.name.split(".")[0] for k in report.kernels}),
             max_vmem_bytes=report.max_vmem_bytes)
  row["attention"] = attention_kind(row["kernels"])
  if keep_report:
    row["report"] = report
  return row


def attention_kind(kernels) -> str:
  """Which attention the compiled step runs, from its Mosaic kernels' names."""
  names = " ".join(kernels)
  if "tpu_ragged_paged_attention" in names or "tpu_paged_decode" in names:
    return "pallas:tpu" + ("" if "tpu_kv_write" in names else " (XLA write)")
  return "jnp (no TPU kernel)" if not names else f"other: {names}"


def before_after_cases() -> list:
  """Issue 27's measurement, v5e, tp 1, Llama-3-8B shapes with the real vocabulary:
  default options ("auto": now the TPU kernels) and the plain-jnp attention with XLA's
  scatter write that "auto" gave before on a CPU host (the issue quotes 773.5 MiB of
  temporaries for it)."""
  return [StepCase("llama8b", vocab=128256),
          StepCase("llama8b", vocab=128256, attention_backend="xla")]


def report_cases(chips=("v5e", "v6e")) -> list:
  """The compile report's engine rows: both models, tp 1 and 4, bf16, each chip; int8
  pages for Llama on each chip, tp 1 and 4 (scale rows split by KV head)."""
  cases = [StepCase(m, chip=c, tp=tp) for c in chips for m in MODELS for tp in (1, 4)]
  cases += [StepCase("llama8b", chip=c, page_dtype="int8", tp=tp) for c in chips
            for tp in (1, 4)]
  return cases + before_after_cases()


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
  spec: int = configs.flag(0, "speculative decoding's k in every case (0: off)", lower=0,
                           upper=16)


def cases(config: Config) -> list:
  if config.cases == "tests":
    chosen = [StepCase("llama8b", chip=c, tp=tp) for c in config.chips for tp in (1, 4)]
  else:
    chosen = report_cases(config.chips)
  chosen = [dataclasses.replace(c, layers=config.layers, vocab=config.vocab or c.vocab,
                                spec=config.spec)
            for c in chosen]
  chosen = [c for c in chosen if config.only in c.name]
  if not chosen:
    raise ValueError(f"--only={config.only!r} matches no case")
  return chosen


HEADERS = ["case", "attention", "pool MiB/chip", "temp MiB", "largest temp MiB",
           "% of pool", "largest temp", "aliased MiB", "VMEM MiB", "compile s"]


def _cells(row):
  return [row["case"], row["attention"], common.mib(row["pool_bytes"]),
          common.mib(row["temp_bytes"]), common.mib(row["largest_temp_bytes"]),
          f"{100 * row['largest_temp_over_pool']:.2f}",
          re.sub(r"\{[^{}]*\}", "", row["largest_temp"] or ""), common.mib(row["alias_bytes"]),
          common.mib(row["max_vmem_bytes"]), row["compile_s"]]


def summary_rows(result) -> list:
  """The table's rows from a written result (tools/render_results.py)."""
  return [_cells(r) for r in result["rows"]]


def main(config, out):
  reason = compile_target.unavailable_reason()
  if reason is not None:
    raise ValueError(reason)
  rows, failures = common.compile_each(cases(config), measure, desc="engine compiles")
  for row in rows:
    row["under_1pct_of_pool"] = row["largest_temp_bytes"] < row["pool_bytes"] / 100
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
