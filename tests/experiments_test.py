"""Properties of the experiment library functions at tiny sizes (the demo's building blocks).

Engine-backed tests share one cache shape (block 16, 1024-slot pool, 16 slots) so the
jitted step compiles once per process; the two-shape throughput test is marked slow.
"""

import json

import numpy as np
import pytest

from experiments import block_size_sweep
from experiments import demo
from experiments import sharing
from experiments import throughput
from paged_jax.bench import engines
from paged_jax.bench import serving
from paged_jax.bench import workloads

ENGINE_KW = dict(block_size=16, kv_budget_tokens=1024, max_seqs=16)   # 4 samples of 256 fit


def test_experiment_modules_define_no_global_flags():
  from absl import flags
  before = set(flags.FLAGS)
  import importlib
  for name in ("block_size_sweep", "sharing", "throughput", "preemption", "demo"):
    importlib.reload(importlib.import_module(f"experiments.{name}"))
  assert set(flags.FLAGS) == before


@pytest.fixture(scope="module")
def sweep_rows():
  return block_size_sweep.run(block_size_sweep.Config(
      workloads=("alpaca",), block_sizes=(2, 16, 64), num_requests={"alpaca": 200},
      kv_budget_tokens=1024, max_len=256, engine_block_sizes=(), attn_batch=2,
      attn_context=128, attn_repeats=1, prefix_block_sizes=(16,), prefix_num_requests=8,
      seed=int(np.random.default_rng(103).integers(1000))), show_progress=False)


def test_sweep_has_a_row_per_block_size_with_valid_fractions(sweep_rows, tmp_path):
  assert [(r["workload"], r["block_size"]) for r in sweep_rows] == [
      ("alpaca", 2), ("alpaca", 16), ("alpaca", 64)]
  for r in sweep_rows:
    for key in ("token_utilization", "reservation", "internal_fragmentation"):
      assert 0.0 <= r[key] <= 1.0
    assert r["token_utilization"] + r["reservation"] + r["internal_fragmentation"] <= 1 + 1e-9
    assert r["attention_ms"] > 0
    assert r.get("engine_tokens_per_s") is None
    assert (r.get("prefix_hit_rate") is not None) == (r["block_size"] == 16)
  path = block_size_sweep.write_jsonl(sweep_rows, tmp_path / "sweep.jsonl")
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  assert lines == json.loads(json.dumps(sweep_rows))


def test_sweep_bigger_blocks_waste_more_and_hold_fewer_requests(sweep_rows):
  by_bs = {r["block_size"]: r for r in sweep_rows}
  # The unfilled last block grows with the block size (Alpaca's ~78-token requests).
  assert by_bs[64]["internal_fragmentation"] > by_bs[2]["internal_fragmentation"]
  assert by_bs[64]["token_utilization"] < by_bs[2]["token_utilization"]
  assert by_bs[64]["max_concurrent"] <= by_bs[2]["max_concurrent"]
  assert by_bs[2]["mean_blocks_per_seq"] > by_bs[16]["mean_blocks_per_seq"] > by_bs[64][
      "mean_blocks_per_seq"]


def test_sweep_rejects_bad_block_sizes():
  with pytest.raises(ValueError, match="block_size must be a power of two"):
    block_size_sweep.Config(block_sizes=(3,), engine_block_sizes=())
  with pytest.raises(ValueError, match="--engine_block_sizes \\[32\\] are not in --block_sizes"):
    block_size_sweep.Config(block_sizes=(16,), engine_block_sizes=(32,))
  with pytest.raises(ValueError, match="--num_requests\\[alpaca\\] must be an int >= 1"):
    block_size_sweep.Config(num_requests={"alpaca": 0})


def test_best_block_sizes_picks_the_fastest_and_the_tolerance_band():
  rng = np.random.default_rng(105)
  speeds = rng.uniform(10, 100, size=5)
  sizes = [4, 8, 16, 32, 64]
  rows = [{"workload": "sharegpt", "block_size": b, "engine_tokens_per_s": float(s),
           "token_utilization": 0.9, "attention_ms": 1.0} for b, s in zip(sizes, speeds)]
  best = block_size_sweep.best_block_sizes(rows, tolerance=0.05)["sharegpt"]
  assert best["best"] == sizes[int(np.argmax(speeds))]
  good = [b for b, s in zip(sizes, speeds) if s >= 0.95 * speeds.max()]
  assert best["good_range"] == [min(good), max(good)]


@pytest.fixture(scope="module")
def sharing_rows():
  return sharing.run(sharing.Config(workloads=("sharegpt",), widths=(2, 4), num_requests=2,
                                    seed=int(np.random.default_rng(106).integers(1000)),
                                    **ENGINE_KW), show_progress=False)


def test_sharing_saves_blocks_and_more_with_wider_n(sharing_rows):
  rows = {(r["mode"], r["width"]): r for r in sharing_rows}
  assert rows[("greedy", 1)]["savings"] == 0.0
  for mode in sharing.MODES:
    assert rows[(mode, 2)]["savings"] > 0.0
    assert rows[(mode, 4)]["savings"] > rows[(mode, 2)]["savings"]
    assert rows[(mode, 4)]["savings"] < 1.0


def test_sharing_generates_every_sample(sharing_rows):
  reqs = workloads.scaled_requests("sharegpt", 2, seed=sharing_rows[0]["seed"])
  rows = {(r["mode"], r["width"]): r for r in sharing_rows}
  total = sum(r.output_len for r in reqs)
  assert rows[("greedy", 1)]["generated_tokens"] == total
  assert rows[("parallel", 4)]["generated_tokens"] == 4 * total


def test_serve_generates_the_stream_lengths_and_matches_generate():
  from paged_jax.engine import SamplingParams
  reqs = workloads.scaled_requests("alpaca", 3, seed=int(np.random.default_rng(107).integers(1000)))
  res = serving.serve(engines.make_engine(**ENGINE_KW), reqs, keep_outputs=True)
  assert [len(o[0]) for o in res["outputs"]] == [r.output_len for r in reqs]
  assert res["generated_tokens"] == sum(r.output_len for r in reqs)
  assert 0 < res["mean_latency_s"] <= res["seconds"] + 1e-9
  direct = engines.make_engine(**ENGINE_KW).generate(
      [list(map(int, r.prompt_token_ids)) for r in reqs],
      [SamplingParams(max_tokens=r.output_len, temperature=0.0) for r in reqs])
  assert [o.outputs for o in direct] == res["outputs"]


def test_make_engine_validates_budget():
  with pytest.raises(ValueError, match="multiple of block_size"):
    engines.make_engine(block_size=16, kv_budget_tokens=520)
  with pytest.raises(ValueError, match="max_len"):
    engines.make_engine(block_size=16, kv_budget_tokens=128)


def test_demo_summary_rows_from_real_results(sweep_rows, sharing_rows):
  paper = [["Fig. 12 opt-13b sharegpt-like: max rate, paged / Orca (Oracle)", "2.10x",
            "1.7-2.7x"]]
  rows = demo.summary_rows({"block_size_sweep": sweep_rows, "sharing": sharing_rows,
                            "prefix_caching": {"note": "absent"},
                            "paper_scale": {"rows": paper}})
  assert all(len(r) == 3 and all(isinstance(c, str) for c in r) for r in rows)
  whats = " ".join(r[0] for r in rows)
  assert "best block size, alpaca-like" in whats and "beam" in whats and "prefix" in whats
  assert [paper[0][0] + " (short demo run)", "2.10x", "1.7-2.7x"] in rows


@pytest.mark.slow
def test_throughput_paged_beats_contiguous_reservation_with_same_tokens():
  res = throughput.run(throughput.Config(workloads=("sharegpt",), num_requests=12,
                                         kv_budget_tokens=512, max_seqs=16),
                       show_progress=False)["sharegpt"]
  assert res["outputs_identical"]
  assert res["paged"]["generated_tokens"] == res["orca_max"]["generated_tokens"]
  assert res["orca_max"]["max_running_seqs"] <= 512 // 256 == res["orca_max"]["max_seqs"]
  assert res["paged"]["max_running_seqs"] > res["orca_max"]["max_running_seqs"]
  assert res["speedup_tokens_per_step"] > 1.0
