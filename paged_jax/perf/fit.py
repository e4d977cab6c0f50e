"""Fits the device-time model's efficiencies and latencies to measured step times.

The model's time is piecewise linear in theta (roofline.PARAMS: 1 / efficiency, seconds of
the latencies), so a Gauss-Newton step is exact inside one regime: with the active side of
every max fixed, time = G(theta) @ theta. Each iteration solves the linear problem for the
relative error (non-negative least squares, with a weak prior), keeps it when
the error falls, and re-reads the regimes; a few starting points guard against a poor local
minimum. A parameter that the steps cannot tell apart from those already chosen (no step
exercises it, or it moves together with another: the per-pass overhead and the all-reduce
latency at one tp, the PCIe efficiency and the per-copy latency at one block size) is held
at its prior and reported as held.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from paged_jax.perf.specs import Efficiency
from paged_jax.perf.roofline import PARAMS, DeviceTimeModel, StepWork, efficiency_of
from paged_jax.perf.step import StepShape

# Which of two inseparable parameters is fitted: the earlier here.
# row_host_s before elementwise_bandwidth: where every row samples, the sampler's logits and
# the host's per-row work grow alike, and the host's is the larger (a CPU's 256-logit rows
# take microseconds; its Python per row ~0.1 ms: docs/paper_scale.md).
PRIORITY = ("pass_overhead_s", "linear_flops", "weight_bandwidth", "kv_bandwidth",
            "attention_flops", "row_host_s", "elementwise_bandwidth", "pcie", "nvlink",
            "swap_copy_latency_s", "allreduce_latency_s")
_THETA_MIN = 1e-6   # efficiencies stay finite (<= 1e6 of the nominal peak)


@dataclasses.dataclass(frozen=True)
class FitResult:
  """A fitted model and how well it predicts the steps it was fitted to.

  Attributes:
    model: the DeviceTimeModel with the fitted efficiency.
    fitted: parameters the fit moved; held: parameters kept at the prior.
    num_steps: steps fitted.
    mean_abs_rel_error, max_abs_rel_error, rms_rel_error: |predicted / measured - 1| stats.
    rel_std_errors: per fitted parameter, its standard error over its value (from the
      residuals and the Jacobian; large: the steps barely tell it apart).
    iterations: Gauss-Newton iterations of the best start.
  """

  model: DeviceTimeModel
  fitted: Tuple[str, ...]
  held: Tuple[str, ...]
  num_steps: int
  mean_abs_rel_error: float
  max_abs_rel_error: float
  rms_rel_error: float
  rel_std_errors: Dict[str, float]
  iterations: int

  def as_dict(self) -> dict:
    return {
        "efficiency": self.model.efficiency.as_dict(),
        "fitted": list(self.fitted), "held": list(self.held), "num_steps": self.num_steps,
        "mean_abs_rel_error": self.mean_abs_rel_error,
        "max_abs_rel_error": self.max_abs_rel_error, "rms_rel_error": self.rms_rel_error,
        "rel_std_errors": dict(self.rel_std_errors), "iterations": self.iterations,
    }


def predict(model: DeviceTimeModel, steps: Sequence[StepShape]) -> np.ndarray:
  """f64[steps]: the model's seconds for each step."""
  theta = model.theta
  return np.array([model.work(s).seconds(theta) for s in steps])


def relative_errors(model: DeviceTimeModel, steps: Sequence[StepShape],
                    measured_s: Sequence[float]) -> dict:
  """Mean / max / RMS of |predicted / measured - 1| over the steps."""
  measured = _check_measured(steps, measured_s)
  r = predict(model, steps) / measured - 1.0
  return {"mean_abs_rel_error": float(np.mean(np.abs(r))),
          "max_abs_rel_error": float(np.max(np.abs(r))),
          "rms_rel_error": float(np.sqrt(np.mean(r * r)))}


def _check_measured(steps, measured_s) -> np.ndarray:
  measured = np.asarray(measured_s, dtype=np.float64).reshape(-1)
  if len(steps) != measured.size or not measured.size:
    raise ValueError(f"measured_s must hold one time per step (>= 1), got {measured.size} "
                     f"for {len(steps)} steps")
  if not (np.all(np.isfinite(measured)) and np.all(measured > 0)):
    raise ValueError("measured_s must be finite seconds > 0")
  return measured


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
  n = a.shape[1]
  x, passive = np.zeros(n), np.zeros(n, dtype=bool)
  tol = 10 * np.finfo(float).eps * np.abs(a).sum(axis=0).max(initial=1.0) * max(a.shape)
  grad = a.T @ (b - a @ x)
  for _ in range(3 * n + 3):
    if passive.all() or np.all(grad[~passive] <= tol):
      break
    passive[np.argmax(np.where(passive, -np.inf, grad))] = True
    while True:
      z = np.zeros(n)
      z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
      if np.all(z[passive] > tol):
        break
      neg = passive & (z <= tol)
      alpha = np.min(x[neg] / (x[neg] - z[neg]))
      x = x + alpha * (z - x)
      passive &= x > tol
    x = z
    grad = a.T @ (b - a @ x)
  return x


def _independent(cols: np.ndarray, order: Sequence[int], tol: float = 1e-6) -> list:
  """Indices (from `order`, in that order) of columns not in the span of those before."""
  chosen, basis = [], np.zeros((cols.shape[0], 0))
  for j in order:
    c = cols[:, j]
    norm = np.linalg.norm(c)
    if norm == 0:
      continue
    c = c / norm
    resid = c - basis @ (basis.T @ c) if basis.shape[1] else c
    if np.linalg.norm(resid) > tol:
      chosen.append(j)
      basis = np.column_stack([basis, resid / np.linalg.norm(resid)])
  return chosen


def _solve(works, measured, theta, prior, free, prior_weight, root_w):
  """One Gauss-Newton step from theta: (new theta, indices fitted)."""
  g = np.stack([w.gradient(theta) for w in works]) / measured[:, None]   # relative rows
  order = [PARAMS.index(n) for n in PRIORITY if PARAMS.index(n) in free]
  chosen = _independent(g, order)
  held = [j for j in range(len(PARAMS)) if j not in chosen]
  g = g * root_w[:, None]
  b = root_w - g[:, held] @ prior[held]   # held parameters sit at the prior
  a = g[:, chosen]
  weights = [j for j in chosen if prior[j] > 0]
  if prior_weight > 0 and weights:   # prior: prior_weight * ((theta - prior) / prior)^2
    rows = np.zeros((len(weights), len(chosen)))
    for r, j in enumerate(weights):
      rows[r, chosen.index(j)] = np.sqrt(prior_weight) / prior[j]
    a = np.vstack([a, rows])
    b = np.concatenate([b, np.full(len(weights), np.sqrt(prior_weight))])
  new = prior.copy()
  if chosen:
    new[chosen] = _nnls(a, b)
  return new, chosen


def _loss(works, measured, theta, prior, prior_weight, root_w) -> float:
  """Weighted sum of squared relative errors plus the prior's term."""
  pred = np.array([w.seconds(theta) for w in works])
  pos = prior > 0
  pull = prior_weight * np.sum(((theta[pos] - prior[pos]) / prior[pos]) ** 2)
  return float(np.sum((root_w * (pred / measured - 1.0)) ** 2) + pull)


def _descend(works, measured, theta, prior, free, prior_weight, max_iter, root_w):
  k = len(Efficiency.FRACTIONS)   # fractions come first in PARAMS
  loss, chosen, it = _loss(works, measured, theta, prior, prior_weight, root_w), [], 0
  for it in range(1, max_iter + 1):
    target, chosen = _solve(works, measured, theta, prior, free, prior_weight, root_w)
    target[:k] = np.maximum(target[:k], _THETA_MIN)
    step, improved = 1.0, False
    for _ in range(12):   # damped: the regimes may change along the step
      cand = theta + step * (target - theta)
      cand_loss = _loss(works, measured, cand, prior, prior_weight, root_w)
      if cand_loss < loss * (1 - 1e-12):
        theta, loss, improved = cand, cand_loss, True
        break
      step /= 2
    if not improved:
      break
  return theta, loss, chosen, it


def _rel_std_errors(works, measured, theta, chosen) -> Dict[str, float]:
  """Standard error / value of each fitted parameter (linearised at the optimum)."""
  if not chosen:
    return {}
  g = np.stack([w.gradient(theta) for w in works]) / measured[:, None]
  resid = g @ theta - 1.0
  dof = max(len(works) - len(chosen), 1)
  a = g[:, chosen]
  cov = np.sum(resid ** 2) / dof * np.linalg.pinv(a.T @ a)
  se = np.sqrt(np.maximum(np.diag(cov), 0.0))
  return {PARAMS[j]: float(e / theta[j]) for j, e in zip(chosen, se)}


def fit_efficiency(model: DeviceTimeModel, steps: Sequence[StepShape],
                   measured_s: Sequence[float], *, params: Optional[Sequence[str]] = None,
                   prior_weight: float = 1e-4, max_iter: int = 60,
                   source: Optional[str] = None,
                   weights: Optional[Sequence[float]] = None) -> FitResult:
  """Fits `model`'s efficiencies to measured step seconds (least squares on relative error).

  Args:
    model: the deployment (model, GPU, tp); its efficiency is the prior and starting point.
    steps: what each measured step computed.
    measured_s: the measured seconds of each step (> 0).
    params: names from roofline.PARAMS to fit (None: all the steps can identify).
    prior_weight: weight of the prior, added to the sum of squared relative errors as
      prior_weight * ((theta - prior) / prior)^2 per parameter: 1e-4 lets a parameter move
      by 100% for as little as a 1% error on one step, so steps that barely exercise a
      part leave it near the prior; 0 fits the data alone.
    max_iter: Gauss-Newton iterations per start.
    source: text recorded as the fitted efficiency's source.
    weights: per step, the weight of its squared relative error (None: 1 each), e.g.
      how many measured steps a grouped step stands for, or its seconds (an error of
      x% on a long step costs a run more than on a short one). Finite, >= 0, one > 0.
  """
  measured = _check_measured(steps, measured_s)
  if weights is None:
    root_w = np.ones(measured.size)
  else:
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != measured.size or not (np.all(np.isfinite(w)) and np.all(w >= 0)
                                       and np.any(w > 0)):
      raise ValueError(f"weights must hold one finite number >= 0 per step (one > 0), got "
                       f"{w.size} for {measured.size} steps")
    root_w = np.sqrt(w / w.mean())
  if not (np.isfinite(prior_weight) and prior_weight >= 0):
    raise ValueError(f"prior_weight must be a finite number >= 0, got {prior_weight}")
  if int(max_iter) < 1:
    raise ValueError(f"max_iter must be >= 1, got {max_iter}")
  names = tuple(PARAMS) if params is None else tuple(params)
  unknown = [n for n in names if n not in PARAMS]
  if unknown:
    raise ValueError(f"params must be among {', '.join(PARAMS)}; got {unknown}")
  free = {PARAMS.index(n) for n in names}
  works: Sequence[StepWork] = [model.work(s) for s in steps]
  prior = model.theta
  best = None
  for factor in (1.0, 0.5, 2.0, 0.25, 4.0):
    start = prior.copy()
    start[list(free)] *= factor
    theta, loss, chosen, it = _descend(works, measured, start, prior, free, prior_weight,
                                       max_iter, root_w)
    held = [j for j in range(len(PARAMS)) if j not in chosen]
    if np.any(theta[held] != prior[held]):   # a damped step left a held one off its prior
      theta[held] = prior[held]
      theta, loss, chosen, more = _descend(works, measured, theta, prior, free,
                                           prior_weight, max_iter, root_w)
      it += more
    if best is None or loss < best[1]:
      best = (theta, loss, chosen, it)
  theta, _, chosen, it = best
  source = source or f"least-squares fit to {len(steps)} measured steps"
  fitted_model = model.replace(efficiency=efficiency_of(theta, source))
  errors = relative_errors(fitted_model, steps, measured)
  chosen = sorted(chosen)
  fitted = tuple(PARAMS[j] for j in chosen)
  held = tuple(n for n in PARAMS if n not in fitted)
  return FitResult(model=fitted_model, fitted=fitted, held=held, num_steps=len(steps),
                   rel_std_errors=_rel_std_errors(works, measured, theta, chosen),
                   iterations=it, **errors)
