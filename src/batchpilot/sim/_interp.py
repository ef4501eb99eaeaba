"""Numeric helpers of the traces: the compute fit, gap filling, thinning, smoothing, crossings, and the fit of the
efficiency's noise-scale factor (no Trace here: :mod:`batchpilot.sim.trace` builds on these)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["crossing", "filled", "fit_compute", "step_seconds", "fit_noise_scale_factor", "number", "samples_to_progress", "smoothed",
           "thin"]


def fit_compute(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Pollux's ``T_compute = a + b * local_batch`` fitted to a step-time table by least squares on the *relative*
    error (each size counts alike, so the large sizes' seconds do not swamp the fixed cost ``a``), with ``a, b >= 0``
    (a fit with a negative term is redone with it at 0)."""
    x, y = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    w = 1.0 / y
    if len(x) >= 2 and np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1, w=w)
    else:
        a, b = 0.0, float(y.mean() / x.mean())
    if a < 0:
        a, b = 0.0, float((w * w * x * y).sum() / (w * w * x * x).sum())
    if b < 0:
        a, b = float((w * w * y).sum() / (w * w).sum()), 0.0
    return float(a), float(b)


def step_seconds(sizes: Sequence[int], seconds: Sequence[float], slope: float, micro_batch: float) -> float:
    """Seconds of a step of ``micro_batch`` samples from a step-time table (``sizes`` ascending): linear between the
    sizes, extended outside with ``slope`` (the fit's ``b``; above the table, at least the last segment's slope),
    never below ``t0 * m / s0`` beneath it."""
    s, t, m = sizes, seconds, float(micro_batch)
    if m <= s[0]:
        return max(t[0] - slope * (s[0] - m), t[0] * m / s[0])
    if m >= s[-1]:
        last = slope if len(s) == 1 else max(slope, (t[-1] - t[-2]) / (s[-1] - s[-2]))
        return t[-1] + last * (m - s[-1])
    return float(np.interp(m, s, t))


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) else None


def filled(values: Sequence[Any]) -> np.ndarray | None:
    """Positive finite ``values`` as floats, each gap filled with the last value before it (the first value for a
    gap at the start); ``None`` when there is none."""
    numbers = [number(v) for v in values]
    good = [v for v in numbers if v is not None and v > 0]
    if not good:
        return None
    out, last = [], good[0]
    for v in numbers:
        last = v if v is not None and v > 0 else last
        out.append(last)
    return np.array(out)


def thin(n: int, keep: set[int], max_points: int) -> list[int]:
    """At most ``max_points`` indices of ``range(n)``, evenly spread, always with those in ``keep``."""
    if n <= max_points:
        return list(range(n))
    chosen = {int(round(i)) for i in np.linspace(0, n - 1, max(max_points - len(keep), 2))} | keep
    return sorted(chosen)


def smoothed(values: Sequence[float] | np.ndarray, window: int) -> np.ndarray:
    """The centred moving average of ``values`` over ``window`` points (odd; an even one grows by 1), over the points
    there are at the ends: an estimate of the expected metric that one noisy evaluation does not move much."""
    v = np.asarray(values, dtype=float)
    half = max(int(window), 1) // 2
    if half == 0 or len(v) < 2:
        return v.copy()
    sums = np.concatenate([[0.0], np.cumsum(v)])
    lo = np.clip(np.arange(len(v)) - half, 0, len(v))
    hi = np.clip(np.arange(len(v)) + half + 1, 0, len(v))
    return (sums[hi] - sums[lo]) / (hi - lo)


def crossing(xs: Sequence[float] | np.ndarray, values: Sequence[float] | np.ndarray, target: float) -> float | None:
    """The first ``x`` at which ``values`` reach ``target``, interpolated linearly (``None``: they never do)."""
    x, v = np.asarray(xs, dtype=float), np.asarray(values, dtype=float)
    hits = np.nonzero(v >= target)[0]
    if len(hits) == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return float(x[0])
    return float(x[i - 1] + (target - v[i - 1]) / (v[i] - v[i - 1]) * (x[i] - x[i - 1]))


def samples_to_progress(progress: np.ndarray, noise_scale: np.ndarray, base: int, batch_size: float, upto: float,
                        factor: float = 1.0) -> float:
    """Samples a static run at ``batch_size`` needs to reach progress ``upto``: the integral of ``dp / E(B, p)``
    with ``E = (k phi + B0) / (k phi + B)``, ``k = factor`` (trapezoids on a fine grid)."""
    grid = np.linspace(0.0, upto, 2001)
    phi = factor * np.interp(grid, progress, noise_scale)
    inverse = (phi + batch_size) / (phi + base)
    return float(np.sum((inverse[1:] + inverse[:-1]) / 2 * np.diff(grid)))


def fit_noise_scale_factor(progress: np.ndarray, noise_scale: np.ndarray, base: int, upto: float,
                           measured: Mapping[int, float]) -> float:
    """The ``k`` that makes ``samples_to_progress`` match the ``measured`` samples to target of static runs at
    other batch sizes (least squares on the log ratio, ``k`` in [0.01, 1e4], a log-spaced search refined twice).
    A run at ``B0`` says nothing about ``k`` (its efficiency is 1 whatever ``k``)."""
    sizes = {int(b): float(s) for b, s in measured.items() if int(b) != base}
    if not sizes:
        raise ValueError(f"measured holds no batch size other than B0 = {base}; time a static run at another size.")
    if any(not (math.isfinite(s) and s > 0) for s in sizes.values()):
        raise ValueError(f"measured samples must be finite and > 0, got {sizes}.")

    def loss(k: float) -> float:
        return sum(math.log(samples_to_progress(progress, noise_scale, base, b, upto, k) / s) ** 2
                   for b, s in sizes.items())

    lo, hi = -2.0, 4.0
    for _ in range(3):
        grid = np.linspace(lo, hi, 41)
        best = min(grid, key=lambda e: loss(10 ** e))
        step = grid[1] - grid[0]
        lo, hi = best - step, best + step
    return float(10 ** best)
