"""The Mosaic GPU configs of the compile report (pallas_kernels/deviceless/mosaic_configs.py).

Everywhere: the committed report (experiments/results/gpu_compile_report/
mosaic_gpu_compile_report.json) lists exactly today's configs, compiled with 0 spills and
shared memory within sm_90's opt-in budget, its bandwidth figure marked as modelled; the
byte and occupancy models on hand-computed cases. Deviceless sm_90a compile (jax >= 0.11.2
and the CUDA compile plugin; skipped with the reason otherwise): each config compiles with
0 spills, <= 255 registers, shared memory within budget and equal to the committed report's.
The configs tests/mosaic_*_test.py already compile are not repeated by default (slow here).
"""

import json
import os

import pytest

from pallas_kernels.deviceless import target as compile_target
from pallas_kernels import sm90
from pallas_kernels.deviceless import mosaic_configs as mcc

REPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "results", "gpu_compile_report",
                      "mosaic_gpu_compile_report.json")
# Not compiled elsewhere: Gemma's D 256 with soft cap + window in the ragged kernel (at the
# register cap) and the 128-key tile (the largest ring).
DEFAULT_COMPILES = ("ragged:gemma:bf16:bs64:engine256",
                    "decode:llama8b:bf16:bs64:B64x4k,tile_kv=128")


def _report():
  with open(REPORT) as f:
    return json.load(f)


def test_committed_report_is_current_and_clean():
  doc = _report()
  assert [r["case"] for r in doc["rows"]] == [c.name for c in mcc.default_cases()], \
      "config list changed: rerun experiments.gpu_compile_report --backends=mosaic_gpu"
  assert doc["failures"] == []
  assert [u["case"] for u in doc["unsupported"]] == [c.name for c in mcc.unsupported_cases()]
  assert all(u["reason"] for u in doc["unsupported"])
  for r in doc["rows"]:
    assert r["spill_bytes"] == 0, r["case"]
    assert 0 < r["shared_memory"] <= compile_target.SM90_SHARED_MEMORY_BYTES, r["case"]
    assert r["registers"] <= 255 and r["threads"] == 128, r["case"]
  assert doc["bandwidth_model"]["modelled"] is True
  assert {"flags", "versions", "machine", "target"} <= set(doc)
  assert tuple(int(p) for p in doc["versions"]["jax"].split(".")[:3]) >= (0, 11, 2)


def test_every_default_case_is_supported_and_refusals_say_why():
  assert all(c.supported_reason() is None for c in mcc.default_cases())
  reasons = [c.supported_reason() for c in mcc.unsupported_cases()]
  assert all(reasons) and "block_size 8" in reasons[0]
  names = [c.name for c in mcc.default_cases()]
  assert len(set(names)) == len(names)


def test_kv_bytes_model_by_hand():
  per_token = 8 * 2 * 128 * 2  # llama8b: 8 KV heads, K and V, D 128, bf16
  assert mcc.kv_bytes(mcc.MosaicCase("decode", "llama8b")) == 64 * 4096 * per_token
  # Gemma's 4096-token window caps an 8K context; int8 pages add a 4-byte scale per token.
  gemma = mcc.MosaicCase("decode", "gemma", page_dtype="int8", batch=16, context=8192)
  assert mcc.kv_bytes(gemma) == 16 * 4096 * 4 * 2 * (256 + 4)
  # A 2048-token prefill in tiles of 64 // 4 = 16 queries: tile i reads 16 (i + 1) keys.
  prefill = mcc.MosaicCase("ragged", "llama8b", workload="prefill2k")
  assert mcc.resolved(prefill)["q_per_tile"] == 16
  assert mcc.kv_bytes(prefill) == 16 * (128 * 129 // 2) * per_token


def test_resident_blocks_by_hand():
  assert sm90.resident_blocks(168, 128, 125952) == 1          # shared memory bound
  assert sm90.resident_blocks(128, 128, 68608) == 3
  assert sm90.resident_blocks(255, 128, 1024) == 2            # 8192 registers per warp x 4
  assert sm90.resident_blocks(32, 128, 0) == 16               # threads bound (2048)


@pytest.mark.parametrize("case", [
    c if c.name in DEFAULT_COMPILES else pytest.param(c, marks=pytest.mark.exhaustive)
    for c in mcc.default_cases()], ids=lambda c: c.name)
def test_deviceless_sm90a_compile(case):
  why = mcc.unavailable_reason()
  if why:
    pytest.skip(why)
  row = mcc.measure(case)
  assert row["spill_bytes"] == 0, row
  assert row["registers"] <= 255, row
  assert row["shared_memory"] <= compile_target.SM90_SHARED_MEMORY_BYTES, row
  committed = {r["case"]: r for r in _report()["rows"]}[case.name]
  assert row["shared_memory"] == committed["shared_memory"], \
      "kernel changed: rerun experiments.gpu_compile_report --backends=mosaic_gpu"
