r"""KV blocks held per sequence and max batched requests with hybrid KV on and off (issue 26).

    python -m experiments.hybrid_kv --contexts=8192,16384,32768 --window=1024 \
        --out=experiments/results/hybrid_kv

A Gemma-3-like layer pattern (`--sliding_per_full` sliding-window layers per full-attention
one, window `--window`) gets the same KV memory with hybrid KV off and on: the bytes that
hold `--base_requests` sequences of `context` tokens when every layer keeps every block.
Off: one pool of that many blocks. On (`CacheConfig.sliding_layers`): as many sequences as
fit, the sliding pool sized by `config.sliding_pool_blocks` for them and the rest given to
the full-attention layers' pool. Each engine then serves two more requests than fit to the
end (prompts of `context - gen` tokens; `gen` long enough that a request still decodes
while the others prefill: 2 x requests x cdiv(context, budget) tokens, at most a quarter
of the context), and after every step the experiment reads the device state: the most
sequences holding their whole prompt at once ("max batched") and, at that moment, the
blocks each holds per layer kind.

The forward is a stand-in (zero logits, no K/V written): block accounting is what is
measured, and it does not depend on the model's values (tests/hybrid_kv_engine_test.py
shows outputs on == off on a real Gemma-like model), so 32K contexts run on a CPU.

Analytic: per sequence, n_layers * cdiv(L, bs) layer-blocks off against
n_full * cdiv(L, bs) + n_sliding * (cdiv(W - 1, bs) + 1) on (what a sliding layer keeps
between steps); the max batched ratio is their ratio. Writes OUT/hybrid_kv.json (flags,
versions, machine) and prints a table.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import configs
from paged_jax.config import ModelConfig, cdiv, sliding_pool_blocks
from paged_jax.engine import Engine, SamplingParams
from paged_jax.models import init_params

F, S = "full_attention", "sliding_attention"


@dataclasses.dataclass(frozen=True)
class Config(configs.ExperimentConfig):
  """Flags of experiments.hybrid_kv."""
  contexts: Tuple[int, ...] = configs.flag((8192, 16384, 32768), "tokens per sequence "
                                           "(prompt + generated)", lower=2)
  window: int = configs.flag(1024, "sliding window in tokens (Gemma-3: 1024, Gemma-2: 4096)",
                             lower=1)
  sliding_per_full: int = configs.flag(5, "sliding-window layers per full-attention layer "
                                       "(Gemma-3: 5, Gemma-2: 1)", lower=1)
  block_size: int = configs.flag(16, "tokens per KV block", lower=1, upper=1024)
  base_requests: int = configs.flag(4, "sequences the KV memory holds with hybrid KV off",
                                    lower=1)
  max_num_batched_tokens: int = configs.flag(512, "engine token budget per step", lower=1)
  out: str = configs.flag("results/hybrid_kv", "output directory")

  def check(self) -> None:
    if min(self.contexts) < 8:
      raise ValueError(f"--contexts must all be >= 8, got {min(self.contexts)}")


def gemma_like(window: int, sliding_per_full: int, max_positions: int) -> ModelConfig:
  """A tiny Gemma-3-like model: `sliding_per_full` sliding-window layers (window `window`
  tokens) then one full-attention layer; the layer pattern and window matter, not the
  widths (experiments.hybrid_caching uses it too)."""
  return ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=16,
                     num_layers=sliding_per_full + 1, num_heads=1, num_kv_heads=1,
                     head_dim=8, model_type="gemma3_text", hidden_act="gelu_pytorch_tanh",
                     sliding_window=window, layer_types=(S,) * sliding_per_full + (F,),
                     max_position_embeddings=max_positions)


def model_config(f: Config) -> ModelConfig:
  """`gemma_like` for these flags, positions up to the longest context."""
  return gemma_like(f.window, f.sliding_per_full, max(f.contexts))


def _standin_apply(params, tokens, positions, pages, meta):
  """The forward's stand-in: zero logits for every row, pages untouched."""
  del params, tokens, positions
  return jnp.zeros((meta.logits_indices.shape[0], 64), jnp.float32), pages


def _serve(engine: Engine, num_requests: int, prompt_len: int, gen: int) -> Dict:
  """Runs the requests to the end; the most fully prefilled sequences at once and the
  blocks each held (per pool, mean) at that step."""
  rng = np.random.default_rng(0)
  for _ in range(num_requests):
    engine.add_request([int(t) for t in rng.integers(1, 64, size=prompt_len)],
                       SamplingParams(max_tokens=gen, temperature=0.0))
  best = {"batched": 0, "full_blocks": 0.0, "sliding_blocks": 0.0}
  steps = 0
  while engine.has_unfinished():
    engine.step()
    steps += 1
    st = engine.state
    lens = np.asarray(st.blocks.seq_lens)
    full = lens >= prompt_len
    n = int(full.sum())
    if n > best["batched"]:
      held = lambda b: float((np.asarray(b.block_tables)[full] >= 0).sum(axis=1).mean())
      best = {"batched": n, "full_blocks": held(st.blocks),
              "sliding_blocks": held(st.groups[-1].blocks)}   # the last: windowed if any
  best.update(steps=steps, preemptions=engine.num_preemptions)
  return best


def one_context(f: Config, context: int) -> Dict:
  """Off and on at one context length (see module doc)."""
  mc = model_config(f)
  n_layers, n_sliding = mc.num_layers, len(mc.sliding_layers)
  n_full, bs, budget = n_layers - n_sliding, f.block_size, f.max_num_batched_tokens
  per_seq = cdiv(context, bs)
  memory = n_layers * f.base_requests * per_seq          # layer-blocks, both runs
  seqs = 1
  while (n_full * (seqs + 1) * per_seq + n_sliding * sliding_pool_blocks(
      f.window, bs, seqs + 1, budget)) <= memory:
    seqs += 1
  pool = sliding_pool_blocks(f.window, bs, seqs, budget)
  params = init_params(mc, jax.random.key(0))
  common_kw = dict(block_size=bs, max_blocks_per_seq=per_seq)
  opts = dict(max_num_batched_tokens=budget, model_apply=_standin_apply, shape_buckets=False)
  # Both without prefix caching (as measured: blocks held by sequences alone).
  common_kw.update(enable_prefix_caching=False)
  off_cc = mc.cache_config(hybrid_kv=False, num_blocks=memory // n_layers,
                           max_seqs=f.base_requests + 2, **common_kw)
  on_cc = mc.cache_config(hybrid_kv=True, max_num_batched_tokens=budget,
                          num_blocks=(memory - n_sliding * pool) // n_full, max_seqs=seqs,
                          num_sliding_blocks=pool, **common_kw)
  assert on_cc.kv_cache_bytes <= off_cc.kv_cache_bytes
  gen = min(context // 4, 2 * (seqs + 2) * cdiv(context, budget))
  prompt = context - gen
  off = _serve(Engine(mc, params, off_cc, **opts), f.base_requests + 2, prompt, gen)
  on = _serve(Engine(mc, params, on_cc, **opts), seqs + 2, prompt, gen)
  kept = cdiv(f.window - 1, bs) + 1
  analytic_off, analytic_on = n_layers * per_seq, n_full * per_seq + n_sliding * kept
  layer_blocks = lambda r: n_full * r["full_blocks"] + n_sliding * r["sliding_blocks"]
  return {
      "context": context, "prompt_tokens": prompt, "gen_tokens": gen,
      "kv_bytes_off": off_cc.kv_cache_bytes, "kv_bytes_on": on_cc.kv_cache_bytes,
      "num_sliding_blocks": pool,
      "off": off, "on": on,
      "layer_blocks_per_seq_off": layer_blocks(off), "layer_blocks_per_seq_on": layer_blocks(on),
      "analytic_layer_blocks_per_seq_off": analytic_off,
      "analytic_layer_blocks_per_seq_on": analytic_on,
      "saving": 1 - layer_blocks(on) / layer_blocks(off),
      "analytic_saving": 1 - analytic_on / analytic_off,
      # The same formula at the lengths the sequences had when measured (prompt + some).
      "analytic_saving_at_measured_len": n_sliding * (on["full_blocks"] - kept)
                                         / (n_layers * on["full_blocks"]),
      "batched_ratio": on["batched"] / off["batched"],
      "analytic_batched_ratio": analytic_off / analytic_on,
      "batched_vs_analytic": (on["batched"] / off["batched"]) / (analytic_off / analytic_on),
  }


def run(f: Optional[Config] = None) -> Dict:
  f = f or Config()
  rows = [one_context(f, c) for c in common.progress(f.contexts)]
  return {"rows": rows, "target": "max batched ratio within 10% of the analytic one "
                                  "(batched_vs_analytic >= 0.9)"}


HEADERS = ["context", "blocks/seq off", "blocks/seq on", "saving", "analytic", "batched off",
           "batched on", "ratio", "analytic ratio"]


def summary_rows(result: Dict):
  return [[r["context"], r["layer_blocks_per_seq_off"], r["layer_blocks_per_seq_on"],
           r["saving"], r["analytic_saving"], r["off"]["batched"], r["on"]["batched"],
           r["batched_ratio"], r["analytic_batched_ratio"]] for r in result["rows"]]


def main(f: Config, out):
  """Runs with settings `f` into directory `out` (the `common.run_app` main)."""
  result = common.timed_result(lambda: run(f), f)
  common.report(result, out, "hybrid_kv.json", summary_rows(result), HEADERS,
                ["blocks/seq: layer-blocks (one layer's K/V block) a fully prefilled sequence "
                 "holds"])


if __name__ == "__main__":
  common.run_app(main, Config)
