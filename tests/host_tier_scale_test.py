"""The host tier at paper scale (issue 40, point 4(c)): the device-time model's price of
the host tier's copies against a hand computation from the catalog's datasheet figures,
the multi-turn streams (`bench.multi_turn`), the transfer-counting clock on a real engine,
and experiments/host_tier_scale at a tiny size."""

import json

import numpy as np
import pytest

from paged_jax import perf
from paged_jax.bench import multi_turn
from paged_jax.bench import sharegpt_trace
from paged_jax.perf import catalog

BS = 16


def _opt13b_block_bytes():
  """By hand: K and V, 40 layers, hidden 5120, fp16 (OPT-13B's config), 16 tokens."""
  m = catalog.MODELS["opt-13b"]
  assert (m.num_layers, m.hidden_size, m.dtype) == (40, 5120, "float16")
  per_token = 2 * 40 * 5120 * 2
  assert per_token == catalog.PAPER_KV_BYTES_PER_TOKEN["opt-13b"]   # the paper's 800 KB
  return BS * per_token


@pytest.mark.parametrize("n", [1, 7, 64])
def test_a_promotion_of_n_blocks_costs_n_blocks_over_pcie(n):
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  g, e = catalog.GPUS["a100-40gb"], catalog.DEFAULT_EFFICIENCY
  # The datasheet's PCIe Gen4 x16: 64 GB/s both ways, 32 GB/s one way; 80% achieved.
  assert (g.pcie_bandwidth, e.pcie) == (32e9, 0.8)
  block = _opt13b_block_bytes()
  pcie = n * block / (32e9 * 0.8)
  staging = 2 * n * block / (g.hbm_bandwidth * e.elementwise_bandwidth)   # HBM write-in
  latency = 2 * e.swap_copy_latency_s                                    # one copy K, one V
  got = dm.breakdown(perf.StepShape(host_in_blocks=n, block_size=BS))
  assert got["host_tier"] == pytest.approx(pcie + staging + latency, rel=1e-12)
  assert got["total"] == pytest.approx(got["host_tier"], rel=1e-12)
  # the PCIe term alone: n blocks of 13,107,200 bytes at 25.6 GB/s = 0.512 ms each
  assert pcie == pytest.approx(n * 0.512e-3, rel=1e-12)


def test_a_download_runs_beside_the_step_and_costs_only_what_it_adds():
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  g, e = catalog.GPUS["a100-40gb"], catalog.DEFAULT_EFFICIENCY
  block = _opt13b_block_bytes()
  prefill = perf.StepShape.prefill([512], block_size=BS)
  alone = dm.step_seconds(prefill)
  for n in (4, 400):
    s = perf.StepShape.prefill([512], block_size=BS, host_out_blocks=n)
    staging = 2 * n * block / (g.hbm_bandwidth * e.elementwise_bandwidth)
    download = n * block / (32e9 * 0.8) + 2 * e.swap_copy_latency_s
    expect = max(alone + staging, download)
    assert dm.step_seconds(s) == pytest.approx(expect, rel=1e-12)
    w = dm.work(s)
    assert w.gradient(dm.theta) @ dm.theta == pytest.approx(expect, rel=1e-12)
    parts = dm.breakdown(s)
    assert parts["total"] == pytest.approx(expect, rel=1e-12)
  # 4 blocks (2 ms) hide under a 512-token prefill (~60 ms); 400 blocks (205 ms) do not
  assert dm.step_seconds(perf.StepShape.prefill([512], block_size=BS, host_out_blocks=4)) \
      < alone * 1.01
  with pytest.raises(ValueError, match="host_in_blocks must be >= 0"):
    perf.StepShape(host_in_blocks=-1)


def _synthetic(seed=0, **kw):
  args = dict(first=(8, 20), user=(2, 6), output=(3, 5), start_rate=0.5, think_mean=3.0,
              vocab=256, seed=seed)
  args.update(kw)
  return multi_turn.synthetic(5, 4, **args)


def test_synthetic_chats_are_seeded_and_each_history_is_a_prefix_of_the_next():
  a, b, c = _synthetic(0), _synthetic(0), _synthetic(1)
  same = lambda x, y: all(np.array_equal(u, v) for p, q in zip(x, y)
                          for u, v in zip(p.user, q.user)) and \
      [p.output_lens for p in x] == [q.output_lens for q in y] and \
      [p.start for p in x] == [q.start for q in y]
  assert same(a, b) and not same(a, c)
  rng = np.random.default_rng(3)
  for conv in a:
    assert conv.turns == 4 and all(3 <= o <= 5 for o in conv.output_lens)
    answers = [rng.integers(0, 256, o).tolist() for o in conv.output_lens]
    prompts = [conv.prompt(t, answers) for t in range(conv.turns)]
    for t in range(conv.turns - 1):   # turn t's prompt and answer start turn t + 1's
      nxt = prompts[t + 1]
      assert nxt[:len(prompts[t])] == prompts[t]
      assert nxt[len(prompts[t]):len(prompts[t]) + len(answers[t])] == answers[t]
      assert nxt[len(prompts[t]) + len(answers[t]):] == conv.user[t + 1].tolist()
    assert [len(p) for p in prompts] == conv.prompt_lens()
  assert np.all(np.diff([c.start for c in a]) > 0)
  # a faster start rate is the same draws compressed (common random numbers)
  fast = _synthetic(0, start_rate=1.0)
  assert [c.start for c in fast] == pytest.approx([c.start / 2 for c in a])
  with pytest.raises(ValueError, match="first must be"):
    _synthetic(0, first=(5, 2))


def _tiny_engine(num_host_blocks, num_blocks=10):
  from paged_jax.bench import engines
  from paged_jax.engine import Engine
  mc, params = engines.tiny_model()
  cc = mc.cache_config(block_size=8, num_blocks=num_blocks, max_seqs=4, max_blocks_per_seq=8,
                       enable_prefix_caching=True, num_host_blocks=num_host_blocks)
  return Engine(mc, params, cc, max_num_batched_tokens=32)


def test_the_transfer_clock_charges_what_the_host_tier_moved():
  convs = multi_turn.synthetic(5, 3, first=(20, 30), user=(2, 6), output=(3, 4),
                               start_rate=0.5, think_mean=0.5, vocab=200, seed=2)
  dm = perf.DeviceTimeModel.named("opt-13b", "a100-40gb")
  runs = {}
  for host in (0, 40):
    engine = _tiny_engine(host)
    clock = multi_turn.transfer_clock(dm, engine)
    runs[host] = (engine, clock, multi_turn.serve(engine, convs, clock, keep_outputs=True))
  (_, c0, r0), (e1, c1, r1) = runs[0], runs[40]
  assert r0["outputs"] == r1["outputs"]            # the tier changes no token
  assert r0["host_in_blocks"] == r0["host_out_blocks"] == 0
  assert c0.totals()["by_part_s"]["host_tier"] == 0
  assert r1["host_hit_tokens"] > 0 and r1["host_in_blocks"] * 8 == r1["host_hit_tokens"]
  held = e1.metrics()["num_host_blocks"] - e1.metrics()["num_free_host_blocks"]
  assert r1["host_out_blocks"] >= held > 0         # every held block was downloaded once
  assert r1["prompt_tokens_computed"] <= r0["prompt_tokens_computed"]
  assert r1["prompt_tokens"] == r0["prompt_tokens"] == sum(
      sum(c.prompt_lens()) for c in convs)
  # the clock charged each step's copies at the model's price, and nothing else changed
  dm_cost = c1.totals()["by_part_s"]["host_tier"]
  assert dm_cost > 0
  assert r1["summary"]["requests"] == sum(c.turns for c in convs)


@pytest.mark.slow   # reads and tokenizes the 125 MB trace
def test_sharegpt_multi_turn_chats_are_the_traces_turns():
  if sharegpt_trace.available():
    pytest.skip(sharegpt_trace.available())
  convs = multi_turn.sharegpt(20, seed=3, max_len=512, start_rate=1.0, think_mean=5.0)
  again = multi_turn.sharegpt(20, seed=3, max_len=512, start_rate=1.0, think_mean=5.0)
  assert [c.output_lens for c in convs] == [c.output_lens for c in again]
  texts = {d[k][1].encode("utf-8")[:8] for d in sharegpt_trace.dialogues()
           for k in range(0, len(d), 2)}
  for c in convs:
    assert c.turns >= 2 and c.prompt_lens()[-1] + c.output_lens[-1] <= 512
    for u in c.user:   # the human turn's UTF-8 bytes
      assert bytes(u[:8].astype(np.uint8).tolist()) in texts or len(u) < 8


@pytest.mark.slow   # compiles the paper-scale step (OPT-13B's 2,560-token budget)
def test_tiny_paper_scale_run_writes_the_table(tmp_path):
  from experiments import host_tier_scale
  f = host_tier_scale.Config(workload="synthetic", conversations=3, synthetic_turns=2,
                             synthetic_first="16,32", synthetic_user="8,16",
                             synthetic_output="4,8", unloaded_conversations=1, max_points=2,
                             host_factors="1", think_s=1.0, max_seqs=4, ttft_rate=0.5)
  host_tier_scale.main(f, tmp_path)
  res = json.loads((tmp_path / "host_tier_scale.json").read_text())
  assert set(res["systems"]) == {"device_only", "host_1x"}
  assert res["workload"] == "synthetic" and res["device_blocks"] == 987
  assert res["systems"]["host_1x"]["num_host_blocks"] == 987
  assert "versions" in res and res["flags"]["host_factors"] == "1"
  assert res["systems"]["host_1x"]["at_ttft_rate"]["summary"]["requests"] == 6
  rows = host_tier_scale.summary_rows(res)
  assert len(rows) == 2 and len(rows[0]) == len(host_tier_scale.HEADERS)


def test_merge_joins_runs_of_one_stream_and_refuses_others(tmp_path):
  from experiments import host_tier_scale
  summ = lambda p50: {"summary": {"ttft_p50_s": p50, "ttft_p99_s": 2 * p50},
                      "prompt_tokens_computed": 1, "host_hit_tokens": 0}
  common = dict(workload="synthetic", stream={"turns": 4}, device_blocks=10, max_seqs=4,
                slo_s_per_token=0.1)
  a = dict(common, systems={"device_only": dict(num_host_blocks=0, max_rate=2.0,
                                                censored=False, at_start=summ(4.0))})
  b = dict(common, systems={"host_4x": dict(num_host_blocks=40, max_rate=3.0,
                                            censored=False, at_start=summ(1.0))})
  c = dict(common, systems={s: dict(num_host_blocks=n, at_ttft_rate=summ(p))
                            for s, n, p in (("device_only", 0, 0.5), ("host_4x", 40, 0.25))})
  paths = []
  for name, doc in (("a", a), ("b", b), ("c", c)):
    paths.append(str(tmp_path / f"{name}.json"))
    (tmp_path / f"{name}.json").write_text(json.dumps(doc))
  m = host_tier_scale.merge(paths)
  assert list(m["systems"]) == ["device_only", "host_4x"]
  h = m["systems"]["host_4x"]
  assert h["max_rate_vs_device_only"] == 1.5 and h["ttft_p50_speedup"] == 4.0
  assert h["ttft_p50_speedup_at_ttft_rate"] == 2.0 and h["at_ttft_rate"]["summary"]
  assert len(host_tier_scale.summary_rows(m)) == 2
  # a search cut short keeps what its points show: a bound, marked
  cut = host_tier_scale.compare(dict(common, systems={
      "device_only": dict(num_host_blocks=0, max_rate=2.0, censored=False),
      "host_1x": dict(num_host_blocks=10, points_so_far=[[3.0, 0.05]]),
      "host_4x": dict(num_host_blocks=40, points_so_far=[[3.0, 0.5]])}))
  rows = {r[0]: r for r in host_tier_scale.summary_rows(cut)}
  assert rows["host_1x"][2] == ">= 3 (cut: 1 rate)" and rows["host_1x"][3] == ">= 1.5"
  assert rows["host_4x"][2] == "< 3 (cut: 1 rate)" and rows["host_4x"][3] == "-"
  (tmp_path / "c.json").write_text(json.dumps(dict(c, slo_s_per_token=0.2)))
  with pytest.raises(ValueError, match="slo_s_per_token differ"):
    host_tier_scale.merge(paths)


@pytest.mark.parametrize("kw, msg", [
    (dict(host_factors="1,x"), "--host_factors must be comma-separated numbers"),
    (dict(host_factors="0"), "--host_factors must be comma-separated numbers > 0"),
    (dict(synthetic_first="9"), "--synthetic_first must be two comma-separated ints"),
    (dict(synthetic_user="5,2"), "--synthetic_user must be low,high"),
])
def test_bad_flags_are_one_line_errors(kw, msg):
  from experiments import host_tier_scale
  with pytest.raises(ValueError, match=msg) as e:
    host_tier_scale.Config(**kw)
  assert "\n" not in str(e.value)
