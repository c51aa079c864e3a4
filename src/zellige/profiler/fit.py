"""Error metrics and KnapFormer's analytic workload model, for validate-profile."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mape_percent(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error of `predicted` against `measured` (all measured > 0)."""
    predicted_a = np.asarray(predicted, dtype=np.float64)
    measured_a = np.asarray(measured, dtype=np.float64)
    if predicted_a.shape != measured_a.shape or predicted_a.size == 0:
        raise ValueError("mape needs two non-empty sequences of equal length")
    if np.any(measured_a <= 0):
        raise ValueError("mape needs positive measured values")
    return float(np.mean(np.abs(predicted_a - measured_a) / measured_a) * 100.0)


def knapformer_terms(length: float, width: int) -> tuple[float, float]:
    """The two terms of W(L) = 24 L d^2 + gamma * 4 L^2 d (per-token layers, attention)."""
    return 24.0 * length * width**2, 4.0 * length**2 * width


def fit_knapformer_gamma(
    lengths: Sequence[float], forward_latencies_s: Sequence[float], width: int
) -> tuple[float, float]:
    """Least-squares fit of latency = seconds_per_unit * W(L) on measured forward latencies.

    Returns (gamma, seconds_per_unit). Relative errors are what matter across lengths from 256 to
    128k tokens, so each equation is divided by its latency (a fit on absolute seconds would only
    see the longest sequences)."""
    terms = np.array([knapformer_terms(length, width) for length in lengths], dtype=np.float64)
    latency_s = np.asarray(forward_latencies_s, dtype=np.float64)
    if terms.shape[0] < 2:
        raise ValueError("the gamma fit needs forward latencies at two lengths or more")
    weights = 1.0 / latency_s
    (linear_coef, attention_coef), *_ = np.linalg.lstsq(
        terms * weights[:, None], latency_s * weights, rcond=None
    )
    if linear_coef <= 0:
        raise ValueError("gamma fit failed: non-positive per-token coefficient")
    return float(attention_coef / linear_coef), float(linear_coef)


def knapformer_work(length: float, width: int, gamma: float) -> float:
    linear_term, attention_term = knapformer_terms(length, width)
    return linear_term + gamma * attention_term


def fit_scale(work: Sequence[float], measured_s: Sequence[float]) -> float:
    """The one seconds-per-unit factor minimising the relative squared error of scale * work."""
    ratio = np.asarray(measured_s, dtype=np.float64) / np.asarray(work, dtype=np.float64)
    # minimise sum (s*w/m - 1)^2 -> s = sum(w/m) / sum((w/m)^2)
    inverse = 1.0 / ratio
    return float(np.sum(inverse) / np.sum(inverse**2))
