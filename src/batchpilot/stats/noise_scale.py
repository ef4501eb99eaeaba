"""Gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", arXiv 1812.06162, Sec. 2.2 and App. A.1).

``G`` is the true (full-data) gradient and ``Sigma`` the covariance of a single example's gradient. A
gradient averaged over ``b`` independent examples satisfies ``E|G_b|^2 = |G|^2 + tr(Sigma) / b``, so two
squared norms measured at two batch sizes ``b_small < b_big`` give unbiased estimates of both terms
(App. A.1)::

    |G|^2     ~ (b_big * |G_big|^2 - b_small * |G_small|^2) / (b_big - b_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big)

Batches drawn without replacement from a dataset of ``N`` samples (what the sampler does within an epoch)
have ``E|G_b|^2 = |G|^2 + tr(Sigma) (1/b - 1/N)`` instead; ``population=N`` corrects for it (see
:func:`two_batch_estimates`), and the engine and the integrations pass the dataset's size.

Each single estimate is very noisy (it can even be negative), and the ratio of two noisy numbers is
biased, so the paper smooths numerator and denominator separately and divides the smoothed values; we
use exponential moving averages with Adam's start-up correction ``1 - decay^t`` (Kingma & Ba 2015).

Where the two batch sizes come from (no extra forward/backward in the first two cases):

* **Gradient accumulation on one process**: the micro-batches of a step are the small batches and the
  step is the big one; :func:`small_big_from_micro` builds the four numbers.
* **DDP**: ``b_small`` = one rank's local batch, ``sq_norm_small`` = the mean over ranks of the squared
  norm of each rank's local gradient *before* the all-reduce (one scalar all-reduce, done by
  ``distributed.py``), ``b_big`` = the global batch, ``sq_norm_big`` = the squared norm of the reduced
  gradient. With unequal local batches pass ``small_big_from_micro(local_sq_norms, local_sizes, ...)``.
* **One micro-batch on one process** has no second batch size. The honest fallback is to split the step
  into two micro-batches on the steps that measure: unbiased, no extra samples or FLOPs, only the
  fixed cost of one more (smaller) forward/backward. Pairing the gradients of two consecutive steps as
  the two small batches is free but biased, and badly: for equal sizes the ``|G|^2`` estimate is
  ``<g_a, g_b>``, and after an SGD step ``w_b = w_a - lr g_a`` its expectation is about
  ``|G|^2 - lr (G^T H G + tr(H Sigma) / b)`` (``H`` the Hessian): the step along ``g_a``'s own noise
  anticorrelates the next gradient. benchmarks/estimators.py measures -28% on ``|G|^2`` already at
  ``lr * lambda_max = 0.1`` with ``b ~ 0.4 B_simple``, and a negative ``|G|^2`` from 0.5 on, so ``B_simple`` is
  overestimated or undefined. If a caller uses it anyway it must pass ``biased=True``;
  :attr:`NoiseScaleEstimator.biased` then reports it.

What is estimated, with any optimizer: the noise scale of the *raw* stochastic gradient of the loss (the
``.grad`` that backward produces, after unscaling AMP, before clipping). With SGD (with or without
momentum) that is the paper's quantity. With Adam and other preconditioned methods it is still the raw
gradient's noise scale, not that of the preconditioned update; the paper's optimizer-aware variant
(``B_noise = tr(H Sigma) / G^T H G``) would need the Hessian and is not estimated. The paper itself uses
the raw ``B_simple`` as its practical predictor of the critical batch size, Adam-trained tasks included;
treat it as a guide to the batch-size scale, not as an exact optimum for any optimizer.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = ["NoiseScaleEstimator", "small_big_from_micro", "two_batch_estimates"]

#: Share of the smoothed estimate's weight that may come from ``biased=True`` updates before
#: :attr:`NoiseScaleEstimator.biased` says so.
BIASED_THRESHOLD = 0.01


def _check_size(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of samples > 0, got {value!r}.")
    return float(value)


def _check_sq_norm(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{name} must be a finite squared norm >= 0, got {value!r}; skip steps whose gradient is not "
            "finite instead of passing them in."
        )
    return float(value)


def two_batch_estimates(
    b_small: float, sq_norm_small: float, b_big: float, sq_norm_big: float, *, population: float | None = None
) -> tuple[float, float]:
    """One unbiased estimate ``(|G|^2, tr(Sigma))`` from two batch sizes (McCandlish et al. 2018, App. A.1).

    The paper's ``E|G_b|^2 = |G|^2 + tr(Sigma) / b`` holds for independent draws. A sampler that draws
    without replacement from ``N`` samples (one permutation per epoch) gives
    ``E|G_b|^2 = |G|^2 + tr(Sigma) (1/b - 1/N)``, the finite-population correction (Cochran, *Sampling
    Techniques*, 1977, Thm. 2.2; ``tr(Sigma)`` with the ``N - 1`` normalisation). With ``population=N``
    the estimate uses it: ``tr(Sigma)`` is unchanged (the ``1/N`` cancels in the difference) and ``|G|^2``
    gains ``tr(Sigma) / N``. Without it ``|G|^2`` reads low by that much, so ``B_simple`` reads high by a
    factor of exactly ``1 / (1 - B_simple / N)`` (``1 + B_simple / N`` only to first order): 24% at
    ``B_simple = 389`` in 2,000 samples.

    Args:
        b_small: Samples behind ``sq_norm_small`` (the harmonic mean of the sizes when it is a mean of
            several small batches' squared norms; see :func:`small_big_from_micro`).
        sq_norm_small: Squared L2 norm of the gradient averaged over ``b_small`` samples.
        b_big: Samples behind ``sq_norm_big``; must exceed ``b_small``.
        sq_norm_big: Squared L2 norm of the gradient averaged over ``b_big`` samples.
        population: ``N``, when both batches were drawn without replacement from ``N`` samples (a
            dataset's size); ``None``: independent draws (an infinite population).

    Returns:
        ``(grad_sq_norm, trace_cov)``; either may be negative for one noisy draw (they are unbiased, not
        clipped), which is why :class:`NoiseScaleEstimator` smooths them before dividing.

    Raises:
        ValueError: a size is not positive and finite, ``b_big <= b_small``, ``b_big > population``, or a
            norm is negative or not finite.
    """
    b_small, b_big = _check_size(b_small, "b_small"), _check_size(b_big, "b_big")
    s_small, s_big = _check_sq_norm(sq_norm_small, "sq_norm_small"), _check_sq_norm(sq_norm_big, "sq_norm_big")
    if not b_big > b_small:
        raise ValueError(
            f"b_big={b_big} must be larger than b_small={b_small}: the two-batch estimate needs two different "
            "batch sizes (for one micro-batch on one process see the module docstring's fallbacks)."
        )
    grad_sq_norm = (b_big * s_big - b_small * s_small) / (b_big - b_small)
    trace_cov = (s_small - s_big) / (1.0 / b_small - 1.0 / b_big)
    if population is not None:
        n = _check_size(population, "population")
        if b_big > n:
            raise ValueError(
                f"b_big={b_big} is larger than population={n}: a batch drawn without replacement cannot hold more "
                "samples than there are; pass population=None for a batch that repeats samples."
            )
        grad_sq_norm += trace_cov / n  # E|G_b|^2 = |G|^2 + tr(Sigma) (1/b - 1/N)
    return grad_sq_norm, trace_cov


def small_big_from_micro(
    sq_norms_small: Sequence[float], sizes: Sequence[int], sq_norm_big: float
) -> tuple[float, float, float, float]:
    """Build ``(b_small, sq_norm_small, b_big, sq_norm_big)`` from the micro-batches of one step.

    The micro-batch gradients ``g_j`` (each the *mean* over its ``n_j`` samples) are the small batches
    and their size-weighted mean ``g = sum_j n_j g_j / N`` (``N = sum_j n_j``) is the big one. Since
    ``E|g_j|^2 = |G|^2 + tr(Sigma) / n_j``, the plain mean of the ``|g_j|^2`` has expectation
    ``|G|^2 + tr(Sigma) / b_small`` with ``b_small`` the *harmonic* mean of the ``n_j``, so unequal sizes
    stay unbiased. Micro-batches of size 0 (padding) carry no gradient and are left out.

    The same function serves DDP (one entry per rank: the rank's local gradient and local batch size)
    and, with the warnings of the module docstring, the consecutive-step fallback (two entries: the
    previous and the current step; pass ``biased=True`` to :meth:`NoiseScaleEstimator.update` then).

    Args:
        sq_norms_small: ``|g_j|^2`` for each micro-batch. In an accumulating loop with ``loss * n_j / N``
            weighting, the increment of ``.grad`` by micro-batch ``j`` is ``(n_j / N) g_j``: rescale its
            squared norm by ``(N / n_j)^2``.
        sizes: ``n_j``, samples in each micro-batch.
        sq_norm_big: ``|g|^2``, the squared norm of the whole step's (accumulated) gradient.

    Raises:
        ValueError: lengths differ, a size is negative, a norm is invalid, or fewer than two non-empty
            micro-batches remain (then there is no second batch size).
    """
    if len(sq_norms_small) != len(sizes):
        raise ValueError(
            f"sq_norms_small has {len(sq_norms_small)} entries but sizes has {len(sizes)}; pass one size per micro-batch."
        )
    pairs: list[tuple[float, int]] = []
    for j, (sq, n) in enumerate(zip(sq_norms_small, sizes)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"sizes[{j}] must be an int >= 0, got {n!r}.")
        if n > 0:
            pairs.append((_check_sq_norm(sq, f"sq_norms_small[{j}]"), int(n)))
    if len(pairs) < 2:
        raise ValueError(
            f"need at least two non-empty micro-batches to have two batch sizes, got sizes={list(sizes)}; with "
            "one micro-batch use a fallback (see batchpilot.stats.noise_scale) and flag it biased."
        )
    k = len(pairs)
    b_small = k / sum(1.0 / n for _, n in pairs)
    sq_small = sum(sq for sq, _ in pairs) / k
    return b_small, sq_small, float(sum(n for _, n in pairs)), _check_sq_norm(sq_norm_big, "sq_norm_big")


def _check_decay(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}; 0.95 averages over about 20 updates.")
    return float(value)


class NoiseScaleEstimator:
    """Smoothed gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018, App. A.1).

    Feed it once per measured step with :meth:`update`; read :attr:`b_simple`. Numerator and
    denominator are smoothed by *separate* exponential moving averages with start-up correction
    ``1 - decay^t`` (so the first update is not shrunk towards zero), then divided. Pure Python floats:
    no tensors, no communication, negligible cost.

    The decay may differ per update (``update(..., decay=d)``, e.g. ``0.99 ** (steps since the last update /
    4)`` for a time constant in steps whatever the measuring period); the correction then divides by the sum
    of the weights, ``1 - prod(d)``, which is ``1 - decay^t`` for a constant decay. :attr:`relative_error`
    estimates the standard error of :attr:`b_simple` from the spread of the single estimates (what an
    adaptive measuring period reads).

    Args:
        ema_decay: Weight of the past in each EMA, in ``[0, 1)``; the effective window is about
            ``1 / (1 - ema_decay)`` updates (20 for the default 0.95). ``0`` keeps only the last update.

    Raises:
        ValueError: ``ema_decay`` outside ``[0, 1)``.
    """

    def __init__(self, ema_decay: float = 0.95) -> None:
        self.ema_decay: float = _check_decay(ema_decay, "ema_decay")
        self._count: int = 0
        self._grad_sq_ema: float = 0.0  # EMA of the |G|^2 estimates (not yet corrected)
        self._trace_ema: float = 0.0  # EMA of the tr(Sigma) estimates
        self._biased_ema: float = 0.0  # EMA of the 0/1 "this update was biased" flags
        self._weight: float = 0.0  # sum of the EMA weights: 1 - prod(decays), for the start-up correction
        # For relative_error: the sum of the squared weights and EMAs of the products of the single estimates
        # (|G|^2 squared, tr(Sigma) squared, their product), with the same weights as the means.
        self._weight_sq: float = 0.0
        self._moments: list[float] = [0.0, 0.0, 0.0]

    def update(
        self, b_small: float, sq_norm_small: float, b_big: float, sq_norm_big: float, *, biased: bool = False,
        population: float | None = None, decay: float | None = None,
    ) -> None:
        """Add one measurement (arguments, ``population`` included, as in :func:`two_batch_estimates`).

        Args:
            biased: The two batches were not honest independent draws at the same parameters (e.g. two
                consecutive steps paired as a fallback); see :attr:`biased`.
            decay: This update's weight of the past, in ``[0, 1)`` (``None``: :attr:`ema_decay`).

        Raises:
            ValueError: invalid sizes, norms or decay (see :func:`two_batch_estimates`); the state is unchanged.
        """
        grad_sq, trace = two_batch_estimates(b_small, sq_norm_small, b_big, sq_norm_big, population=population)
        d = self.ema_decay if decay is None else _check_decay(decay, "decay")
        a = 1.0 - d
        self._count += 1
        self._grad_sq_ema = d * self._grad_sq_ema + a * grad_sq
        self._trace_ema = d * self._trace_ema + a * trace
        self._biased_ema = d * self._biased_ema + a * float(bool(biased))
        self._weight = d * self._weight + a
        self._weight_sq = d * d * self._weight_sq + a * a
        for i, product in enumerate((grad_sq * grad_sq, trace * trace, grad_sq * trace)):
            self._moments[i] = d * self._moments[i] + a * product

    # ------------------------------------------------------------------ readings
    def _corrected(self, ema: float) -> float | None:
        if self._count == 0 or not self._weight > 0:
            return None
        return ema / self._weight

    @property
    def relative_error(self) -> float | None:
        """Estimated relative standard error of :attr:`b_simple` (``None`` while it cannot be told: fewer than
        about two effective updates, or a smoothed ``|G|^2`` or ``tr(Sigma)`` <= 0).

        Delta method for the ratio of the two smoothed means: with ``u_i = T_i / T - G_i / G`` (``T_i, G_i``
        the single estimates, ``T, G`` their smoothed means) the squared relative error is the weighted
        variance of ``u`` times ``sum(w^2) / sum(w)^2`` (one over the effective number of updates), with
        the small-sample factor ``n_eff / (n_eff - 1)``. A drifting estimate spreads the ``u_i`` too, so
        it reads as uncertain, as it should.
        """
        spread = self._spread()
        return None if spread is None else math.sqrt(spread[0] / spread[1])

    def relative_error_at(self, effective_updates: float) -> float | None:
        """The relative error :attr:`relative_error` would read with ``effective_updates`` effective updates
        of the same spread (e.g. the steady state of another measuring period); ``None`` as there."""
        spread = self._spread()
        return None if spread is None else math.sqrt(spread[0] / effective_updates)

    def _spread(self) -> tuple[float, float] | None:
        """The weighted variance of ``u`` (see :attr:`relative_error`) and the effective number of updates."""
        g, t = self.grad_sq_norm, self.trace_cov
        w, w2 = self._weight, self._weight_sq
        if g is None or t is None or not (g > 0 and t > 0 and w2 > 0):
            return None
        n_eff = w * w / w2
        if n_eff < 2.0:
            return None
        gg, tt, gt = (m / w for m in self._moments)
        return max(tt / (t * t) + gg / (g * g) - 2.0 * gt / (t * g), 0.0) * n_eff / (n_eff - 1.0), n_eff

    @property
    def count(self) -> int:
        """Updates received so far."""
        return self._count

    @property
    def grad_sq_norm(self) -> float | None:
        """Smoothed estimate of ``|G|^2`` (``None`` before the first update; may be <= 0 early on)."""
        return self._corrected(self._grad_sq_ema)

    @property
    def trace_cov(self) -> float | None:
        """Smoothed estimate of ``tr(Sigma)`` (``None`` before the first update; may be < 0 early on)."""
        return self._corrected(self._trace_ema)

    @property
    def b_simple(self) -> float | None:
        """``trace_cov / grad_sq_norm``, in samples; ``None`` before the first update or while the smoothed
        ``|G|^2`` is <= 0 (no signal yet). A smoothed ``tr(Sigma) <= 0`` gives ``0.0`` (no measurable noise)."""
        g, t = self.grad_sq_norm, self.trace_cov
        if g is None or t is None or not g > 0:
            return None
        return max(t, 0.0) / g

    @property
    def biased_fraction(self) -> float:
        """Share of the smoothed estimate's weight that comes from updates flagged ``biased`` (0..1)."""
        return self._corrected(self._biased_ema) or 0.0

    @property
    def biased(self) -> bool:
        """Whether more than 1% of the smoothed estimate's weight comes from ``biased=True`` updates."""
        return self.biased_fraction > BIASED_THRESHOLD

    def metrics(self) -> dict[str, float]:
        """The readings under their logged names; a reading that is not available is left out.

        Keys: ``stats/noise_scale`` (``B_simple``), ``stats/grad_sq_norm``, ``stats/trace_cov``,
        ``stats/noise_scale_biased`` (1.0 or 0.0).
        """
        out: dict[str, float] = {}
        if self._count == 0:
            return out
        b = self.b_simple
        if b is not None:
            out["stats/noise_scale"] = b
        out["stats/grad_sq_norm"] = self.grad_sq_norm  # type: ignore[assignment]
        out["stats/trace_cov"] = self.trace_cov  # type: ignore[assignment]
        out["stats/noise_scale_biased"] = 1.0 if self.biased else 0.0
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot."""
        return {
            "ema_decay": self.ema_decay,
            "count": self._count,
            "grad_sq_ema": self._grad_sq_ema,
            "trace_ema": self._trace_ema,
            "biased_ema": self._biased_ema,
            "weight": self._weight,
            "weight_sq": self._weight_sq,
            "moments": list(self._moments),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            KeyError: a field is missing.
            ValueError: a field is out of range or not finite.
        """
        decay, count = float(state["ema_decay"]), int(state["count"])
        emas = [float(state[k]) for k in ("grad_sq_ema", "trace_ema", "biased_ema")]
        # States saved before the per-update decay: the weights of a constant decay, and no spread yet (the
        # relative error reads None until new updates have filled the moments).
        weight = float(state.get("weight", 1.0 - decay**count))
        weight_sq = float(state["weight_sq"]) if "weight_sq" in state else 0.0
        moments = [float(v) for v in state.get("moments", [0.0, 0.0, 0.0])]
        numbers_ok = all(math.isfinite(v) for v in [*emas, weight, weight_sq, *moments]) and len(moments) == 3
        if not 0 <= decay < 1 or count < 0 or not numbers_ok or not 0 <= weight <= 1 or weight_sq < 0:
            raise ValueError(f"invalid NoiseScaleEstimator state {state!r}: ema_decay in [0, 1), count >= 0, finite "
                             "EMAs, weight in [0, 1], weight_sq >= 0, three moments.")
        self.ema_decay, self._count = decay, count
        self._grad_sq_ema, self._trace_ema, self._biased_ema = emas[0], emas[1], emas[2]
        self._weight, self._weight_sq, self._moments = weight, weight_sq, moments

    def __repr__(self) -> str:
        return f"NoiseScaleEstimator(ema_decay={self.ema_decay}, count={self._count}, b_simple={self.b_simple})"
