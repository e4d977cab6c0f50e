"""Reported log-probabilities against the dense oracle: `prompt_logprobs` (each prompt
token given the tokens before it, with its best alternatives; lm-evaluation-harness's
loglikelihood) and `logprobs` (each generated token's best alternatives), through
chunked prefills, prefix-cache hits of other requests in the same step (their tokens
move inside the step), preemption (recompute and swap), multi-step decoding and n > 1.
"""

import numpy as np
import pytest

from paged_jax.engine import SamplingParams

from engine_oracle import PARAMS, VOCAB, dense_logprobs_all, oracle_engine

TOL = 1e-4   # f32 paged forward vs the f64 read of the dense one


def check_prompt(prompt, out, k):
  """Every prompt position's log-probability and top-k ids equal the oracle's."""
  assert len(out.prompt_logprobs) == len(prompt) == len(out.prompt_top_logprobs)
  assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
  refs = dense_logprobs_all(PARAMS, prompt)
  for i in range(1, len(prompt)):
    ref = refs[i - 1]
    assert abs(out.prompt_logprobs[i] - ref[prompt[i]]) < TOL, i
    top = out.prompt_top_logprobs[i]
    assert [t for t, _ in top] == list(np.argsort(-ref, kind="stable")[:k]), i
    assert np.allclose([v for _, v in top], np.sort(ref)[::-1][:k], atol=TOL)


def check_generated(prompt, out, k):
  """Every sample's sampled-token log-probabilities and top-k equal the oracle's."""
  assert len(out.top_logprobs) == len(out.outputs)
  for ids, lps, tops in zip(out.outputs, out.logprobs, out.top_logprobs):
    assert len(lps) == len(tops) == len(ids)
    refs = dense_logprobs_all(PARAMS, list(prompt) + list(ids))
    for j, tok in enumerate(ids):
      ref = refs[len(prompt) + j - 1]
      assert abs(lps[j] - ref[tok]) < TOL
      assert [t for t, _ in tops[j]] == list(np.argsort(-ref, kind="stable")[:k])


def prompts_of(seed, lengths, prefix=()):
  rng = np.random.default_rng(seed)
  return [list(prefix) + [int(t) for t in rng.integers(0, VOCAB, n)] for n in lengths]


@pytest.mark.parametrize("caching", [False, True])
def test_prompt_and_top_logprobs_equal_the_oracle_through_chunked_prefills(caching):
  # Budget 16 < the 40-token prompt: it is scored over three chunks, the targets of each
  # chunk's last token lying in the next.
  prompts = prompts_of(0, (5, 23, 40))
  eng = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=16, caching=caching)
  sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
  for p, out in zip(prompts, eng.generate(prompts, [sp] * 3)):
    check_prompt(p, out, 2)
    check_generated(p, out, 3)
  assert eng.last_step.bucket.logprobs
  # Asked for nothing: nothing reported, and the steps run without the logprobs variant.
  plain = oracle_engine(block_size=4, num_blocks=64, max_seqs=4, budget=16, caching=caching)
  plain.add_request(prompts[2], SamplingParams(max_tokens=3, temperature=0.0))
  seen = []
  while plain.has_unfinished():
    done = plain.step()
    seen.append(plain.last_step.bucket)
  assert done[0].prompt_logprobs is None and done[0].top_logprobs is None
  assert seen and not any(b.logprobs for b in seen if b is not None)


def test_scoring_beside_prefix_hits_preemption_and_multi_step():
  # Caching on, a pool small enough to preempt, two decode steps per sync: requests that
  # hit a cached 24-token prefix (their hit tokens leave the step's packed arrays) run in
  # the same steps as requests scoring prompts with the same prefix, which take no hit.
  shared = prompts_of(1, (24,))[0]
  warm = prompts_of(2, (3, 5), prefix=shared)
  mixed = prompts_of(3, (4, 9, 2, 7), prefix=shared)
  eng = oracle_engine(block_size=4, num_blocks=30, max_seqs=4, budget=16, caching=True,
                      decode_steps_per_sync=2)
  eng.generate(warm, SamplingParams(max_tokens=2, temperature=0.0))
  score = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1, logprobs=1)
  plain = SamplingParams(max_tokens=6, temperature=0.0)
  outs = eng.generate(mixed, [score, plain, score, plain])
  hits = eng.prefix_stats()["hit_tokens"]
  assert hits >= 2 * 24, hits                  # the plain ones hit the shared prefix
  for p, out in zip(mixed[::2], outs[::2]):
    check_prompt(p, out, 1)
    check_generated(p, out, 1)
  assert outs[1].prompt_logprobs is None and outs[1].top_logprobs is None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_samples_report_per_sample_under_preemption(mode):
  prompts = prompts_of(4, (11, 14, 9))
  eng = oracle_engine(block_size=4, num_blocks=14, max_seqs=6, budget=32,
                      preemption_mode=mode)
  sp = [SamplingParams(max_tokens=12, temperature=0.9, n=2, seed=s, logprobs=2,
                       prompt_logprobs=0) for s in (1, 2, 3)]
  outs = eng.generate(prompts, sp)
  assert eng.num_preemptions > 0
  for p, out in zip(prompts, outs):
    assert all(x == [] for x in out.prompt_top_logprobs[1:])   # k = 0: no alternatives
    check_generated(p, out, 2)
    refs = dense_logprobs_all(PARAMS, p)
    for i in range(1, len(p)):
      assert abs(out.prompt_logprobs[i] - refs[i - 1][p[i]]) < TOL


def test_bad_values_are_one_line_errors():
  for kw, msg in [(dict(logprobs=21), "logprobs must be an int in [0, 20]"),
                  (dict(prompt_logprobs=-1), "prompt_logprobs must be an int in [0, 20]"),
                  (dict(logprobs=True), "logprobs must be an int"),
                  (dict(beam_width=2, temperature=0.0, logprobs=1), "beam search")]:
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
      SamplingParams(**kw)
