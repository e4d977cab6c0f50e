"""Engine end to end against the dense oracle (`models/dense.py`: no cache, full
recomputation): greedy equality token for token, block sizes, preemption in both
modes, parallel sampling vs independent runs, beam search vs a reference beam
search, multi-step decoding, no retracing, bad input, and the generate CLI."""

import contextlib
import functools
import io
import json
import os

import chex
import jax
import numpy as np
import pytest

from paged_jax.config import INVALID, ModelConfig
from paged_jax.engine import Engine, SamplingParams
from paged_jax.engine import step as step_lib
from paged_jax.engine import swap as swap_lib
from paged_jax.models import dense, llama

from engine_oracle import (MC, ORACLE_LEN, PARAMS, VOCAB, dense_greedy, dense_logprobs, greedy,
                           oracle_engine, random_prompts)

# One cache shape for (almost) every test so the jitted step compiles once per file:
# 12 blocks of 16 tokens, 8 slots of up to 64 tokens, 8 tokens per step (one bucket).
BLOCK_SIZE, NUM_BLOCKS, MAX_SEQS, BUDGET = 16, 12, 8, 8


make_engine = functools.partial(oracle_engine, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                max_seqs=MAX_SEQS, budget=BUDGET)


def test_greedy_matches_dense_oracle_with_chunked_prefill_and_queueing():
  # 10 requests, 8 slots: some wait; prompts of up to 12 tokens, 8-token steps: chunked.
  prompts = random_prompts(1, 10, hi=12)
  engine = make_engine()
  outs = engine.generate(prompts, greedy(8))
  for p, o in zip(prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, 8)
  assert engine.num_free == engine.cache_config.num_blocks      # every block returned
  assert engine.num_preemptions == 0


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 4, 256])   # 16: every other test
def test_greedy_matches_dense_oracle_block_sizes(block_size):
  prompts = random_prompts(2, 5)
  nb = max(8, 5 * -(-40 // block_size))
  cc = MC.cache_config(block_size=block_size, num_blocks=nb, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=-(-ORACLE_LEN // block_size))
  engine = Engine(MC, PARAMS, cc, max_num_batched_tokens=8, attention_backend="reference")
  outs = engine.generate(prompts, greedy(8))
  for p, o in zip(prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, 8)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_kv_budget_preempts_many_times_and_stays_exact(mode):
  # 12 blocks of 16 tokens for 12 requests of 16-24 + 40 tokens (4 blocks each).
  prompts = random_prompts(3, 12, lo=16, hi=24)
  engine = make_engine(preemption_mode=mode)
  outs = engine.generate(prompts, greedy(40))
  for p, o in zip(prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, 40)
  assert engine.num_preemptions >= 5        # measured: 7 (recompute), 9 (swap)
  if mode == "swap":
    assert engine.num_swaps >= 5 and engine.stats["swap_out_bytes"] > 0
  assert engine.num_free == NUM_BLOCKS


def test_parallel_sampling_equals_independent_runs_and_shares_prompt_blocks():
  prompt = random_prompts(4, 1, lo=14, hi=14)[0]
  kw = dict(max_tokens=8, temperature=0.9, top_k=40, top_p=0.95)
  engine = make_engine()
  forked = engine.generate([prompt], SamplingParams(n=3, seed=11, **kw))[0]
  singles = engine.generate([prompt] * 3, [SamplingParams(n=1, seed=11 + j, **kw)
                                           for j in range(3)])
  assert forked.outputs == [s.outputs[0] for s in singles]
  assert len({tuple(o) for o in forked.outputs}) > 1     # really sampled
  # Sharing: after the prompt's step the 3 samples hold the prompt's 3 full blocks once.
  engine.add_request(prompt, SamplingParams(n=3, seed=1, **kw))
  while not any(q.num_generated for g in engine.scheduler.running for q in g.seqs):
    engine.step()
  used = engine.cache_config.num_blocks - engine.num_free
  assert used == 1   # the 14-token prompt's one partial block, shared by all 3 samples
  while engine.has_unfinished():
    engine.step()
  engine.flush()
  assert engine.num_free == engine.cache_config.num_blocks


def reference_beam_search(params, prompt, beam_width, max_tokens, stop):
  """Independent reference of the spec in paged_jax/engine/beam.py, on the dense model."""
  beams = [(0.0, list(prompt))]
  finished = []
  for _ in range(max_tokens):
    cands = []
    for b, (score, ids) in enumerate(beams):
      lp = dense_logprobs(params, ids)
      order = sorted(range(VOCAB), key=lambda t: (-lp[t], t))[:2 * beam_width]
      cands += [(score + lp[t], b, r, t) for r, t in enumerate(order)]
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    new = []
    for score, b, _, t in cands:
      if t in stop:
        finished.append((score, beams[b][1] + [t]))
      else:
        new.append((score, beams[b][1] + [t]))
        if len(new) == beam_width:
          break
    beams = new
    if len(finished) >= beam_width:
      break
  else:
    finished += beams
  finished.sort(key=lambda f: -f[0])
  return finished


@pytest.mark.parametrize("stop", [(), (7, 21)])
def test_beam_search_equals_reference(stop):
  prompts = random_prompts(5, 2, lo=5, hi=9)
  engine = make_engine()
  sp = SamplingParams(max_tokens=6, temperature=0.0, beam_width=3, n=3, stop_token_ids=stop)
  outs = engine.generate(prompts, sp)
  for p, o in zip(prompts, outs):
    ref = reference_beam_search(PARAMS, p, 3, 6, stop)[:3]
    assert o.outputs == [ids[len(p):] for _, ids in ref]
    np.testing.assert_allclose(o.cumulative_logprobs, [s for s, _ in ref], rtol=1e-4, atol=1e-4)
  assert engine.num_free == engine.cache_config.num_blocks


def test_multi_step_decoding_matches_and_syncs_less():
  prompts = random_prompts(6, 5)
  engine = make_engine(decode_steps_per_sync=4)
  outs = engine.generate(prompts, greedy(12, stop_token_ids=(5,)))
  for p, o in zip(prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, 12, stop=(5,))
  assert engine.stats["device_steps"] * 2 < engine.stats["generated_tokens"]
  # Sampling (n=2: forked children copy-on-write inside the loop) is the same as k=1.
  sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, n=2, seed=4)
  multi = engine.generate(prompts[:3], sp)
  single = make_engine().generate(prompts[:3], sp)
  assert [o.outputs for o in multi] == [o.outputs for o in single]
  assert engine.num_free == NUM_BLOCKS


@pytest.mark.parametrize("lookahead", [False, True], ids=["loop_unreserved", "loop_reserved"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_multi_step_runs_out_of_blocks_inside_the_loop_and_stays_exact(mode, lookahead):
  # 8 short prompts admitted at once, each growing to 3 blocks.
  # (Prompt lengths 1-8: sequences cross block boundaries at different loop steps.)
  # loop_unreserved: the scheduler plans one token per row (as it would without its
  #   lookahead), so the lax loop meets OUT_OF_BLOCKS mid-way: it stops, the state is
  #   kept, the host then preempts. The device's safety net must stay exact.
  # loop_reserved (the default): the scheduler reserves each row's loop blocks and
  #   preempts up front instead, so no loop runs out.
  prompts = random_prompts(21, 8, lo=1, hi=8)
  engine = make_engine(preemption_mode=mode, decode_steps_per_sync=4)
  assert engine.scheduler.lookahead == 3
  if not lookahead:
    engine.scheduler.lookahead = 0
  outs = engine.generate(prompts, greedy(44))
  for p, o in zip(prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, 44)
  assert (engine.stats["loop_out_of_blocks"] > 0) != lookahead
  assert engine.num_preemptions > 0
  assert engine.num_free == NUM_BLOCKS


def test_no_retracing_over_hundreds_of_steps_of_changing_traffic():
  engine = make_engine()
  rng = np.random.default_rng(7)
  engine.generate(random_prompts(8, 2), greedy(3))
  before, seen_before = sum(step_lib.TRACE_COUNT.values()), engine.buckets_seen
  steps, added = 0, 0
  while steps < 300:
    if added < 60 and rng.random() < 0.4:
      sp = SamplingParams(max_tokens=int(rng.integers(1, 30)), n=int(rng.integers(1, 4)),
                          temperature=float(rng.choice([0.0, 0.7])), seed=int(rng.integers(99)),
                          stop_token_ids=(int(rng.integers(VOCAB)),))
      if rng.random() < 0.2:
        sp = SamplingParams(max_tokens=int(rng.integers(1, 12)), beam_width=2, temperature=0.0)
      engine.add_request(random_prompts(int(rng.integers(1e6)), 1, lo=1, hi=24)[0], sp)
      added += 1
    if engine.has_unfinished():
      engine.step()
    steps += 1
  # Which shapes earlier tests in this process already compiled varies (test order,
  # xdist), so the test asserts the property itself: the step traces once per shape
  # bucket on that bucket's first use, never again, and the buckets stay in the set.
  # (`buckets_seen` is shared by every engine of this model, whatever its cache shape.)
  new = engine.buckets_seen - seen_before
  assert sum(step_lib.TRACE_COUNT.values()) - before == len(new)
  b = engine.buckets
  assert len(new) <= b.max_variants
  assert all(s.rows in b.rows and s.width in b.widths for s in new), (new, b)
  assert engine.num_preemptions > 0       # traffic really changed shape


def test_bad_requests_raise_before_running_and_others_go_on():
  engine = make_engine()
  bad = [([], greedy(4), "prompt"), ([1, VOCAB], greedy(4), "prompt\\[1\\]"),
         ([1, -2], greedy(4), "prompt\\[1\\]"), ([1] * 60, greedy(10), "context"),
         ([1] * 40, SamplingParams(max_tokens=20, n=6, temperature=1.0), "never fit")]
  engine.add_request([3, 4, 5], greedy(4), request_id="ok")
  for prompt, sp, msg in bad:
    with pytest.raises(ValueError, match=msg):
      engine.add_request(prompt, sp)
  for kw, msg in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                  (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n must"),
                  (dict(beam_width=2, temperature=1.0), "temperature")]:
    with pytest.raises(ValueError, match=msg):
      SamplingParams(**kw)
  outs = []
  while engine.has_unfinished():
    outs += engine.step()
  assert [o.request_id for o in outs] == ["ok"]
  assert outs[0].outputs[0] == dense_greedy(PARAMS, [3, 4, 5], 4)


def test_generate_cli_on_saved_checkpoint(tmp_path):
  from absl import flags
  from experiments import generate
  from paged_jax.models import save_hf_checkpoint
  save_hf_checkpoint(str(tmp_path), MC, PARAMS, dtype="float32")
  # A 50-token prompt: the CLI sizes 4 blocks per sequence, the cache shape of every
  # other test here, so the compiled step is shared.
  prompts = random_prompts(9, 1, lo=50, hi=50) + random_prompts(10, 1, lo=7, hi=7)
  argv = ["generate", f"--checkpoint={tmp_path}",
          "--prompt_ids=" + ";".join(",".join(map(str, p)) for p in prompts),
          "--max_tokens=6", "--temperature=0", f"--block_size={BLOCK_SIZE}",
          f"--num_blocks={NUM_BLOCKS}", f"--max_seqs={MAX_SEQS}",
          f"--max_num_batched_tokens={BUDGET}", "--attention_backend=reference"]
  cli_flags = flags.FlagValues()   # private registry: the global FLAGS stays untouched
  generate.define_flags(cli_flags)
  cli_flags(argv)
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    generate.main(argv[:1], flag_values=cli_flags)
  result = json.loads(buf.getvalue())
  assert result == {"outputs": [dense_greedy(PARAMS, p, 6) for p in prompts]}


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preempted_parallel_sampling_and_beam_groups_restore_exactly(monkeypatch, mode):
  # Two long greedy requests hold 8 of the 12 blocks; the sampling group (n=3) and the
  # beam group (width 3) behind them get preempted. Recompute: prompt once on the
  # leader, re-forked, then each sample's own tokens. Swap / auto: the group's blocks
  # go to host, shared ones once, and come back shared (auto recomputes the greedy
  # singles).
  long_prompts = random_prompts(11, 2, lo=20, hi=20)
  sample_prompt, beam_prompt = random_prompts(12, 2, lo=18, hi=18)
  kw = dict(max_tokens=20, temperature=0.8, top_k=30)
  engine = make_engine(preemption_mode=mode)
  group_swaps = []
  copy_out = swap_lib.copy_out

  def spy(state, batch):
    group_swaps.extend(len(g.seqs) for g in batch.swap_out if len(g.seqs) > 1)
    return copy_out(state, batch)

  monkeypatch.setattr(swap_lib, "copy_out", spy)
  outs = engine.generate(
      long_prompts + [sample_prompt, beam_prompt],
      [greedy(40), greedy(40), SamplingParams(n=3, seed=3, **kw),
       SamplingParams(max_tokens=5, temperature=0.0, beam_width=3, n=2)])
  assert engine.num_preemptions > 0
  assert sum(o.num_preemptions for o in outs[2:]) > 0
  if mode != "recompute":
    assert group_swaps, "a multi-sequence group was meant to be swapped"
  for p, o in zip(long_prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, 40)
  singles = make_engine().generate([sample_prompt] * 3,
                                   [SamplingParams(n=1, seed=3 + j, **kw) for j in range(3)])
  assert outs[2].outputs == [s.outputs[0] for s in singles]
  ref = reference_beam_search(PARAMS, beam_prompt, 3, 5, ())[:2]
  assert outs[3].outputs == [ids[len(beam_prompt):] for _, ids in ref]
  assert engine.num_free == NUM_BLOCKS


def test_failed_reservation_leaves_state_unchanged_and_host_replans():
  # Device contract: a step whose allocation cannot be met reserves, writes and
  # samples nothing (this one frees and forks nothing, so the state is unchanged).
  from paged_jax.engine.inputs import empty_inputs
  engine = make_engine()
  engine.generate(random_prompts(13, 2), greedy(3))
  engine.add_request(random_prompts(14, 1, lo=20, hi=20)[0], greedy(4))
  engine.step()                                    # a live request holding blocks
  before = jax.device_get(engine.state)
  a = empty_inputs(BUDGET, MAX_SEQS, 1)
  a["alloc_tokens"][4:8] = 64                      # 4 x 4 blocks > the 12 in the pool
  engine.state, out = engine._step(engine.params, engine.state, step_lib.StepInputs(**a))   # pylint: disable=protected-access
  assert not bool(out.ok) and int(np.max(out.status)) > 0
  chex.assert_trees_all_equal(before, jax.device_get(engine.state))

  # Host side: with the scheduler's block need forced to 0 the device reports
  # OUT_OF_BLOCKS; the engine preempts, re-plans and still produces exact outputs.
  engine = make_engine()
  engine.scheduler.chunks_need = lambda group, chunks: 0
  prompts = random_prompts(15, 8, lo=16, hi=24)
  outs = engine.generate(prompts, greedy(24))
  assert engine.stats["out_of_blocks_retries"] > 0
  for p, o in zip(prompts, outs):
    assert o.outputs[0] == dense_greedy(PARAMS, p, 24)


@pytest.mark.slow

def test_a_plan_with_more_reserving_slots_than_rows_is_refused_whole():
  # Allocations and copy-on-write run on the row bucket's R lanes: a plan reserving in
  # more slots than R (a host bug) must be refused, never cut to R and half applied.
  from paged_jax.engine.inputs import empty_inputs
  for rows, ok in ((2, False), (4, True)):
    engine = make_engine()
    before = jax.device_get(engine.state)
    a = empty_inputs(BUDGET, MAX_SEQS, 1, num_rows=rows)
    a["alloc_tokens"][[1, 2, 5]] = 1
    engine.state, out = engine._step(engine.params, engine.state, step_lib.StepInputs(**a))   # pylint: disable=protected-access
    assert bool(out.ok) == ok
    after = jax.device_get(engine.state)
    if ok:
      np.testing.assert_array_equal(after.blocks.active, np.isin(np.arange(MAX_SEQS), [1, 2, 5]))
      assert int(after.blocks.num_free) == NUM_BLOCKS - 3
    else:
      np.testing.assert_array_equal(np.asarray(out.status)[[1, 2, 5]], [INVALID] * 3)
      chex.assert_trees_all_equal(before, after)

def test_generate_cli_subprocess_text_prompt_on_shipped_model():
  import subprocess
  import sys
  from paged_jax import tokenizer
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.generate", "--prompt=Once upon a time",
       "--max_tokens=24", "--attention_backend=reference"],
      cwd=root, capture_output=True, text=True, timeout=600, check=True)
  result = json.loads(proc.stdout)          # stdout holds only the JSON
  assert set(result) == {"outputs", "text"} and len(result["outputs"][0]) <= 24
  assert result["text"][0] == tokenizer.decode(result["outputs"][0])
  assert "KV capacity" in proc.stderr       # cache sizing logged at start-up


@pytest.mark.slow
def test_engine_with_pallas_ragged_kernel_interpreted():
  # The GPU path's kernel (run by the Pallas interpreter) under the engine's metadata:
  # packed rows, chunked prefill, forks, the multi-step loop. head_dim 16 (kernel minimum).
  mc = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=256)
  params = jax.tree_util.tree_map(lambda x: x * 8.0 if x.ndim == 2 else x,
                                  llama.init_params(mc, jax.random.key(1)))
  cc = mc.cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_seqs=MAX_SEQS,
                       max_blocks_per_seq=ORACLE_LEN // BLOCK_SIZE)
  prompts = random_prompts(31, 3, lo=3, hi=20)
  sps = [greedy(6), SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=1), greedy(6)]
  outs = {}
  for backend in ("pallas_interpret", "reference"):
    engine = Engine(mc, params, cc, max_num_batched_tokens=BUDGET, attention_backend=backend,
                    decode_steps_per_sync=2)
    outs[backend] = [o.outputs for o in engine.generate(prompts, sps)]
  assert outs["pallas_interpret"] == outs["reference"]
  fwd = jax.jit(lambda p, t: dense.forward(p, mc, t))
  for i in (0, 2):
    ids = list(prompts[i])
    for _ in range(6):
      buf = np.zeros((ORACLE_LEN,), np.int32)
      buf[:len(ids)] = ids
      ids.append(int(np.argmax(np.asarray(fwd(params, buf))[len(ids) - 1])))
    assert outs["pallas_interpret"][i][0] == ids[len(prompts[i]):]
