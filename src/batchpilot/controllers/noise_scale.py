"""Track the gradient noise scale ``B_simple`` (McCandlish et al. 2018), smoothed, with hysteresis."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from .._validation import check_bool, check_positive_int
from ._adaptive import (
    check_interval,
    check_real,
    check_size_bounds,
    check_state,
    clamp,
    fmt,
    optional_float,
    optional_int,
    read_stat,
    round_half_up,
    warming_up,
)
from .base import Observation

__all__ = ["NoiseScale"]

NOISE_SCALE_KEY = "stats/noise_scale"


class NoiseScale:
    """Global batch size ``~ factor * B_simple``, within bounds, smoothed, with hysteresis.

    McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (section 2.2 and appendix A):
    the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (in samples) predicts the critical batch
    size, the batch beyond which more samples per step stop buying proportionally fewer steps; training
    at ``B ~ B_crit ~ B_simple`` costs about twice the minimum steps and twice the minimum samples. The
    noise scale grows as the loss falls, so the batch follows it upwards during training.

    Reads ``stats/noise_scale`` (``B_simple`` in samples, from the noise-scale estimator). Each call:

    1. If the stat is missing, NaN or not positive, keep the current size (the controller never decides
       before the estimate exists); while it rests on fewer than ``min_measurements`` measured steps
       (``stats/noise_count``), update the EMA but keep the size.
    2. Update an EMA of ``log(B_simple)`` with per-step decay ``smoothing``: the old value keeps weight
       ``smoothing ** (steps since the last update)``, so the time constant (about
       ``1 / (1 - smoothing)`` steps) does not depend on how often the engine calls. The first value
       starts the EMA (no bias). One update per step: a second call at the same step does not update.
    3. At the first call of each new period of ``interval`` steps, let ``target = factor * exp(EMA)``
       and ``B`` the current size (clamped to the bounds). Grow when ``target > B * (1 + hysteresis)``;
       shrink (only with ``allow_shrink=True``) when ``target < B / (1 + hysteresis)``; otherwise keep
       ``B``. A change goes to ``target`` limited to ``max_change`` (by default at most double or half
       ``B``), then rounded (``round_to``: nearest integer, nearest power of two, or nearest multiple of a
       quantum) and clamped to ``[min_size, max_size]``; if rounding undoes the move, ``B`` is kept (with
       ``round_to``, when no grid point moves within the limit, the next grid point past it is taken).
       Between periods, the current size is kept.

    Args:
        factor: Multiplier of ``B_simple`` (1.0: train at the estimated critical batch size).
        min_size, max_size: Bounds of every decision.
        smoothing: Per-step EMA decay in ``[0, 1)`` of ``log(B_simple)``; 0 disables the smoothing.
        hysteresis: Relative dead band (``>= 0``): 0.2 means the target must differ from the current size
            by more than a factor of 1.2 before the size changes.
        interval: Steps between decisions.
        allow_shrink: Allow decreases (default ``False``: monotone growth, as ``B_simple`` grows during
            training; a noisy dip of the estimate then cannot shrink the batch).
        round_to: ``None`` (nearest integer), ``"pow2"`` (nearest power of two in log space) or an int
            quantum (nearest multiple of it, at least one quantum; at most ``max_size``).
        max_change: Most a single decision may multiply or divide the size by (``> 1``; default 2.0, so the
            coupled LR changes gradually too); ``None``: no limit.
        min_measurements: Measured steps the noise-scale estimate must rest on before the first decision
            (default 10; early estimates can be orders of magnitude off); 0: decide from the first.

    Attributes:
        reason: Why the last call decided what it did (the engine logs it).

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range.
    """

    required_stats: tuple[str, ...] = (NOISE_SCALE_KEY,)
    """The ``obs.stats`` keys it reads (the engine switches the matching measurements on)."""
    adaptive = True
    """It decides from measurements: a Pilot's rollback guard watches its changes by default (docs/rollback.md)."""
    recommended_lr_rule = "adascale"
    """The LR coupling ``Pilot(lr_rule=None)`` uses with it: AdaScale's gain (Johnson et al. 2020), which follows
    the measured noise and cannot multiply the LR blindly the way the linear rule does on every doubling."""

    def __init__(
        self,
        factor: float = 1.0,
        min_size: int = 32,
        max_size: int = 4096,
        *,
        smoothing: float = 0.9,
        hysteresis: float = 0.2,
        interval: int = 50,
        allow_shrink: bool = False,
        round_to: int | str | None = None,
        max_change: float | None = 2.0,
        min_measurements: int = 10,
    ) -> None:
        self.factor = check_real(factor, "factor", low=0.0, hint=" Use 1.0 to track B_simple itself.")
        self.min_size, self.max_size = check_size_bounds(min_size, max_size)
        self.smoothing = check_real(
            smoothing, "smoothing", low=0.0, high=1.0, low_inclusive=True,
            hint=" It is the per-step EMA decay: 0 = no smoothing, 0.9 ~ a 10-step window.",
        )
        self.hysteresis = check_real(
            hysteresis, "hysteresis", low=0.0, low_inclusive=True,
            hint=" It is relative: 0.2 = change only beyond a 20% difference.",
        )
        self.interval = check_interval(interval)
        self.allow_shrink = check_bool(allow_shrink, "allow_shrink")
        self.round_to = _check_round_to(round_to, self.max_size)
        self.max_change = None if max_change is None else check_real(
            max_change, "max_change", low=1.0, hint=" 2.0 = at most double or halve per decision; None = no limit."
        )
        self.min_measurements = check_positive_int(min_measurements, "min_measurements", minimum=0)
        self.name = "NoiseScale"
        self.reason = "no decision yet"
        self._log_ema: float | None = None  # EMA of log(B_simple)
        self._last_step: int | None = None  # step of the last EMA update
        self._period = 0  # obs.step // interval at the last decision

    @property
    def smoothed_noise_scale(self) -> float | None:
        """``exp`` of the EMA of ``log(B_simple)`` (``None`` before the first measurement)."""
        return None if self._log_ema is None else math.exp(self._log_ema)

    def decide(self, obs: Observation) -> int:
        """Return the global batch size of step ``obs.step`` (see the class docstring)."""
        global_batch_size = obs.batch_size
        noise = read_stat(obs, NOISE_SCALE_KEY)
        if noise is None or noise <= 0:
            what = "not measured yet" if noise is None else f"not positive ({fmt(noise)})"
            self.reason = f"{NOISE_SCALE_KEY} {what}; kept {global_batch_size}"
            return global_batch_size
        self._update(obs.step, math.log(noise))
        assert self._log_ema is not None
        waiting = warming_up(obs, self.min_measurements)
        if waiting is not None:
            self.reason = f"{waiting}; kept {global_batch_size}"
            return global_batch_size
        period = obs.step // self.interval
        if period <= self._period:
            self.reason = (
                f"B_simple={fmt(noise)} (smoothed {fmt(math.exp(self._log_ema))}); next decision at step "
                f"{(self._period + 1) * self.interval}; kept {global_batch_size}"
            )
            return global_batch_size
        self._period = period
        global_batch_size = clamp(global_batch_size, self.min_size, self.max_size)
        target = self.factor * math.exp(self._log_ema)
        band = 1.0 + self.hysteresis
        prefix = f"step {obs.step}: target {fmt(self.factor)} x {fmt(math.exp(self._log_ema))} = {fmt(target)}"
        inside = global_batch_size / band <= target <= global_batch_size * band
        if inside or (target < global_batch_size and not self.allow_shrink):
            why = "within the hysteresis band" if inside else "below, and allow_shrink=False"
            self.reason = f"{prefix} {why} of {global_batch_size}; kept {global_batch_size}"
            return global_batch_size
        # The step limit first, then the rounding: the size always lies on the round_to grid. When the nearest
        # grid point lies past max_change, the grid point on the near side is taken if it still moves; only
        # when no grid point moves within the limit does the decision go one grid point past it.
        grow = target > global_batch_size

        def moves(candidate: int) -> bool:  # away from global_batch_size, toward the target
            return candidate > global_batch_size if grow else candidate < global_batch_size

        limited = min(target, 4.0 * self.max_size)
        if self.max_change is not None:  # as limit_step: at most x max_change, at least one sample
            lo = min(global_batch_size - 1, math.ceil(global_batch_size / self.max_change))
            hi = max(global_batch_size + 1, math.floor(global_batch_size * self.max_change))
            limited = min(max(limited, lo), hi)
            decided = self._round_and_clamp(max(limited, 1.0))
            if (decided > hi if grow else decided < lo) and self.round_to is not None:
                inner = self._round_and_clamp(max(limited, 1.0), toward_current=grow)
                if moves(inner):
                    decided = inner
            capped = target > hi if grow else target < lo
            if capped and self.round_to is not None and not moves(decided):
                free = self._round_and_clamp(max(min(target, 4.0 * self.max_size), 1.0))  # without the limit
                if moves(free):  # a limit never moves further than no limit
                    decided = self._next_grid_point(global_batch_size, grow)  # none moves within it: one past
        else:
            decided = self._round_and_clamp(max(limited, 1.0))
        if not moves(decided):
            self.reason = (f"{prefix}: rounding/bounds give {decided}, no move from {global_batch_size}; "
                           f"kept {global_batch_size}")
            return global_batch_size
        self.reason = f"{prefix} -> {decided} (round_to={self.round_to!r}, [{self.min_size}, {self.max_size}])"
        return decided

    def _update(self, step: int, log_noise: float) -> None:
        if self._log_ema is None or self._last_step is None:
            self._log_ema, self._last_step = log_noise, step
        elif step > self._last_step:
            keep = self.smoothing ** (step - self._last_step)
            self._log_ema = keep * self._log_ema + (1.0 - keep) * log_noise
            self._last_step = step

    def _next_grid_point(self, global_batch_size: int, grow: bool) -> int:
        """The first ``round_to`` grid point strictly above (``grow``) or below ``global_batch_size``, within bounds."""
        if self.round_to == "pow2":
            exponent = math.log2(global_batch_size)
            point = 2 ** (math.floor(exponent) + 1 if grow else math.ceil(exponent) - 1)
        else:
            quantum = int(self.round_to)  # type: ignore[arg-type]
            point = quantum * (global_batch_size // quantum + 1 if grow else -(-global_batch_size // quantum) - 1)
            point = max(quantum, point)
        return clamp(point, self.min_size, self.max_size)

    def _round_and_clamp(self, target: float, toward_current: bool | None = None) -> int:
        """``target`` on the ``round_to`` grid and within the bounds: the nearest grid point, or with
        ``toward_current`` True (growing) / False (shrinking) the one below / above ``target``."""
        # Far above max_size every rounding lands above it too: cap first, so inf never reaches int().
        target = min(target, 4.0 * self.max_size)
        pick = round if toward_current is None else (math.floor if toward_current else math.ceil)
        if self.round_to is None:
            rounded = round_half_up(target)
        elif self.round_to == "pow2":
            exponent = math.log2(target)
            rounded = round_half_up(2.0 ** (round(exponent) if toward_current is None else pick(exponent)))
        else:
            quantum = int(self.round_to)
            steps = round_half_up(target / quantum) if toward_current is None else pick(target / quantum)
            rounded = max(quantum, quantum * steps)
        return clamp(rounded, self.min_size, self.max_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the EMA of ``log(B_simple)``, its last update step, the last decision period."""
        return {
            "name": self.name,
            "log_ema": self._log_ema,
            "last_step": self._last_step,
            "period": self._period,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        state = check_state(state, self.name, ("log_ema", "last_step", "period"))
        self._log_ema = optional_float(state["log_ema"])
        self._last_step = optional_int(state["last_step"])
        self._period = int(state["period"])
        self.reason = "state loaded"

    def __repr__(self) -> str:
        return (
            f"NoiseScale(factor={self.factor!r}, min_size={self.min_size}, max_size={self.max_size}, "
            f"smoothing={self.smoothing!r}, hysteresis={self.hysteresis!r}, interval={self.interval}, "
            f"allow_shrink={self.allow_shrink!r}, round_to={self.round_to!r})"
        )


def _check_round_to(value: Any, max_size: int) -> int | str | None:
    if value is None or value == "pow2":
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        quantum = check_positive_int(value, "round_to")
        if quantum > max_size:
            raise ValueError(
                f"round_to={quantum} is larger than max_size={max_size}: no multiple of it fits; "
                "use a smaller quantum."
            )
        return quantum
    raise ValueError(
        f"round_to must be None, 'pow2' or an int quantum >= 1, got {value!r}; e.g. round_to=32 for "
        "multiples of 32."
    )
