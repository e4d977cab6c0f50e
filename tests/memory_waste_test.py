"""The memory-waste experiment: JSON contract, partition, ordering, and a brute-force check."""

import collections
import json

import numpy as np
import pytest
from absl import flags

from experiments import configs
from experiments import memory_waste
from paged_jax.bench import workloads
from paged_jax.bench.baselines import simulate
from paged_jax.bench.memory import CATEGORIES

# One cache shape for every paged run in this file (one compile): T=512 slots, block
# size 8 -> 64 blocks, max_len 128 -> 16 blocks per sequence, 64 sequence slots.
T, BS, MAX_LEN, MAX_SEQS = 512, 8, 128, 64


def _brute_force_paged(reqs, bs, budget, watermark, max_seqs):
  """Plain-Python block-count model of the paged simulation (same policy, no device)."""
  num_blocks = budget // bs
  wm = int(watermark * num_blocks)
  cdiv = lambda a: -(-a // bs)
  free = num_blocks
  waiting = collections.deque([rid, p, f] for rid, p, f in reqs)
  running = {}   # slot -> [id, cur, final, order, blocks]
  slots = list(range(max_seqs - 1, -1, -1))
  order = preempt = steps = sat = peak = sat_run = 0
  sums = collections.Counter()
  while waiting or running:
    for s in [s for s, v in running.items() if v[1] == v[2]]:
      free += running.pop(s)[4]
      slots.append(s)
    pending = sorted(running)
    while pending:
      failed = []
      for s in pending:   # slot order, as the batched op
        v = running[s]
        if v[1] % bs == 0:
          if free == 0:
            failed.append(s)
            continue
          free -= 1
          v[4] += 1
        v[1] += 1
      if not failed:
        break
      victim = max(running, key=lambda s: running[s][3])
      rid, cur, fin, _, blocks = running.pop(victim)
      free += blocks
      slots.append(victim)
      waiting.appendleft([rid, cur - (victim not in failed), fin])
      preempt += 1
      pending = [s for s in failed if s != victim]
    while waiting and slots and cdiv(waiting[0][1]) <= free - wm:
      rid, cur, fin = waiting.popleft()
      running[slots.pop()] = [rid, cur, fin, order, cdiv(cur)]
      order += 1
      free -= cdiv(cur)
    if not running:
      break
    cat = collections.Counter()
    for _, c, f, _, b in running.values():
      cat["token_utilization"] += c
      cat["reservation"] += min(b * bs, f) - c
      cat["internal_fragmentation"] += b * bs - min(b * bs, f)
    cat["free"] += free * bs
    steps += 1
    peak = max(peak, len(running))
    if waiting:
      sat += 1
      sat_run += len(running)
      sums.update(cat)
  out = {k: sums[k] / (budget * sat) for k in CATEGORIES}
  out.update(max_concurrent=peak, mean_concurrent=sat_run / sat, steps=steps,
             saturated_steps=sat, preemptions=preempt)
  return out


@pytest.mark.parametrize("watermark", [0.0, 0.05])
def test_paged_simulation_matches_brute_force_block_model(watermark):
  rng = np.random.default_rng(int(watermark * 100))
  reqs = []
  for i in range(60):
    p = int(rng.integers(1, 60))
    reqs.append((i, p, int(rng.integers(1, MAX_LEN - p + 1))))
  got = simulate.simulate_paged(reqs, BS, T, MAX_LEN, watermark=watermark, max_seqs=MAX_SEQS)
  want = _brute_force_paged([(i, p, p + o) for i, p, o in reqs], BS, T, watermark, MAX_SEQS)
  assert want["preemptions"] > 0   # the trace really exercises preemption
  for key, value in want.items():
    assert got[key] == pytest.approx(value, abs=1e-12), key
  assert got["external_fragmentation"] == 0.0


def _check_schema(results):
  assert set(results) == {"paged", "orca_max", "orca_pow2", "orca_oracle"}
  for name, r in results.items():
    for key in CATEGORIES:
      assert 0.0 <= r[key] <= 1.0, (name, key)
    assert sum(r[k] for k in CATEGORIES) == pytest.approx(1.0, abs=1e-9), name
    assert isinstance(r["max_concurrent"], int) and r["max_concurrent"] >= 1
    assert 0 < r["mean_concurrent"] <= r["max_concurrent"]
    assert r["averaged_over"] == "saturated"
  u = {name: r["token_utilization"] for name, r in results.items()}
  assert u["paged"] > max(u["orca_max"], u["orca_pow2"], u["orca_oracle"])
  assert u["orca_oracle"] >= u["orca_pow2"] >= u["orca_max"]
  assert results["orca_max"]["internal_fragmentation"] > results["orca_oracle"][
      "internal_fragmentation"] == 0.0
  assert results["paged"]["mean_concurrent"] > results["orca_oracle"]["mean_concurrent"]


def test_cli_writes_contract_json_png_and_table(tmp_path, capsys):
  # Saturated Alpaca-like run: 300 requests, 4096 slots (~8 Orca(Max) reservations of 512).
  argv = ["memory_waste", "--workload=alpaca", "--num_requests=300", "--block_size=16",
          "--kv_budget_tokens=4096", "--max_len=512", f"--out={tmp_path}"]
  memory_waste.main(_config(argv), tmp_path)
  results = json.loads((tmp_path / "memory_waste.json").read_text())
  _check_schema(results)
  png = (tmp_path / "memory_waste.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
  meta = json.loads((tmp_path / "memory_waste_meta.json").read_text())
  assert meta["flags"]["workload"] == "alpaca" and meta["flags"]["kv_budget_tokens"] == 4096
  assert meta["partition"] == list(CATEGORIES)
  assert {"jax", "numpy", "python"} <= set(meta["versions"]) and meta["machine"]["cpu_count"]
  printed = capsys.readouterr().out
  assert "vLLM (paged)" in printed and "Orca (Oracle)" in printed
  # The JSON holds what a direct simulation of the same stream gives.
  reqs = workloads.alpaca(300, seed=0, max_len=512)
  assert simulate.simulate_orca(reqs, "pow2", 4096, 512) == results["orca_pow2"]


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["sharegpt", "alpaca"])
def test_paper_scale_run(workload):
  """Paper scale: the contract schema, and paging beats every contiguous reservation."""
  results = memory_waste.run(memory_waste.Config(workload=workload, num_requests=2000),
                             show_progress=False)
  _check_schema(results)
  u = {name: r["token_utilization"] for name, r in results.items()}
  assert u["paged"] > max(u["orca_max"], u["orca_pow2"], u["orca_oracle"])


def _config(argv):
  """The Config `python -m experiments.memory_waste *argv[1:]` runs with."""
  fv = flags.FlagValues()
  configs.define_flags(memory_waste.Config, fv)
  fv(argv)
  return configs.from_flags(memory_waste.Config, fv)


@pytest.mark.parametrize("argv, message", [
    (["--kv_budget_tokens=1000"], "multiple of --block_size"),
    (["--block_size=7", "--kv_budget_tokens=14336"], "--block_size must be a power of two"),
    (["--kv_budget_tokens=1024"], "must be >= --max_len"),
    (["--watermark=1.5"], "--watermark must be a finite number in [0, 1)"),
    (["--workload=wiki"], "--workload must be one of sharegpt, alpaca"),
])
def test_bad_flags_raise_value_errors(argv, message):
  with pytest.raises(ValueError) as e:    # refused while the settings are built
    _config(["memory_waste", *argv])
  assert message in str(e.value)


def test_unknown_flags_are_rejected():
  with pytest.raises(flags.Error):   # unknown flags are rejected, not ignored
    _config(["memory_waste", "--num_request=5"])


def test_simulation_rejects_a_budget_the_block_size_does_not_divide():
  with pytest.raises(ValueError, match="multiple of block_size"):
    simulate.simulate_paged([(0, 3, 4)], 16, 1000, 64)
