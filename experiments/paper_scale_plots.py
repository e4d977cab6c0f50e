"""Tables and plots of `experiments.paper_scale`: ours beside the paper's figures.

    rows = paper_scale_plots.summary_rows(results)     # [figure, ours, paper]
    paper_scale_plots.plot_all(results, out)            # one PNG per figure, the paper's axes
"""

from __future__ import annotations

from typing import Dict, List

from experiments import common
from paged_jax.bench import latency
from paged_jax.bench import sweep as serving_sweep

LABELS = serving_sweep.LABELS

# The paper's figures (Kwon et al., SOSP 2023, arXiv:2309.06180; sec. 6-7).
PAPER = {
    ("12", "sharegpt", "orca_oracle"): "1.7-2.7x (OPT-13B / 66B / 175B)",
    ("12", "sharegpt", "orca_max"): "2.7-8x (OPT-13B / 66B / 175B)",
    ("12", "sharegpt", "orca_pow2"): "between the two (Fig. 12a-c)",
    ("12", "alpaca", "orca_oracle"): "a similar trend; less at OPT-175B (Fig. 12f)",
    ("12", "alpaca", "orca_max"): "a similar trend (Fig. 12d-f)",
    ("12", "alpaca", "orca_pow2"): "a similar trend; less at OPT-175B (Fig. 12f)",
    ("13", "orca_oracle"): "2.2x (OPT-13B ShareGPT, Fig. 13a)",
    ("13", "orca_max"): "4.3x (OPT-13B ShareGPT, Fig. 13a)",
    ("14", "basic"): "1.3x (OPT-13B Alpaca, basic sampling)",
    ("14", "n"): "grows with n (Fig. 14 top)",
    ("14", "beam6"): "2.3x (beam width 6)",
    ("14", "beam"): "grows with the beam width (Fig. 14 bottom)",
    ("16", "fewshot-1"): "1.67x (1-shot, 80-token prefix)",
    ("16", "fewshot-5"): "3.58x (5-shot, 341-token prefix)",
    ("18", "sharegpt"): "16-128 best",
    ("18", "alpaca"): "16-32 best; larger blocks degrade",
    ("19", "e2e"): "comparable at block sizes 16-64",
    ("19", "micro"): "swap slow at small blocks; recompute constant, never > 20% above swap",
}


def _ratio(res: Dict, name: str) -> str:
  p, o = latency.max_rate(res, "paged"), latency.max_rate(res, name)
  if not p or not o:
    return "n/a"
  beyond = "" if res["max_rate_at_slo_interpolated"].get("paged") else ">="
  return f"{beyond}{p / o:.2f}x ({p:.3g} vs {o:.3g} req/s)"


def _served_ratio(res: Dict, name: str) -> str:
  """paged / `name` of the most requests a second each served at any rate it ran
  (requests / makespan: a floor of what it sustains, drain included)."""
  p, o = (max(res["systems"][s]["throughput_req_s"]) for s in ("paged", name))
  return f"{p / o:.2f}x ({p:.3g} vs {o:.3g} req/s)"


def _best_range(rows: List[Dict], within: float = 0.10) -> str:
  """Block sizes whose latency is within `within` of the best one's."""
  best = min(r["normalized_latency_s_per_token"] for r in rows)
  good = [r["block_size"] for r in rows
          if r["normalized_latency_s_per_token"] <= (1 + within) * best]
  return f"{min(good)}-{max(good)}" if len(good) > 1 else str(good[0])


def summary_rows(res: Dict) -> List[List[str]]:
  """[figure, ours, paper] rows for whatever figures ran."""
  rows = []
  for panel, r in res.get("fig12", {}).items():
    model, workload = panel.rsplit("-", 1)
    for name in ("orca_oracle", "orca_pow2", "orca_max"):
      if name in r["systems"]:
        rows.append([f"Fig. 12 {model} {workload}-like: max rate, paged / {LABELS[name]}",
                     _ratio(r, name), PAPER[("12", workload, name)]])
  for panel, r in res.get("fig13", {}).items():
    model, workload = panel.rsplit("-", 1)
    for name in ("orca_oracle", "orca_max"):
      if name in r and model == "opt-13b":
        at = (f" at {r[name]['rate']:.3g} req/s" if len({v.get("rate") for v in r.values()})
              == 1 else "")   # one rate for every system (else each its highest point)
        waiting = ("" if "paged_over_while_waiting" not in r[name] else
                   f"; while requests wait {r[name]['paged_over_while_waiting']:.2f}x "
                   f"({r['paged']['mean_running_while_waiting']:.1f} vs "
                   f"{r[name]['mean_running_while_waiting']:.1f})")
        rows.append([f"Fig. 13 {model} {workload}-like{at}: requests batched, paged / "
                     f"{LABELS[name]}", f"all steps {r[name]['paged_over']:.2f}x "
                     f"({r['paged']['mean_running']:.1f} vs {r[name]['mean_running']:.1f})"
                     + waiting,
                     PAPER[("13", name)] if workload == "sharegpt" else
                     "Fig. 13b (no figure in the text)"])
  basic = res.get("fig12", {}).get("opt-13b-alpaca")
  if basic and res.get("fig14"):
    rows.append(["Fig. 14 OPT-13B Alpaca-like, basic sampling: paged / Orca(Oracle)",
                 _ratio(basic, "orca_oracle"), PAPER[("14", "basic")]])
  for mode, r in res.get("fig14", {}).items():
    key = mode if mode == "beam6" else ("beam" if mode.startswith("beam") else "n")
    rows.append([f"Fig. 14 OPT-13B Alpaca-like, {mode}: paged / Orca(Oracle)",
                 _ratio(r, "orca_oracle"), PAPER[("14", key)]])
  for workload, r in res.get("fig16", {}).items():
    rows.append([f"Fig. 16 LLaMA-13B {workload}: paged (prefix cached) / Orca(Oracle)",
                 _ratio(r, "orca_oracle"), PAPER[("16", workload)]])
    rows.append([f"Fig. 16 LLaMA-13B {workload}: most requests served a second, paged "
                 "(prefix cached) / Orca(Oracle)", _served_ratio(r, "orca_oracle"),
                 PAPER[("16", workload)]])
  for workload, pts in res.get("fig18", {}).items():
    rows.append([f"Fig. 18 OPT-13B {workload}-like at {pts[0]['rate']:.3g} req/s: block "
                 f"sizes within 10% of the best latency", _best_range(pts),
                 PAPER[("18", workload)]])
  fig19 = res.get("fig19")
  if fig19:
    e2e = fig19["end_to_end"]
    by = {(p["block_size"], p["preemption_mode"]): p["normalized_latency_s_per_token"]
          for p in e2e}
    ratios = [f"{bs}: {by[(bs, 'swap')] / by[(bs, 'recompute')]:.2f}"
              for bs in sorted({p["block_size"] for p in e2e})]
    rows.append(["Fig. 19b OPT-13B ShareGPT-like: latency swap / recompute by block size",
                 ", ".join(ratios), PAPER[("19", "e2e")]])
    micro = fig19["microbenchmark"]
    rows.append(["Fig. 19a model: recompute / swap seconds of 1,024 tokens, block "
                 f"{micro[0]['block_size']} / {micro[-1]['block_size']}",
                 f"{micro[0]['recompute_over_swap']:.2f} / "
                 f"{micro[-1]['recompute_over_swap']:.2f}", PAPER[("19", "micro")]])
  return rows


def _curves(ax, res: Dict, title: str):
  for name, c in res["systems"].items():
    ax.plot(c["rates"], c["normalized_latency_s_per_token"], marker="o", ms=3,
            label=LABELS.get(name, name))
  ax.axhline(res["slo_s_per_token"], color="k", ls="--", lw=0.7)
  ax.set_title(title, fontsize=8)
  ax.set_xlabel("request rate (req/s)", fontsize=7)
  ax.set_ylim(0, 4 * res["slo_s_per_token"])


def _grid(results: Dict, path, ncols: int, title_fn):
  plt = common.pyplot()
  items = list(results.items())
  nrows = -(-len(items) // ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(3.3 * ncols, 2.8 * nrows), squeeze=False)
  for ax, (key, res) in zip(axes.flat, items):
    _curves(ax, res, title_fn(key))
  for ax in axes.flat[len(items):]:
    ax.set_visible(False)
  for ax in axes[:, 0]:
    ax.set_ylabel("normalized latency (s/token)", fontsize=7)
  axes.flat[0].legend(fontsize=6, frameon=False)
  fig.tight_layout()
  return common.save_png(fig, path)


def _xy(path, series: Dict, xlabel: str, ylabel: str, logx: bool = True):
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(4.2, 3.0))
  for label, (x, y) in series.items():
    ax.plot(x, y, marker="o", ms=3, label=label)
  if logx:
    ax.set_xscale("log", base=2)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=7, frameon=False)
  fig.tight_layout()
  return common.save_png(fig, path)


def plot_all(res: Dict, out) -> List:
  """Fig. 12 / 14 / 16 latency-vs-rate grids, Fig. 13 batch bars, Fig. 18 / 19 lines."""
  pngs = []
  if res.get("fig12"):
    by_workload = sorted(res["fig12"].items(), key=lambda kv: kv[0].endswith("alpaca"))
    pngs.append(_grid(dict(by_workload), out / "fig12.png", 3,
                      lambda k: k.replace("-sharegpt", " ShareGPT").replace("-alpaca",
                                                                            " Alpaca")))
  if res.get("fig14"):
    pngs.append(_grid(res["fig14"], out / "fig14.png", 3, lambda k: f"OPT-13B Alpaca {k}"))
  if res.get("fig16"):
    pngs.append(_grid(res["fig16"], out / "fig16.png", 2, lambda k: f"LLaMA-13B {k}"))
  if res.get("fig13"):
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 3.0))
    panels = list(res["fig13"])
    for k, name in enumerate(serving_sweep.SYSTEMS):
      got = [res["fig13"][p].get(name, {}) for p in panels]
      bars = ax.bar([i + 0.2 * k for i in range(len(panels))],
                    [v.get("mean_running", 0) for v in got], 0.2, label=LABELS[name])
      # The mean over the steps while requests wait, as an outline above (or below) it.
      ax.bar([i + 0.2 * k for i in range(len(panels))],
             [v.get("mean_running_while_waiting", 0) for v in got], 0.2, fill=False,
             edgecolor=bars.patches[0].get_facecolor(), hatch="//", lw=0.6)
    ax.set_xticks([i + 0.3 for i in range(len(panels))], panels, fontsize=6, rotation=20)
    ax.set_ylabel("mean batched requests (hatched: while requests wait)", fontsize=7)
    ax.legend(fontsize=6, frameon=False)
    fig.tight_layout()
    pngs.append(common.save_png(fig, out / "fig13.png"))
  if res.get("fig18"):
    pngs.append(_xy(out / "fig18.png", {
        w: ([p["block_size"] for p in pts], [p["normalized_latency_s_per_token"] for p in pts])
        for w, pts in res["fig18"].items()}, "block size", "normalized latency (s/token)"))
  if res.get("fig19"):
    e2e = res["fig19"]["end_to_end"]
    pngs.append(_xy(out / "fig19b.png", {
        m: ([p["block_size"] for p in e2e if p["preemption_mode"] == m],
            [p["normalized_latency_s_per_token"] for p in e2e if p["preemption_mode"] == m])
        for m in ("recompute", "swap")}, "block size", "normalized latency (s/token)"))
    micro = res["fig19"]["microbenchmark"]
    bs = [p["block_size"] for p in micro]
    pngs.append(_xy(out / "fig19a.png", {
        "swap out (model)": (bs, [1e3 * p["swap_s"] for p in micro]),
        "recompute (model)": (bs, [1e3 * p["recompute_s"] for p in micro])},
                    "block size", "ms for 1,024 tokens"))
  return pngs


def sweep_png(rows: List[Dict], x: str, xlabel: str, logx: bool = True) -> bytes:
  """Normalized latency and mean batched requests of fixed-rate points against `x` (a
  row key: "block_size", "kv_fraction"), as PNG bytes (`IPython.display.Image`)."""
  import io  # pylint: disable=g-import-not-at-top
  plt = common.pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(7.5, 2.8))
  xs = [r[x] for r in rows]
  a.plot(xs, [r["normalized_latency_s_per_token"] for r in rows], marker="o", ms=3)
  b.plot(xs, [r["mean_running"] for r in rows], marker="o", ms=3)
  for ax, ylabel in ((a, "normalized latency (s/token)"), (b, "mean batched requests")):
    if logx:
      ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, dpi=100, bbox_inches="tight", format="png")
  plt.close(fig)
  return buf.getvalue()
