"""experiments/speculative and experiments/speculative_scale: the workloads and the stand-in
proposer they rest on, and their flags' one-line errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import speculative as spec_cpu
from experiments import speculative_blocks
from experiments import speculative_scale
from experiments import speculative_tally
from paged_jax import kv_cache
from paged_jax import tokenizer
from paged_jax.models import standin


def _standin_greedy(params, config, tokens, positions):
  """The stand-in forward's argmax at each (token, position): what the engine decodes."""
  cache = config.cache_config(block_size=4, num_blocks=4, max_seqs=1, max_blocks_per_seq=4)

  class Meta:   # the fields `standin.apply` reads
    slot_mapping = jnp.full((len(tokens),), -1, jnp.int32)
    logits_indices = jnp.arange(len(tokens), dtype=jnp.int32)
  logits, _ = standin.apply(params, jnp.asarray(tokens, jnp.int32),
                            jnp.asarray(positions, jnp.int32), kv_cache.init(cache), Meta)
  return np.argmax(np.asarray(logits), axis=-1)


def test_standin_proposer_follows_the_standin_model_at_alpha_one_and_misses_at_zero():
  config, params = standin.model(64, max_position_embeddings=64)
  rng = np.random.default_rng(0)
  for _ in range(5):
    tokens = [int(t) for t in rng.integers(0, 64, int(rng.integers(1, 20)))]
    draft = speculative_scale.standin_proposer(64, 1.0, 0)(tokens, 4)
    assert len(draft) == 4
    # Each draft token is the model's greedy token after the one before it.
    prev = [tokens[-1]] + list(draft[:-1])
    pos = np.arange(len(tokens) - 1, len(tokens) + 3)
    np.testing.assert_array_equal(_standin_greedy(params, config, prev, pos), draft)
    wrong = speculative_scale.standin_proposer(64, 0.0, 0)(tokens, 4)
    assert len(wrong) == 1 and wrong[0] != draft[0]


def test_cpu_workloads_are_seeded_and_shaped():
  f = spec_cpu.Config(requests=3, echo=20, plain_len=30)
  rep = spec_cpu.workload(f, "repetitive")
  assert rep == spec_cpu.workload(f, "repetitive")
  for p in rep:   # the story's first `echo` bytes come again after a blank line
    text = bytes(p[1:]).decode()
    story, again = text.split("\n\n")
    assert story.startswith(again) and len(again) == 20
  assert all(len(p) == 31 for p in spec_cpu.workload(f, "plain"))
  assert all(len(p) == 31 for p in spec_cpu.workload(f, "no_match"))


@pytest.mark.parametrize("cls, kw, name", [
    (spec_cpu.Config, dict(lookup_min=5, lookup_max=3), "lookup_min"),
    (spec_cpu.Config, dict(ks=(0,)), "ks"),
    (speculative_scale.Config, dict(alphas=(1.5,)), "alphas"),
])
def test_bad_flags_are_one_line_errors(cls, kw, name):
  with pytest.raises(ValueError) as e:
    cls(**kw)
  assert name in str(e.value) and "\n" not in str(e.value)


def test_full_drafts_are_k_tokens_with_the_same_accepted_prefix():
  rng = np.random.default_rng(1)
  for alpha in (0.0, 0.5, 1.0):
    short = speculative_scale.standin_proposer(64, alpha, 3)
    full = speculative_scale.standin_proposer(64, alpha, 3, full=True)
    for _ in range(5):
      tokens = [int(t) for t in rng.integers(0, 64, int(rng.integers(1, 20)))]
      a, b = short(tokens, 5), full(tokens, 5)
      assert len(b) == 5 and b[:len(a)] == a   # same draws, padded with the wrong token
      assert all(t == a[-1] for t in b[len(a):])


def test_kv_fraction_below_one_request_is_a_one_line_error():
  with pytest.raises(ValueError) as e:
    speculative_scale.Setup(speculative_scale.Config(kv_fraction=0.05, num_requests=10))
  assert "--kv_fraction" in str(e.value) and "\n" not in str(e.value)
  half = speculative_scale.Setup(speculative_scale.Config(kv_fraction=0.5, num_requests=10))
  full = speculative_scale.Setup(speculative_scale.Config(num_requests=10))
  assert half.budget % 16 == 0 and abs(half.budget - full.budget / 2) < 16


class _Seq:
  def __init__(self, prompt_len):
    from paged_jax.engine.sequence import SeqState
    self.prompt_len, self.num_computed, self.state = prompt_len, 0, SeqState.RUNNING


class _Engine:
  """A scripted engine: each step() plans `chunks` and then sets the committed lengths,
  as the engine's update does; metrics() reports the used blocks given."""

  def __init__(self, seq, script, used):
    import types
    from paged_jax.engine.sequence import Batch, Chunk
    self.decode_steps_per_sync, self.prefix_caching = 1, False
    self.cache_config = types.SimpleNamespace(block_size=4)
    self.last_step = types.SimpleNamespace(ok=True)
    self._script, self._used, self._n = script, used, 0
    self.scheduler = types.SimpleNamespace(
        running=[types.SimpleNamespace(seqs=[seq])],
        schedule=lambda: Batch(chunks=[Chunk(seq, n, True, False, start=s, draft=d)
                                       for s, n, d, _ in [self._script[self._n]]]))
    self.seq = seq

  def step(self):
    self.scheduler.schedule()
    self.seq.num_computed = self._script[self._n][3]
    self._n += 1
    return []

  def metrics(self):
    return {"num_blocks": 100, "num_free_blocks": 100 - self._used[self._n - 1]}


def test_block_tally_counts_a_scripted_run_by_hand():
  """Block size 4, a 5-token prompt, then two decode rows with 3 drafts each: the first
  accepts none (reserves 9 tokens, 3 blocks; rolls back to 6, 2 blocks: frees 1), the
  second all three (reserves 10: 3 blocks, the pop 'keep' would not make)."""
  seq = _Seq(prompt_len=5)
  # (start, tokens, draft, num_computed after)
  script = [(0, 5, (), 5), (5, 1, (7, 7, 7), 6), (6, 1, (7, 7, 7), 10)]
  engine = _Engine(seq, script, used=[2, 2, 3])
  tally = speculative_tally.instrument(engine)
  for _ in script:
    engine.step()
  assert (tally.steps, tally.pops, tally.saved_pops, tally.saved_next) == (3, 4, 1, 1)
  assert (tally.rollback_freed, tally.kept_block_steps) == (1, 1)
  assert (tally.used_block_steps, tally.seq_steps) == (7, 3)
  assert (tally.decode_rows, tally.draft_rows, tally.draft_tokens) == (2, 2, 6)
  assert (tally.checked_steps, tally.mismatched_steps) == (3, 0)
  s = tally.summary()
  assert s["rows_lost"] == pytest.approx((1 / 3) / (7 / 3))
  bad = _Engine(_Seq(5), script, used=[2, 3, 3])   # the engine's count differs once
  t = speculative_tally.instrument(bad)
  for _ in script:
    bad.step()
  assert t.mismatched_steps == 1


def test_block_tally_on_the_engine_matches_its_used_blocks_every_step():
  """The shipped model, prompt lookup on repetitive prompts (2 requests): the host
  model's holdings equal the engine's used-block count after every step."""
  row = speculative_blocks.cpu_run(speculative_blocks.Config(cpu_requests=2, cpu_gen=24), 3)
  t = row["tally"]
  assert t["checked_steps"] > 0 and t["mismatched_steps"] == 0
  assert t["draft_rows"] > 0 and 0 <= t["saved_pops"] <= t["pops"]


def test_paper_run_smoke_counts_match_the_engine_and_render():
  """A 10-request paper-scale point (OPT-13B / A100-40GB, half the KV budget): the tally
  agrees with the engine every step, and the section's row renders."""
  row = speculative_blocks.paper_run(
      speculative_blocks.Config(num_requests=10, kv_fraction=0.5, paper_rate=2.0), 2, 0.6)
  assert row["tally"]["mismatched_steps"] == 0 and row["tally"]["draft_rows"] > 0
  assert 0 < row["pop_s"] < 1e-9 and row["model_step_s"] > 0.01   # ps vs tens of ms
  (rendered,) = speculative_blocks.summary_rows({"rows": [row]})
  assert rendered[:3] == ("paper", 2, 0.6) and len(rendered) == len(speculative_blocks.HEADERS)


def test_kv_rows_render_searched_and_unsearched_runs():
  """kv_runs_rows: a row per (run, configuration) led by the run's name, KV share and
  seed; an unsearched run (--nosearch) shows '-' for the max rate and its batch."""
  load = dict(preemptions=5, mean_running=9.5, max_running=12, steps=100)
  base = dict(saturation_req_s=1.5, saturation_vs_off=1.0, saturation=load, tpot_p50_s=0.02,
              fixed_rate=3.0, acceptance=None, blocks={"drafting_share": 0.0}, **load)
  searched = dict(base, k=0, alpha=None, max_rate=4.0, censored=False, vs_off=1.0,
                  at_slo=dict(rate=3.9, **load))
  unsearched = dict(base, k=4, alpha=0.5, max_rate=None, censored=None, vs_off=None,
                    at_slo=None, acceptance=0.25, blocks={"drafting_share": 0.2})
  doc = {"runs": [("a", {"flags": {"kv_fraction": 0.5, "seed": 1}, "rows": [searched]}),
                  ("b", {"flags": {"kv_fraction": 1.0, "seed": 0}, "rows": [unsearched]})]}
  rows = speculative_scale.kv_runs_rows(doc)
  h = speculative_scale.KV_RUNS_HEADERS
  assert all(len(r) == len(h) for r in rows)
  a, b = (dict(zip(h, r)) for r in rows)
  assert (a["run"], a["KV budget"], a["seed"], a["k"]) == ("a", 0.5, 1, "off")
  assert a["max rate at SLO (req/s)"] == 4.0 and a["mean batch at max rate"] == 9.5
  assert a["TPOT p50 (ms)"] == pytest.approx(20.0)
  assert (b["k"], b["alpha"], b["drafting rows / decode rows"]) == (4, 0.5, 0.2)
  assert b["max rate at SLO (req/s)"] == "-" and b["preemptions at max rate"] == "-"


def test_always_miss_drafts_the_nul_byte_over_the_plain_prompts():
  f = spec_cpu.Config(requests=3, plain_len=30)
  assert spec_cpu.workload(f, "always_miss") == spec_cpu.workload(f, "plain")
  assert spec_cpu._never([1, 2, 3], 4) == (spec_cpu.NUL,) * 4   # pylint: disable=protected-access
  assert tokenizer.decode([spec_cpu.NUL]) == "\x00"     # the byte tokenizer's NUL


def test_ratio_interval_brackets_the_ratio_of_medians():
  rng = np.random.default_rng(3)
  off = list(1.0 + 0.02 * rng.standard_normal(15))
  on = list(1.25 + 0.02 * rng.standard_normal(15))
  lo, hi = spec_cpu._ratio_ci(off, on, 0)   # pylint: disable=protected-access
  assert lo < np.median(off) / np.median(on) < hi
  assert 0.75 < lo < hi < 0.85            # the true 0.8 within, a tight interval
  assert spec_cpu._ratio_ci(off, on, 0) == (lo, hi)   # pylint: disable=protected-access


def test_cpu_run_smoke_counts_drafting_steps_and_draft_model_acceptance():
  """experiments.speculative at tiny sizes: the oracle proposer and the model drafting for
  itself accept every draft (greedy), the half-depth draft some; the counts table renders
  one row per (workload, k)."""
  f = spec_cpu.Config(workloads=("always_hit", "draft_self", "draft_half"), ks=(2,),
                      requests=2, gen=8, repeats=1)
  result = spec_cpu.run(f)
  rows = {(r["workload"], r["k"]): r for r in result["rows"]}
  for kind in ("always_hit", "draft_self"):
    r = rows[(kind, 2)]
    assert r["acceptance"] == 1.0 and 0 < r["drafting_steps"] <= r["steps"] < r["steps_off"]
  assert rows[("draft_self", 2)]["draft_dispatches"] >= rows[("draft_self", 2)]["drafting_steps"]
  assert rows[("draft_half", 2)]["drafted"] > 0
  assert len(spec_cpu.count_rows(result)) == len(result["rows"]) == 6
