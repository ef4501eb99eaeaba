"""Seed 002's variance rule: ``B = floor(B0 * sigma_base^2 / sigma_t^2)`` every ``interval`` steps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .._validation import check_batch_size
from ._adaptive import (
    check_interval,
    check_real,
    check_size_bounds,
    check_state,
    clamp,
    floor_size,
    fmt,
    optional_float,
    optional_int,
    read_stat,
)
from .base import Observation

__all__ = ["VarianceRule"]

VARIANCE_KEY = "stats/grad_variance"


class VarianceRule:
    """``B = floor(B0 * sigma_base^2 / sigma_t^2)`` every ``interval`` steps, within ``[min_size, max_size]``.

    The rule of seed 002 (one of the design articles batchpilot started from), implemented as it is written. **This rule SHRINKS the batch
    when the gradient variance rises** (and grows it when the variance falls) -- the opposite of the
    gradient-noise-scale family: McCandlish et al. 2018 (critical batch ``B_simple = tr(Sigma)/|G|^2``
    grows with the noise), CABS (Balles et al. 2017, ``B ~ lr * tr(Sigma) / loss``) and AdaScale
    (Johnson et al. 2020) all answer *more* noise with a *larger* batch. Use :class:`NoiseScale` or
    :class:`Goodput` for that; this class exists so that the seed's rule can be run and benchmarked
    honestly beside them.

    Reads ``stats/grad_variance``: the per-sample gradient variance of seed 002,
    ``sigma_t^2 = mean_i |g_i - g_mean|^2`` (a sum over parameters of squared deviations). Inside ``Pilot``
    that is the smoothed two-batch ``tr(Sigma)`` (``stats/trace_cov``, an EMA over measured steps), so the
    rule sees a lagging average rather than one step's value.

    * ``sigma_base^2`` is the first measured ``sigma_t^2`` (the first call that sees the stat), unless
      ``sigma_base`` is given; ``B0`` is the batch size at that moment unless ``base_size`` is given.
    * At the first call of every new period of ``interval`` steps (steps 1000, 2000, ... by default) the
      size becomes ``floor(B0 * sigma_base^2 / sigma_t^2)`` clamped to ``[min_size, max_size]``;
      ``sigma_t^2 == 0`` gives ``max_size``. Between those steps the current size is kept.
    * While ``stats/grad_variance`` is missing (or NaN, or negative) the current size is kept, and a
      period is only used up by a real decision: the rule retries at the next call.

    Seed 002 pairs the rule with linear LR scaling that turns into square-root scaling above 4096:
    :attr:`recommended_lr_rule` (``"linear-then-sqrt"``) with :attr:`recommended_lr_knee` (4096), i.e.
    ``Pilot(lr_rule=rule.recommended_lr_rule, lr_knee=rule.recommended_lr_knee)``.

    Args:
        base_size: ``B0``; default the batch size when ``sigma_t^2`` is first measured.
        min_size, max_size: Bounds of every decision (seed 002: 256 and 8192).
        interval: Steps between decisions (seed 002: every 1000 steps).
        sigma_base: The base standard deviation ``sigma_base`` (the rule uses ``sigma_base**2``, in the
            units of ``stats/grad_variance``); default ``sqrt`` of the first measured ``sigma_t^2``.

    Attributes:
        reason: Why the last call decided what it did (the engine logs it).

    Raises:
        TypeError, ValueError: a size or ``interval`` is not an int >= 1, ``min_size > max_size``, or
            ``sigma_base`` is not a finite real > 0.
    """

    required_stats: tuple[str, ...] = (VARIANCE_KEY,)
    """The ``obs.stats`` keys it reads (the engine switches the matching measurements on)."""
    adaptive = True
    """It decides from measurements: a Pilot's rollback guard watches its changes by default (docs/rollback.md)."""
    recommended_lr_rule = "linear-then-sqrt"
    """The LR coupling seed 002 asks for: linear scaling, square root above :attr:`recommended_lr_knee`."""
    recommended_lr_knee = 4096

    def __init__(
        self,
        base_size: int | None = None,
        min_size: int = 256,
        max_size: int = 8192,
        interval: int = 1000,
        sigma_base: float | None = None,
    ) -> None:
        self.min_size, self.max_size = check_size_bounds(min_size, max_size)
        self.base_size = None if base_size is None else check_batch_size(base_size, "base_size")
        self.interval = check_interval(interval)
        self.sigma_base = None if sigma_base is None else check_real(
            sigma_base, "sigma_base", low=0.0,
            hint=" It is a standard deviation (the rule uses sigma_base**2); pass None to take the first "
            "measured value.",
        )
        square = None if self.sigma_base is None else self.sigma_base * self.sigma_base  # inf, not OverflowError
        if square is not None and not 0.0 < square < math.inf:
            raise ValueError(
                f"sigma_base={self.sigma_base!r} squares to {square!r} in floating point, which the rule cannot "
                "use; pass a standard deviation between 1e-150 and 1e150, or None to take the first measured value."
            )
        self.name = "VarianceRule"
        self.reason = "no decision yet"
        self._b0: int | None = None  # B0 in use, fixed at the first measurement
        self._base_variance: float | None = None  # sigma_base^2 in use
        self._period = 0  # obs.step // interval at the last decision

    @property
    def base_variance(self) -> float | None:
        """``sigma_base^2`` in use (``None`` until the first measurement)."""
        return self._base_variance

    def decide(self, obs: Observation) -> int:
        """Return the global batch size of step ``obs.step`` (see the class docstring)."""
        global_batch_size = obs.batch_size
        variance = read_stat(obs, VARIANCE_KEY)
        if variance is None or variance < 0:
            what = "not measured yet" if variance is None else f"negative ({fmt(variance)})"
            self.reason = f"{VARIANCE_KEY} {what}; kept {global_batch_size}"
            return global_batch_size
        if self._base_variance is None:
            self._base_variance = self.sigma_base**2 if self.sigma_base is not None else variance
            self._b0 = self.base_size if self.base_size is not None else global_batch_size
        period = obs.step // self.interval
        if period <= self._period:
            self.reason = (
                f"sigma_t^2={fmt(variance)} (base {fmt(self._base_variance)}, B0={self._b0}); next decision "
                f"at step {(self._period + 1) * self.interval}; kept {global_batch_size}"
            )
            return global_batch_size
        self._period = period
        assert self._b0 is not None
        if variance == 0:
            decided, formula = self.max_size, "sigma_t^2 = 0 -> max_size"
        else:
            raw = self._b0 * self._base_variance / variance
            decided = clamp(floor_size(raw, self.max_size), self.min_size, self.max_size)
            formula = (
                f"floor({self._b0} * {fmt(self._base_variance)} / {fmt(variance)}) = floor({fmt(raw)})"
            )
        self.reason = f"step {obs.step}: {formula} -> {decided} in [{self.min_size}, {self.max_size}]"
        return decided

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: B0 and ``sigma_base^2`` in use, and the period of the last decision."""
        return {
            "name": self.name,
            "b0": self._b0,
            "base_variance": self._base_variance,
            "period": self._period,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        state = check_state(state, self.name, ("b0", "base_variance", "period"))
        self._b0 = optional_int(state["b0"])
        self._base_variance = optional_float(state["base_variance"])
        self._period = int(state["period"])
        self.reason = "state loaded"

    def __repr__(self) -> str:
        return (
            f"VarianceRule(base_size={self.base_size!r}, min_size={self.min_size}, max_size={self.max_size}, "
            f"interval={self.interval}, sigma_base={self.sigma_base!r})"
        )
