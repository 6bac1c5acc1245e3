"""Statistics of an accuracy cell (models/eval.py): KL divergence of next-token distributions and
percentile-bootstrap confidence intervals over windows.

A cell scores W windows x n positions; its positions are not independent (one window shares one
context), so intervals resample whole windows: draw W window indices with replacement B times
(np.random.default_rng(seed).integers(0, W, size=(B, W))), recompute the statistic on each draw,
and report the (1 - level) / 2 and (1 + level) / 2 percentiles. Comparisons with the float32 cache
are paired: both statistics of one draw use the same windows, so the interval is that of the
difference the cache format makes on these positions, not of the text's own variance.
"""

from __future__ import annotations

import numpy as np


def kl_divergence(ref_logp: np.ndarray, logp: np.ndarray) -> np.ndarray:
  """KL(p_ref || p) = sum_v p_ref(v) (log p_ref(v) - log p(v)) over the last axis, in nats.

  ref_logp, logp: log-probabilities (normalized, natural log), same shape [..., V], any float
  dtype; computed in float64. Returns f64[...]. Raises ValueError for mismatched shapes."""
  ref_logp, logp = np.asarray(ref_logp), np.asarray(logp)
  if ref_logp.shape != logp.shape:
    raise ValueError(f"KL needs log-probs of one shape: {ref_logp.shape} vs {logp.shape}")
  ref = ref_logp.astype(np.float64)
  # p_ref = 0 terms contribute 0 (also when log p is -inf there).
  diff = np.where(np.isneginf(ref), 0.0, ref - logp.astype(np.float64))
  return np.sum(np.exp(ref) * diff, axis=-1)


def _draws(num_windows: int, num_boot: int, seed: int) -> np.ndarray:
  if num_windows < 1 or num_boot < 1:
    raise ValueError(f"bootstrap needs >= 1 window and draw: {num_windows=} {num_boot=}")
  return np.random.default_rng(seed).integers(0, num_windows, size=(num_boot, num_windows))


def _check(x, name):
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or 0 in x.shape:
    raise ValueError(f"{name} must be [windows, positions] with both > 0, got shape {x.shape}")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"{name} has non-finite values")
  return x


def mean_ci(x: np.ndarray, *, num_boot: int = 2000, seed: int = 0, level: float = 0.95
            ) -> tuple[float, float, float]:
  """x f[W, n] (e.g. KL per position) -> (mean over all positions, lo, hi): a percentile
  bootstrap over windows (windows hold equally many positions, so a draw's mean is the mean of its
  windows' means)."""
  x = _check(x, "x")
  per_window = x.mean(axis=1)
  boot = per_window[_draws(len(per_window), num_boot, seed)].mean(axis=1)
  lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
  return float(x.mean()), float(lo), float(hi)


def ppl_ratio_ci(nll: np.ndarray, ref_nll: np.ndarray, *, num_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
  """nll, ref_nll f[W, n] (natural-log NLL of the same positions through a format and through the
  reference cache) -> (ppl / ppl_ref, lo, hi) with ppl = exp(mean nll): paired percentile
  bootstrap over windows (each draw's ratio is exp(mean over its windows of nll - ref_nll))."""
  nll, ref_nll = _check(nll, "nll"), _check(ref_nll, "ref_nll")
  if nll.shape != ref_nll.shape:
    raise ValueError(f"nll {nll.shape} and ref_nll {ref_nll.shape} must score the same positions")
  d = (nll - ref_nll).mean(axis=1)
  boot = np.exp(d[_draws(len(d), num_boot, seed)].mean(axis=1))
  lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
  return float(np.exp(d.mean())), float(lo), float(hi)
