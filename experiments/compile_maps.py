r"""Memory maps per compiled engine step on XLA:CPU, what holds them, what gives them back.

    python -m experiments.compile_maps --out=experiments/results/compile_maps \
        --pythons=/work/main/.venv/bin/python,/work/main/.venv312/bin/python

Linux caps a process's memory maps (`vm.max_map_count`, 65,530 by default; raising it
needs root). XLA:CPU loads each compiled kernel of an executable as an object of its
own, and LLVM's JIT memory manager maps each object's code, read-only data and
writable data apart: a process that keeps compiling step shapes runs out of maps and
LLVM aborts ("Cannot allocate memory"). Per interpreter (`--pythons`: one per JAX
version) and per XLA:CPU setting in `--settings` (XLA_FLAGS, read when the backend
starts, so each runs in a fresh process), on the shipped tiny model's engine step:

  compiled   maps each of `--shapes` step shapes adds when compiled ahead of time,
             split by permission (r-xp code, r--p constants, rw-p data), and seconds;
  released   maps given back, in order, by: dropping the `Compiled` objects only;
             `jitted.clear_cache()` on the first shape's jit; dropping the second
             shape's jit object (one jit per shape); `jax.clear_caches()`;
  shared     (default setting) two shapes through ONE jit shared by all shapes, then
             dropping the `Compiled` objects and `clear_cache()` on it;
  reload     (default setting) a shape compiled with JAX's persistent cache on, its jit
             dropped, the shape met again: loaded from disk (maps, seconds, cache hit).

Writes OUT/compile_maps.json and prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence

from experiments import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> XLA_FLAGS. parallel_codegen_split_count: the LLVM module parts (dylibs) a
# compile is split into (default 32); fusion emitters: XLA:CPU's MLIR kernels for fusions
# (off: the older elemental IR emitter); thunk runtime: off is ignored by jaxlib >= 0.5.
SETTINGS = {
    "default": "",
    "split_count_1": "--xla_cpu_parallel_codegen_split_count=1",
    "no_fusion_emitters": "--xla_cpu_use_fusion_emitters=false",
    "split_1_no_fusion_emitters": ("--xla_cpu_parallel_codegen_split_count=1 "
                                   "--xla_cpu_use_fusion_emitters=false"),
    "thunk_runtime_off": "--xla_cpu_use_thunk_runtime=false",
}


def map_kinds() -> Dict[str, int]:
  """This process's memory maps by permission (and 'total')."""
  out = {"total": 0}
  with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
    for line in f:
      perms = line.split(maxsplit=2)[1]
      out[perms] = out.get(perms, 0) + 1
      out["total"] += 1
  return out


def _diff(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
  return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))
          if after.get(k, 0) != before.get(k, 0)}


def measure(num_shapes: int, extras: bool, cache_dir: str) -> Dict:
  """Runs in the child process (XLA_FLAGS already set): the readings of the module doc."""
  import gc  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  from paged_jax import compile_cache  # pylint: disable=g-import-not-at-top
  from paged_jax import executables  # pylint: disable=g-import-not-at-top
  from paged_jax.bench import engines  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.buckets import reachable_buckets  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.inputs import empty_inputs  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.packing import abstract_inputs  # pylint: disable=g-import-not-at-top
  from paged_jax.engine.step import StepInputs  # pylint: disable=g-import-not-at-top

  events: List[str] = []
  monitoring.register_event_listener(lambda name, **kw: events.append(name))
  engine = engines.make_engine(block_size=16, kv_budget_tokens=4096, max_seqs=64)
  # pylint: disable=protected-access
  step, buckets, lookup_len = engine._compiled, engine._buckets, engine._lookup_len
  # pylint: enable=protected-access
  shapes = [b._replace(all_greedy=True)   # greedy sampling, as the readings always had
            for b in reachable_buckets(buckets, max_rows=64, max_len=engine.max_model_len)]
  # num_shapes + 2 shapes spread from the smallest to the largest (2 for `shared`).
  shapes = [shapes[i * (len(shapes) - 1) // (num_shapes + 1)] for i in range(num_shapes + 2)]
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  params = jax.tree_util.tree_map(abstract, engine.params)
  state = jax.tree_util.tree_map(abstract, engine.state)

  def args(bucket, packed=True):
    """(params, state, inputs) of `bucket`: the inputs packed in one buffer as the
    engine's per-shape jits take them, or the StepInputs record (the step's `fn`)."""
    inputs = StepInputs(**{k: abstract(v) for k, v in empty_inputs(
        bucket.tokens, engine.cache_config.max_seqs, lookup_len, num_rows=bucket.rows).items()})
    return params, state, abstract_inputs(inputs) if packed else inputs

  def own_jit(bucket):   # one jit per shape, as the engine's executable budget makes them
    return executables.shape_jit(step.plain, donate_argnums=(1,), **bucket.step_kw)

  def compile_one(fn, bucket, **static):
    before, t0 = map_kinds(), time.perf_counter()
    exe = fn.trace(*args(bucket, packed=not static), **static).lower().compile()
    return exe, {"shape": list(bucket), "seconds": time.perf_counter() - t0,
                 "maps": _diff(map_kinds(), before)}

  base = map_kinds()["total"]
  out: Dict = {"baseline_maps": base}
  jits, exes, rows = [], [], []
  for bucket in shapes[:num_shapes]:
    fn = own_jit(bucket)
    exe, row = compile_one(fn, bucket)
    jits.append(fn)
    exes.append(exe)
    rows.append(row)
  out["compiled"] = rows
  held = map_kinds()["total"]
  released = {}
  del exe, exes
  gc.collect()
  released["drop_compiled_objects"] = held - map_kinds()["total"]
  held = map_kinds()["total"]
  jits[0].clear_cache()
  gc.collect()
  released["first_jit_clear_cache"] = held - map_kinds()["total"]
  if len(jits) > 1:
    held = map_kinds()["total"]
    del jits[1], fn
    gc.collect()
    released["drop_second_jit"] = held - map_kinds()["total"]
  held = map_kinds()["total"]
  jax.clear_caches()
  gc.collect()
  released["jax_clear_caches"] = held - map_kinds()["total"]
  out["released"] = released
  del jits
  if not extras:
    return out

  shared = step.fn   # the step jitted once, the bucket's fields static
  held = map_kinds()["total"]
  exes = [compile_one(shared, b, **b.step_kw)[0] for b in shapes[-2:]]
  grown = map_kinds()["total"] - held
  del exes
  gc.collect()
  after_drop = map_kinds()["total"]
  shared.clear_cache()
  gc.collect()
  out["shared_jit"] = {"shapes": 2, "maps": grown, "drop_compiled_objects": held + grown
                       - after_drop, "clear_cache": after_drop - map_kinds()["total"]}

  compile_cache.enable(cache_dir, min_compile_time_s=0)
  bucket = shapes[0]
  fn = own_jit(bucket)
  _, first = compile_one(fn, bucket)
  held = map_kinds()["total"]
  del fn, _
  gc.collect()
  dropped = held - map_kinds()["total"]
  hits = events.count("/jax/compilation_cache/cache_hits")
  _, again = compile_one(own_jit(bucket), bucket)
  out["reload"] = {"shape": list(bucket), "compiled": first, "released_by_drop": dropped,
                   "loaded": again,
                   "cache_hit": events.count("/jax/compilation_cache/cache_hits") > hits}
  compile_cache.disable()
  return out


_CHILD = r"""
import json, sys
from experiments import compile_maps
print("RESULT" + json.dumps(compile_maps.measure(int(sys.argv[1]), sys.argv[2] == "1",
                                                 sys.argv[3])))
"""


def _child(python: str, xla_flags: str, num_shapes: int, extras: bool, cache_dir: str) -> Dict:
  """`measure` in a fresh `python` with `xla_flags`; {"error": last line} if it failed
  (e.g. a flag this jaxlib does not know)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags,
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  env["TF_CPP_MIN_LOG_LEVEL"] = "2"
  proc = subprocess.run([python, "-c", _CHILD, str(num_shapes), "1" if extras else "0",
                         cache_dir], cwd=ROOT, env=env, capture_output=True, text=True,
                        check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  if proc.returncode or not lines:
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][-300:]}
  return json.loads(lines[-1][len("RESULT"):])


def _versions(python: str) -> Dict[str, str]:
  code = ("import json, importlib.metadata as m, platform; print(json.dumps({'python': "
          "platform.python_version(), 'jax': m.version('jax'), 'jaxlib': m.version('jaxlib')}))")
  return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                   check=True).stdout)


def run(pythons: Sequence[str], settings: Sequence[str], num_shapes: int = 3) -> Dict:
  """Readings per interpreter and setting (see module doc)."""
  import tempfile  # pylint: disable=g-import-not-at-top
  for name in settings:
    if name not in SETTINGS:
      raise ValueError(f"settings must be among {', '.join(SETTINGS)}, got {name!r}")
  if not 1 <= num_shapes <= 20:
    raise ValueError(f"shapes must be in [1, 20], got {num_shapes}")
  runs = []
  for python in pythons:
    versions = _versions(python)
    for name in settings:
      with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        reading = _child(python, SETTINGS[name], num_shapes, name == "default", tmp)
      run_of = {"jax": versions["jax"], "python": versions["python"], "setting": name,
                "xla_flags": SETTINGS[name], "seconds": time.perf_counter() - t0}
      if "error" in reading:
        runs.append({**run_of, **reading})
        continue
      per_shape = [r["maps"]["total"] for r in reading["compiled"]]
      runs.append({**run_of, "maps_per_shape": per_shape,
                   "mean_maps_per_shape": sum(per_shape) / len(per_shape),
                   "mean_compile_s": sum(r["seconds"] for r in reading["compiled"])
                   / len(per_shape), **reading})
  with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
    limit = int(f.read())
  return {"runs": runs, "max_map_count": limit}


HEADERS = ["jax", "setting", "maps / shape", "compile s", "drop Compiled", "jit.clear_cache",
           "drop own jit", "clear_caches"]


def summary_rows(result: Dict):
  rows = []
  for r in result["runs"]:
    if "error" in r:
      reason = r["error"].split("] ", 1)[-1][:70]    # the message after glog's prefix
      rows.append([r["jax"], r["setting"], reason] + [None] * (len(HEADERS) - 3))
      continue
    rel = r["released"]
    rows.append([r["jax"], r["setting"], r["mean_maps_per_shape"], r["mean_compile_s"],
                 rel.get("drop_compiled_objects"), rel.get("first_jit_clear_cache"),
                 rel.get("drop_second_jit"), rel.get("jax_clear_caches")])
  return rows


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_list("pythons", [sys.executable], "interpreters to measure (one per JAX)")
  flags.DEFINE_list("settings", list(SETTINGS), f"XLA:CPU settings: {', '.join(SETTINGS)}")
  flags.DEFINE_integer("shapes", 3, "step shapes compiled per setting")
  flags.DEFINE_string("out", "results/compile_maps", "output directory")


def shared_jit_line(r: Dict) -> str:
  """One run's shared-jit and reload readings, in words."""
  s, rl = r["shared_jit"], r["reload"]
  return (f"jax {r['jax']}: one jit for all shapes: {s['maps']} maps for 2 shapes, "
          f"{s['drop_compiled_objects']} back on dropping the Compiled objects, "
          f"{s['clear_cache']} on clear_cache(); reload from disk: "
          f"{rl['loaded']['maps'].get('total')} maps in {rl['loaded']['seconds']:.2f} s "
          f"(compiled: {rl['compiled']['maps'].get('total')} in "
          f"{rl['compiled']['seconds']:.2f} s), hit={rl['cache_hit']}")


def main(f, out):
  """Runs with the parsed flags `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(
      lambda: run(f["pythons"].value, f["settings"].value, f["shapes"].value), f)
  common.report(result, out, "compile_maps.json", summary_rows(result), HEADERS,
                [shared_jit_line(r) for r in result["runs"] if "shared_jit" in r], digits=1)


if __name__ == "__main__":
  common.run_app(main, _define_flags)
