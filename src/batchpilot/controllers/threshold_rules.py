"""Seed 000's monitoring rules (section 4.2): shrink on high variance, grow on low utilisation, act on plateaus."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._validation import check_batch_size, check_choice, check_positive_int
from ._adaptive import (
    check_interval,
    check_real,
    check_size_bounds,
    check_state,
    clamp,
    fmt,
    read_stat,
    round_half_up,
)
from .base import Observation

__all__ = ["ThresholdRules"]

VARIANCE_KEY = "stats/grad_variance"
LOSS_TREND_KEY = "stats/loss_trend"
GPU_UTIL_KEY = "system/gpu_util"
CPU_UTIL_KEY = "system/cpu_util"
UTIL_SOURCES = ("gpu", "gpu-or-cpu", "cpu", "off")
PLATEAU_ACTIONS = ("grow", "shrink")


class ThresholdRules:
    """Seed 000 section 4.2's monitoring rules as a controller; every threshold configurable.

    The seed (a design article describing DYNAMIX-style monitoring rules): gradient variance above 1e-3 -> smaller batch; GPU
    utilisation below 70% -> larger batch; loss decrease below 1% three checks in a row -> adjust; small
    batches for the first 5-10 epochs; minimum and maximum batch thresholds.

    Order of precedence (the first that applies decides, even when a bound makes it a no-op):

    1. **Warm-up**: while ``obs.epochs_done < warmup_epochs``, return ``warmup_size``.
    2. **Not a check**: between checks (one per period of ``check_every`` steps) keep the current size.
    3. **Variance**: ``stats/grad_variance > variance_threshold`` -> shrink by ``shrink_factor``.
    4. **Utilisation**: utilisation ``< util_threshold`` -> grow by ``grow_factor``.
    5. **Plateau**: ``stats/loss_trend < plateau_threshold`` at ``patience`` checks in a row -> grow by
       ``grow_factor`` (``plateau_action="grow"``: Smith et al. 2018, "Don't Decay the Learning Rate,
       Increase the Batch Size": more samples per step where progress stalls) or shrink by
       ``shrink_factor`` (``"shrink"``: the seed's troubleshooting table reads a late plateau as "the
       batch was not reduced in time").
    6. Otherwise keep the current size (clamped to the bounds).

    A rule whose stat is missing (or NaN) is skipped. The plateau count advances at every check where
    ``stats/loss_trend`` is measured (a missing trend leaves it unchanged) and restarts from 0 when the
    plateau rule fires or the size changes. Grow is ``max(round_half_up(B * grow_factor), B + 1)``, shrink
    ``min(round_half_up(B * shrink_factor), B - 1)``, both clamped to ``[min_size, max_size]``.

    Note that ``sigma_t^2`` is in squared-gradient units: whether 1e-3 is "high" depends entirely on the
    model and the loss, and many models exceed it throughout training, so with the seed's default this
    controller mostly sits at ``min_size``. Set ``variance_threshold`` from a measured run.

    Args:
        min_size, max_size: Bounds of every decision (the seed's minimum/maximum batch thresholds).
        variance_threshold: Shrink when ``stats/grad_variance`` exceeds it (seed: 1e-3).
        shrink_factor: Multiplier in ``(0, 1)`` for a shrink.
        util_threshold: Grow when utilisation (percent, 0-100) is below it (seed: 70).
        util_source: ``"gpu"`` (``system/gpu_util``; the rule is skipped when it is absent, e.g. on CPU),
            ``"gpu-or-cpu"`` (GPU when present, else ``system/cpu_util``), ``"cpu"``, or ``"off"``.
        grow_factor: Multiplier ``> 1`` for a grow.
        plateau_threshold: A check is a plateau when the relative loss decrease is below it (seed: 0.01).
        patience: Plateau checks in a row before acting (seed: 3).
        plateau_action: ``"grow"`` (default) or ``"shrink"``.
        warmup_epochs: Epochs of ``warmup_size`` batches first (seed: 5-10; default 5).
        warmup_size: Batch size during the warm-up; default ``min_size``.
        check_every: Steps between checks.

    Attributes:
        reason: Why the last call decided what it did (the engine logs it).
        required_stats: The ``obs.stats`` keys it reads (depends on ``util_source``).

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range (the message says which
            and what to pass instead).
    """

    adaptive = True
    """It decides from measurements: a Pilot's rollback guard watches its changes by default (docs/rollback.md)."""

    def __init__(
        self,
        min_size: int = 32,
        max_size: int = 4096,
        *,
        variance_threshold: float = 1e-3,
        shrink_factor: float = 0.5,
        util_threshold: float = 70.0,
        util_source: str = "gpu",
        grow_factor: float = 2.0,
        plateau_threshold: float = 0.01,
        patience: int = 3,
        plateau_action: str = "grow",
        warmup_epochs: float = 5.0,
        warmup_size: int | None = None,
        check_every: int = 50,
    ) -> None:
        self.min_size, self.max_size = check_size_bounds(min_size, max_size)
        self.variance_threshold = check_real(variance_threshold, "variance_threshold", low=0.0, low_inclusive=True)
        self.shrink_factor = check_real(
            shrink_factor, "shrink_factor", low=0.0, high=1.0, hint=" A shrink multiplies the size by it, e.g. 0.5."
        )
        self.util_threshold = check_real(
            util_threshold, "util_threshold", low=0.0, high=100.0, low_inclusive=True, high_inclusive=True,
            hint=" Utilisation is a percentage (0-100), e.g. 70.",
        )
        self.util_source = check_choice(util_source, "util_source", UTIL_SOURCES)
        self.grow_factor = check_real(
            grow_factor, "grow_factor", low=1.0, hint=" A grow multiplies the size by it, e.g. 2."
        )
        self.plateau_threshold = check_real(plateau_threshold, "plateau_threshold")
        self.patience = check_positive_int(patience, "patience")
        self.plateau_action = check_choice(plateau_action, "plateau_action", PLATEAU_ACTIONS)
        self.warmup_epochs = check_real(warmup_epochs, "warmup_epochs", low=0.0, low_inclusive=True)
        self.warmup_size = self.min_size if warmup_size is None else check_batch_size(warmup_size, "warmup_size")
        if not self.min_size <= self.warmup_size <= self.max_size:
            raise ValueError(
                f"warmup_size={self.warmup_size} is outside [min_size={self.min_size}, "
                f"max_size={self.max_size}]; move it inside the bounds (or omit it to use min_size)."
            )
        self.check_every = check_interval(check_every, "check_every")
        util_keys = {"gpu": (GPU_UTIL_KEY,), "gpu-or-cpu": (GPU_UTIL_KEY, CPU_UTIL_KEY), "cpu": (CPU_UTIL_KEY,)}
        self.required_stats: tuple[str, ...] = (
            VARIANCE_KEY, LOSS_TREND_KEY, *util_keys.get(self.util_source, ())
        )
        self.name = "ThresholdRules"
        self.reason = "no decision yet"
        self._period = 0  # obs.step // check_every at the last check
        self._plateau_checks = 0  # consecutive checks with loss_trend < plateau_threshold

    @property
    def plateau_checks(self) -> int:
        """Consecutive plateau checks so far (restarts at 0 when the size changes)."""
        return self._plateau_checks

    def decide(self, obs: Observation) -> int:
        """Return the global batch size of step ``obs.step`` (see the class docstring)."""
        if obs.epochs_done < self.warmup_epochs:
            self.reason = f"warm-up: epoch {fmt(obs.epochs_done)} < {fmt(self.warmup_epochs)} -> {self.warmup_size}"
            return self.warmup_size
        period = obs.step // self.check_every
        if period <= self._period:
            self.reason = f"next check at step {(self._period + 1) * self.check_every}; kept {obs.batch_size}"
            return obs.batch_size
        self._period = period
        global_batch_size = clamp(obs.batch_size, self.min_size, self.max_size)

        variance = read_stat(obs, VARIANCE_KEY)
        util_key, util = self._utilisation(obs)
        trend = read_stat(obs, LOSS_TREND_KEY)
        if trend is not None:
            self._plateau_checks = self._plateau_checks + 1 if trend < self.plateau_threshold else 0

        if variance is not None and variance > self.variance_threshold:
            decided = self._shrink(global_batch_size)
            why = f"{VARIANCE_KEY}={fmt(variance)} > {fmt(self.variance_threshold)}: shrink"
        elif util is not None and util < self.util_threshold:
            decided = self._grow(global_batch_size)
            why = f"{util_key}={fmt(util)} < {fmt(self.util_threshold)}: grow"
        elif self._plateau_checks >= self.patience:
            change = self._grow if self.plateau_action == "grow" else self._shrink
            decided = change(global_batch_size)
            why = (
                f"{LOSS_TREND_KEY} < {fmt(self.plateau_threshold)} at {self._plateau_checks} checks in a row: "
                f"{self.plateau_action}"
            )
            self._plateau_checks = 0
        else:
            decided = global_batch_size
            missing = [k for k, v in ((VARIANCE_KEY, variance), (util_key, util), (LOSS_TREND_KEY, trend))
                       if v is None and k is not None]
            why = "no rule fired" + (f" (not measured: {', '.join(missing)})" if missing else "")
        if decided != obs.batch_size:
            self._plateau_checks = 0
        self.reason = f"step {obs.step}: {why} -> {decided}"
        return decided

    def _utilisation(self, obs: Observation) -> tuple[str | None, float | None]:
        """``(key, percent)`` of the utilisation the grow rule reads, per ``util_source``."""
        if self.util_source == "off":
            return None, None
        if self.util_source in ("gpu", "gpu-or-cpu"):
            gpu = read_stat(obs, GPU_UTIL_KEY)
            if gpu is not None or self.util_source == "gpu":
                return GPU_UTIL_KEY, gpu
        return CPU_UTIL_KEY, read_stat(obs, CPU_UTIL_KEY)

    def _grow(self, global_batch_size: int) -> int:
        grown = max(round_half_up(global_batch_size * self.grow_factor), global_batch_size + 1)
        return clamp(grown, self.min_size, self.max_size)

    def _shrink(self, global_batch_size: int) -> int:
        shrunk = min(round_half_up(global_batch_size * self.shrink_factor), global_batch_size - 1)
        return clamp(shrunk, self.min_size, self.max_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the period of the last check and the plateau count."""
        return {"name": self.name, "period": self._period, "plateau_checks": self._plateau_checks}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        state = check_state(state, self.name, ("period", "plateau_checks"))
        self._period = int(state["period"])
        self._plateau_checks = int(state["plateau_checks"])
        self.reason = "state loaded"

    def __repr__(self) -> str:
        args = ", ".join(
            f"{k}={getattr(self, k)!r}"
            for k in (
                "min_size", "max_size", "variance_threshold", "shrink_factor", "util_threshold", "util_source",
                "grow_factor", "plateau_threshold", "patience", "plateau_action", "warmup_epochs",
                "warmup_size", "check_every",
            )
        )
        return f"ThresholdRules({args})"
