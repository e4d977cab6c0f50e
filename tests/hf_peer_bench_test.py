"""experiments/hf_peer_bench and experiments/hf_peer: paged_jax vs transformers'
continuous batching.

The engine-vs-engine cases skip when the benchmark-only extras (torch, transformers;
requirements-bench.txt) are missing. With them, they are a cross-implementation check of our
HF checkpoint loading and Llama model: greedy outputs of transformers' own LlamaForCausalLM
on the same fp32 weights must match paged_jax's token for token.
"""

import numpy as np
import pytest

from experiments import hf_peer
from experiments import hf_peer_bench
from paged_jax import tokenizer
from paged_jax.models import DEFAULT_CHECKPOINT

MAX_NEW = 12
KW = dict(block_size=8, num_blocks=48, max_seqs=4, max_batch_tokens=64, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(20261201)
  seed = int(rng.integers(1 << 20))
  ps = hf_peer_bench.story_prompts(3, 10, 40, seed=seed)
  # Plus one prompt of random printable bytes (not story text).
  ps.append(tokenizer.encode(bytes(rng.integers(32, 127, 17).tolist()).decode("ascii")))
  return ps


@pytest.fixture(scope="module")
def outputs(prompts):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  pj = hf_peer.PagedJaxRunner(DEFAULT_CHECKPOINT, max_model_len=64, **KW)
  hf = hf_peer.TransformersRunner(DEFAULT_CHECKPOINT, threads=2, **KW)
  try:
    out = {"paged_jax": pj(prompts), "transformers": hf(prompts),
           "paged_jax_steady": pj.steady(prompts), "transformers_steady": hf.steady(prompts)}
  finally:
    pj.close()
    hf.close()
  return out


def test_every_path_generates_the_requested_lengths(prompts, outputs):
  for name, outs in outputs.items():
    assert len(outs) == len(prompts), name
    assert [len(o) for o in outs] == [MAX_NEW] * len(prompts), name
    assert all(0 <= t < tokenizer.VOCAB_SIZE for o in outs for t in o), name


def test_greedy_outputs_agree_with_transformers(outputs):
  # Same fp32 weights, greedy: at least the first 8 tokens of every prompt must match
  # (float reductions differ, so a late near-tie may flip; early ones must not).
  for a, b in zip(outputs["paged_jax"], outputs["transformers"]):
    assert a[:8] == b[:8], (a, b)
  agree = hf_peer.agreement(outputs["paged_jax"], outputs["transformers"])
  assert agree["min_common_prefix"] >= 8


def test_steady_and_end_to_end_paths_agree(outputs):
  assert outputs["paged_jax_steady"] == outputs["paged_jax"]
  assert outputs["transformers_steady"] == outputs["transformers"]


def test_agreement_counts_common_prefixes():
  rng = np.random.default_rng(7)
  a = [rng.integers(0, 258, 10).tolist() for _ in range(5)]
  cut = rng.integers(0, 10, 5)
  b = [x[:c] + [(x[c] + 1) % 258] + x[c + 1:] for x, c in zip(a, cut)]
  b[0] = list(a[0])      # one exact match
  cut[0] = 10
  got = hf_peer.agreement(a, b)
  assert got["exact_match_fraction"] == pytest.approx(1 / 5)
  assert got["mean_common_prefix"] == pytest.approx(float(np.mean(cut)))
  assert got["min_common_prefix"] == int(cut.min())


def test_bad_sizes_are_rejected_before_work():
  with pytest.raises(ValueError, match="--block_size must be an int >= 4"):
    hf_peer_bench.Config(block_size=2)
  with pytest.raises(ValueError, match="min_prompt_len"):
    hf_peer_bench.story_prompts(4, 50, 10)


@pytest.mark.slow   # ~18 s on 2 cores (load 7): two engines compile the random model's step
def test_paged_side_on_a_random_checkpoint_without_torch(prompts, tmp_path):
  # The half of the experiment that needs no extras, on `--random_hidden_size`'s model
  # (here 128 x 1 layer): the checkpoint loads as written, and the end-to-end and steady
  # paths generate the requested lengths, token for token the same.
  ckpt = hf_peer.random_checkpoint(str(tmp_path / "random"), hidden_size=128, num_layers=1)
  pj = hf_peer.PagedJaxRunner(ckpt, max_model_len=64, **KW)
  try:
    once, steady = pj(prompts), pj.steady(prompts)
  finally:
    pj.close()
  mc = pj.model_config
  assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (128, 1, 2, 1)
  assert mc.vocab_size == tokenizer.VOCAB_SIZE and pj.num_params > 0
  assert [len(o) for o in once] == [MAX_NEW] * len(prompts)
  assert hf_peer.agreement(once, steady)["exact_match_fraction"] == 1.0
  with pytest.raises(ValueError, match="multiple of 128"):
    hf_peer.random_checkpoint(str(tmp_path / "bad"), hidden_size=192, num_layers=1)
