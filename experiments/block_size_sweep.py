r"""Block-size sweep: what the KV block size trades off (paper Sec. 7.2, Fig. 18).

    python -m experiments.block_size_sweep --workloads=sharegpt,alpaca \
        --block_sizes=1,2,4,8,16,32,64,128,256 --num_requests=sharegpt:200,alpaca:1000 \
        --engine_block_sizes=4,16,64,256 --out=results/block_size_sweep

One row per (workload, block size) in `DIR/block_size_sweep.jsonl`:

  memory (the real block manager, `baselines.simulate.simulate_paged`, the
  unscaled stream: Table 1 mean lengths, clipped to --max_len, all queued at 0,
  KV budget --kv_budget_tokens slots):
    token_utilization, internal_fragmentation, reservation  fractions of the budget
    max_concurrent, mean_concurrent                         requests in memory
    preemptions                                             recompute preemptions
  block table:
    mean_blocks_per_seq   mean cdiv(prompt + output, block_size) over the stream
    block_table_width     cdiv(max_len, block_size) entries per row
  attention_ms            one decode attention call (paged_jax.attention, backend
                          auto: the reference gather on CPU, the Pallas kernel on
                          GPU) for --attn_batch sequences of --attn_context tokens,
                          fastest of --attn_repeats, pages in random order
  engine (only for --engine_block_sizes; the tiny model, `serving` scaled stream,
  KV budget --engine_kv_budget_tokens):
    engine_tokens_per_s, engine_requests_per_s, engine_tokens_per_step

  prefix_hit_rate         fraction of prompt tokens served by `paged_jax.prefix_cache`
                          when the first --prefix_num_requests prompts of the stream
                          share a --prefix_len-token system prompt (whole blocks only;
                          --prefix_block_sizes, default all)

The best block size per workload is the one with the highest engine tokens/s
(the paper picks by serving throughput); block sizes within 5% of it form the
"good range", beside the paper's 16-128 (ShareGPT) and 16-32 (Alpaca).
Also `DIR/block_size_sweep.png` (multi-panel) and `DIR/block_size_sweep_best.json`.
"""

from __future__ import annotations

import functools
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from experiments import common
from paged_jax.bench import engines
from paged_jax.bench import serving
from paged_jax.bench import workloads
from paged_jax.config import cdiv, check_block_size

PAPER_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Memory-simulation stream lengths: Alpaca-like requests are ~6x shorter, so it
# takes more of them to keep the queue waiting (the averaged, saturated steps).
DEFAULT_NUM_REQUESTS = {"sharegpt": 200, "alpaca": 1000}


def block_table_stats(requests: Sequence, block_size: int, max_len: int) -> Dict:
  """Mean blocks a sequence ends with, and the width of a block-table row."""
  totals = np.array([r.total_len for r in requests])
  return {"mean_blocks_per_seq": float(np.mean(cdiv(totals, block_size))),
          "block_table_width": cdiv(max_len, block_size)}


def memory_stats(requests: Sequence, block_size: int, kv_budget_tokens: int,
                 max_len: int) -> Dict:
  """Paged memory partition and concurrency at a fixed KV budget (the real block manager)."""
  from paged_jax.bench.baselines import simulate  # pylint: disable=g-import-not-at-top
  res = simulate.simulate_paged(requests, block_size, kv_budget_tokens, max_len)
  return {k: res[k] for k in ("token_utilization", "reservation", "internal_fragmentation",
                              "max_concurrent", "mean_concurrent", "preemptions")}


def attention_ms(block_sizes: Sequence[int], *, batch: int = 8, context: int = 512,
                 num_q_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64,
                 repeats: int = 7, seed: int = 0, backend: str = "auto") -> Dict[int, float]:
  """{block_size: fastest ms of one jitted decode paged-attention call}.

  Every sequence holds `context` tokens in `context / block_size` pages placed in
  a random permutation of the pool (fresh random K/V, the same values for every
  block size; their outputs must agree, else RuntimeError). All block sizes compile first; then the timed calls go round-robin
  over the block sizes, so load on a shared machine hits them alike.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax import attention  # pylint: disable=g-import-not-at-top
  for bs in block_sizes:
    if context % bs:
      raise ValueError(f"attn context {context} must be a multiple of block_size={bs}")
  rng = np.random.default_rng(seed)
  k_dense = rng.standard_normal((num_kv_heads, batch * context, head_dim), np.float32)
  v_dense = rng.standard_normal((num_kv_heads, batch * context, head_dim), np.float32)
  q = jax.numpy.asarray(rng.standard_normal((batch, num_q_heads, head_dim), np.float32))
  lengths = jax.numpy.full((batch,), context, jax.numpy.int32)
  fn = jax.jit(functools.partial(attention.paged_attention, backend=backend))
  calls, first = {}, None
  for bs in block_sizes:
    num_blocks = batch * context // bs
    perm = rng.permutation(num_blocks)
    k = k_dense.reshape(num_kv_heads, num_blocks, bs, head_dim)
    v = v_dense.reshape(num_kv_heads, num_blocks, bs, head_dim)
    # Logical block j of the pool sits at physical perm[j]: scatter the pages there.
    k_pages = np.empty_like(k)
    v_pages = np.empty_like(v)
    k_pages[:, perm] = k
    v_pages[:, perm] = v
    tables = perm.reshape(batch, context // bs).astype(np.int32)
    args = (q, jax.numpy.asarray(k_pages), jax.numpy.asarray(v_pages),
            jax.numpy.asarray(tables), lengths)
    out = np.asarray(fn(*args))
    if first is None:
      first = out
    elif not np.allclose(out, first, rtol=1e-4, atol=1e-4):   # the same logical cache
      raise RuntimeError(f"paged attention at block_size={bs} disagrees with "
                         f"block_size={block_sizes[0]}: max diff {np.abs(out - first).max()}")
    calls[bs] = args
  times = {bs: [] for bs in block_sizes}
  for _ in range(repeats):
    for bs in block_sizes:
      t0 = time.perf_counter()
      fn(*calls[bs]).block_until_ready()
      times[bs].append(time.perf_counter() - t0)
  # The machine is shared: the fastest call is the stable statistic.
  return {bs: 1e3 * float(np.min(t)) for bs, t in times.items()}


@functools.lru_cache(maxsize=16)
def _prefix_step(block_size: int):
  """Jitted: attach a prompt (cached prefix), append the rest, register its full blocks, free."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax import prefix_cache as pc  # pylint: disable=g-import-not-at-top

  def step(cache, blocks, tokens, length):
    cache, blocks, hit, st_attach = pc.attach(cache, blocks, 0, tokens, length)
    mask = jnp.zeros((blocks.max_seqs,), bool).at[0].set(True)
    blocks, st_append, _ = bm.append(blocks, mask, jnp.zeros((blocks.max_seqs,), jnp.int32)
                                     .at[0].set(length - hit))
    p = blocks.max_blocks_per_seq
    first = hit // block_size
    item_block = first + jnp.arange(p, dtype=jnp.int32)
    per_block = tokens[:p * block_size].reshape(p, block_size)
    item_tokens = per_block[jnp.clip(item_block, 0, p - 1)]
    cache, blocks = pc.register(cache, blocks, jnp.zeros((p,), jnp.int32), item_block,
                                item_tokens, length // block_size - first)
    cache, blocks, st_free = pc.free(cache, blocks, 0)
    return cache, blocks, hit, jnp.stack([st_attach, st_append[0], jnp.asarray(st_free).reshape(
        -1)[0]])

  return jax.jit(step, donate_argnums=(0, 1))


def prefix_hit_rate(requests: Sequence, block_size: int, *, prefix_len: int = 80,
                    max_len: int = 1024, seed: int = 0) -> float:
  """Fraction of prompt tokens served from `paged_jax.prefix_cache` (a shared system prompt).

  Every request's prompt becomes one shared `prefix_len`-token system prompt
  (the paper's 1-shot prefix is 80 tokens) followed by its own stream prompt;
  the requests run one after another through the real prefix cache (attach,
  append, register full blocks, free), with a pool big enough that nothing is
  evicted. Only whole blocks can hit, and never the prompt's last token.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from paged_jax import block_manager as bm  # pylint: disable=g-import-not-at-top
  from paged_jax import prefix_cache as pc  # pylint: disable=g-import-not-at-top
  from paged_jax.config import CacheConfig  # pylint: disable=g-import-not-at-top
  prefix = np.random.default_rng([seed, 11]).integers(0, 1 << 15, prefix_len, dtype=np.int32)
  prompts = [np.concatenate([prefix, r.prompt_token_ids]).astype(np.int32) for r in requests]
  if max(len(p) for p in prompts) > max_len + prefix_len:
    raise ValueError(f"prompts must be <= max_len={max_len} tokens")
  # Shapes depend only on (block size, max_len, prefix_len, #requests): one compile
  # per block size serves every stream.
  per_seq = cdiv(max_len + prefix_len, block_size)
  num_blocks = (len(prompts) + 1) * per_seq
  cfg = CacheConfig(block_size=block_size, num_blocks=num_blocks, max_seqs=1,
                    max_blocks_per_seq=per_seq)
  blocks, cache = bm.init(cfg), pc.init(cfg)
  step = _prefix_step(block_size)
  hits, statuses = [], []
  for prompt in prompts:
    tokens = np.zeros((per_seq * block_size,), np.int32)
    tokens[:len(prompt)] = prompt
    cache, blocks, hit, status = step(cache, blocks, tokens, np.int32(len(prompt)))
    hits.append(hit)
    statuses.append(status)
  if np.any(np.asarray(jax.device_get(statuses))):
    raise RuntimeError("prefix-cache attach/append/free failed in the hit-rate run")
  return float(np.sum(jax.device_get(hits)) / sum(len(p) for p in prompts))


def engine_stats(requests: Sequence, block_size: int, kv_budget_tokens: int,
                 attention_backend: str = "auto") -> Dict:
  """Tiny-model engine throughput at this block size on a scaled stream."""
  engine = engines.make_engine(block_size=block_size, kv_budget_tokens=kv_budget_tokens,
                               attention_backend=attention_backend)
  res = serving.serve(engine, requests)
  return {"engine_tokens_per_s": res["tokens_per_s"],
          "engine_requests_per_s": res["requests_per_s"],
          "engine_tokens_per_step": res["tokens_per_step"],
          "engine_mean_running_seqs": res["mean_running_seqs"]}


def run(workload_names: Sequence[str] = ("sharegpt", "alpaca"), *,
        block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
        num_requests: Optional[Dict[str, int]] = None,
        kv_budget_tokens: int = 8192, max_len: int = 1024,
        engine_block_sizes: Sequence[int] = (4, 16, 64, 256), engine_num_requests: int = 32,
        engine_kv_budget_tokens: int = 2048, attn_batch: int = 8, attn_context: int = 512,
        attn_repeats: int = 7, prefix_block_sizes: Optional[Sequence[int]] = None,
        prefix_num_requests: int = 32, prefix_len: int = 80, seed: int = 0,
        attention_backend: str = "auto",
        show_progress: Optional[bool] = None) -> List[Dict]:
  """The sweep's rows (one dict per (workload, block size)); see the module docstring.

  `num_requests` maps workload -> stream length (default `DEFAULT_NUM_REQUESTS`:
  enough Alpaca-like requests to saturate the budget too).
  """
  num_requests = {**DEFAULT_NUM_REQUESTS, **(num_requests or {})}
  prefix_block_sizes = block_sizes if prefix_block_sizes is None else prefix_block_sizes
  for bs in list(block_sizes) + list(engine_block_sizes):
    check_block_size(bs)
    if kv_budget_tokens % bs or engine_kv_budget_tokens % bs:
      raise ValueError(f"block size {bs} must divide kv_budget_tokens={kv_budget_tokens} and "
                       f"engine_kv_budget_tokens={engine_kv_budget_tokens}")
  extra = sorted(set(engine_block_sizes) - set(block_sizes))
  if extra:
    raise ValueError(f"engine_block_sizes {extra} are not in block_sizes {list(block_sizes)}")
  attn_sizes = [bs for bs in block_sizes if attn_context % bs == 0]
  attn = attention_ms(attn_sizes, batch=attn_batch, context=attn_context, repeats=attn_repeats,
                      seed=seed, backend=attention_backend)
  rows = []
  bar = common.progress(total=len(workload_names) * len(block_sizes), desc="block sizes",
                        disable=None if show_progress is None else not show_progress)
  with bar:
    for name in workload_names:
      requests = workloads.synthetic(name, num_requests[name], seed=seed, max_len=max_len)
      engine_requests = workloads.scaled_requests(name, engine_num_requests, seed=seed)
      prefix_requests = requests[:prefix_num_requests]
      for bs in block_sizes:
        row = {"workload": name, "block_size": bs}
        row.update(memory_stats(requests, bs, kv_budget_tokens, max_len))
        row.update(block_table_stats(requests, bs, max_len))
        row["attention_ms"] = attn.get(bs)   # the same call for every stream
        if bs in prefix_block_sizes:
          row["prefix_hit_rate"] = prefix_hit_rate(prefix_requests, bs, prefix_len=prefix_len,
                                                   max_len=max_len, seed=seed)
        if bs in engine_block_sizes:
          row.update(engine_stats(engine_requests, bs, engine_kv_budget_tokens,
                                  attention_backend))
        rows.append(row)
        bar.update(1)
  return rows


def best_block_sizes(rows: Sequence[Dict], tolerance: float = 0.05) -> Dict:
  """{workload: {"best", "good_range", "by", "paper"}}: highest engine tokens/s (within tolerance).

  Falls back to token utilization x (1 / attention time) when no engine column was measured.
  """
  out = {}
  for name in dict.fromkeys(r["workload"] for r in rows):
    sel = [r for r in rows if r["workload"] == name]
    measured = [r for r in sel if r.get("engine_tokens_per_s") is not None]
    if measured:
      key, by = (lambda r: r["engine_tokens_per_s"]), "engine tokens/s"
    else:
      measured = [r for r in sel if r.get("attention_ms")]
      key, by = (lambda r: r["token_utilization"] / r["attention_ms"]), "utilization / attn ms"
    best = max(measured, key=key)
    good = sorted(r["block_size"] for r in measured if key(r) >= (1 - tolerance) * key(best))
    out[name] = {"best": best["block_size"], "good_range": [good[0], good[-1]], "by": by,
                 "measured_block_sizes": [r["block_size"] for r in measured],
                 "paper": list(PAPER_BEST.get(name, ()))}
  return out


HEADERS = ["workload", "block", "token util", "int frag", "max conc", "mean conc", "blocks/seq",
           "prefix hit", "attn ms", "engine tok/s"]


def summary_rows(rows):
  fmt = lambda x, f: "" if x is None else f.format(x)
  return [[r["workload"], r["block_size"], f"{100 * r['token_utilization']:.1f}%",
           f"{100 * r['internal_fragmentation']:.1f}%", r["max_concurrent"],
           f"{r['mean_concurrent']:.1f}", f"{r['mean_blocks_per_seq']:.1f}",
           fmt(None if r.get("prefix_hit_rate") is None else 100 * r["prefix_hit_rate"],
               "{:.1f}%"),
           fmt(r["attention_ms"], "{:.2f}"), fmt(r.get("engine_tokens_per_s"), "{:.0f}")]
          for r in rows]


PANELS = (("token_utilization", "KV memory holding tokens (%)", 100),
          ("internal_fragmentation", "internal fragmentation (%)", 100),
          ("mean_concurrent", "mean concurrent requests", 1),
          ("mean_blocks_per_seq", "blocks per sequence (table length)", 1),
          ("prefix_hit_rate", "prefix-cache hit rate (%)", 100),
          ("attention_ms", "decode attention (ms)", 1),
          ("engine_tokens_per_s", "engine tokens / s (tiny model)", 1))


def figure(rows, best: Optional[Dict] = None):
  """A matplotlib figure: one panel per measured column against block size (log2 x)."""
  plt = common.pyplot()
  panels = [p for p in PANELS if any(r.get(p[0]) is not None for r in rows)]
  ncols = 3
  nrows = cdiv(len(panels), ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(13, 3.5 * nrows), squeeze=False)
  colors = {"sharegpt": "#3d5a80", "alpaca": "#e07a5f"}
  for ax, (key, label, mult) in zip(axes.flat, panels):
    for name in dict.fromkeys(r["workload"] for r in rows):
      sel = [r for r in rows if r["workload"] == name and r.get(key) is not None]
      ax.plot([r["block_size"] for r in sel], [mult * r[key] for r in sel], "o-",
              color=colors.get(name), label=f"{name}-like")
      if best and key == "engine_tokens_per_s" and name in best:
        lo, hi = best[name]["paper"]
        ax.axvspan(lo, hi, color=colors.get(name), alpha=0.1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel(label, fontsize=9)
    if key in ("mean_blocks_per_seq", "attention_ms"):
      ax.set_yscale("log")
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=8, frameon=False)
  fig.suptitle("Block-size sweep" + (" (shaded in the engine panel: the paper's best range)"
                                     if best else ""), fontsize=10)
  fig.tight_layout()
  return fig


def plot(rows, path, best: Optional[Dict] = None):
  """Saves `figure(rows, best)` as a PNG; returns the path."""
  return common.save_png(figure(rows, best), path)


def png_bytes(rows, best: Optional[Dict] = None) -> bytes:
  """`figure(rows, best)` as PNG bytes (for `IPython.display.Image` in notebooks)."""
  import io  # pylint: disable=g-import-not-at-top
  fig = figure(rows, best)
  buf = io.BytesIO()
  fig.savefig(buf, dpi=100, bbox_inches="tight", format="png")
  common.pyplot().close(fig)
  return buf.getvalue()


def write_jsonl(rows, path):
  import json  # pylint: disable=g-import-not-at-top
  path = common.out_dir(str(path.parent)) / path.name
  path.write_text("".join(json.dumps(common.json_ready(r)) + "\n" for r in rows))
  return path


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_list("workloads", ["sharegpt", "alpaca"], "streams")
  flags.DEFINE_list("block_sizes", [str(b) for b in DEFAULT_BLOCK_SIZES], "powers of two")
  flags.DEFINE_list("num_requests", [f"{k}:{v}" for k, v in DEFAULT_NUM_REQUESTS.items()],
                    "workload:requests of the memory simulation streams")
  flags.DEFINE_integer("kv_budget_tokens", 8192, "memory simulation KV budget (slots)",
                       lower_bound=1)
  flags.DEFINE_integer("max_len", 1024, "context limit of the memory stream", lower_bound=2)
  flags.DEFINE_list("engine_block_sizes", ["4", "16", "64", "256"],
                    "block sizes also served by the engine (each compiles once)")
  flags.DEFINE_integer("engine_num_requests", 32, "requests served by the engine", lower_bound=1)
  flags.DEFINE_integer("engine_kv_budget_tokens", 2048, "engine KV pool (slots)", lower_bound=1)
  flags.DEFINE_integer("attn_batch", 8, "sequences in the attention timing", lower_bound=1)
  flags.DEFINE_integer("attn_context", 512, "tokens per sequence in the attention timing",
                       lower_bound=1)
  flags.DEFINE_integer("attn_repeats", 7, "timed attention calls (fastest kept)", lower_bound=1)
  flags.DEFINE_list("prefix_block_sizes", None, "block sizes of the prefix-cache hit rate "
                    "(default: all of --block_sizes; empty string: none)")
  flags.DEFINE_integer("prefix_num_requests", 32, "prompts in the prefix-cache run",
                       lower_bound=1)
  flags.DEFINE_integer("prefix_len", 80, "shared system-prompt tokens (paper 1-shot: 80)",
                       lower_bound=1)
  flags.DEFINE_integer("seed", 0, "stream seed")
  flags.DEFINE_string("attention_backend", "auto", "auto|reference|pallas|pallas_interpret")
  flags.DEFINE_string("out", "results/block_size_sweep", "output directory")


def main(f, out):
  """Runs with parsed flags `f` and writes under the output directory `out`."""
  start = time.time()
  rows = run(f.workloads, block_sizes=[int(b) for b in f.block_sizes],
             num_requests={k: int(v) for k, v in (x.split(":") for x in f.num_requests)},
             kv_budget_tokens=f.kv_budget_tokens, max_len=f.max_len,
             engine_block_sizes=[int(b) for b in f.engine_block_sizes],
             engine_num_requests=f.engine_num_requests,
             engine_kv_budget_tokens=f.engine_kv_budget_tokens, attn_batch=f.attn_batch,
             attn_context=f.attn_context, attn_repeats=f.attn_repeats,
             prefix_block_sizes=(None if f.prefix_block_sizes is None
                                 else [int(b) for b in f.prefix_block_sizes if b]),
             prefix_num_requests=f.prefix_num_requests, prefix_len=f.prefix_len, seed=f.seed,
             attention_backend=f.attention_backend)
  best = best_block_sizes(rows)
  write_jsonl(rows, out / "block_size_sweep.jsonl")
  common.write_json(out / "block_size_sweep_best.json", {
      "best": best, "seconds": time.time() - start,
      **common.run_metadata(f, ("workloads", "block_sizes", "num_requests",
                                        "kv_budget_tokens", "max_len", "engine_block_sizes",
                                        "engine_num_requests", "engine_kv_budget_tokens",
                                        "attn_batch", "attn_context", "prefix_block_sizes",
                                        "prefix_num_requests", "prefix_len", "seed"))})
  png = plot(rows, out / "block_size_sweep.png", best)
  print(common.table(summary_rows(rows), HEADERS))
  for name, b in best.items():
    print(f"{name}-like: best block size {b['best']} (within 5%: {b['good_range'][0]}-"
          f"{b['good_range'][1]}, by {b['by']}); paper {b['paper'][0]}-{b['paper'][1]}")
  print(f"wrote {out / 'block_size_sweep.jsonl'}, {png}")


if __name__ == "__main__":
  common.run_app(main, _define_flags)
