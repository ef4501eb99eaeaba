"""Plumbing shared by the controllers: reading a stat, checking arguments and states, rounding, "every N steps".

Private: the public classes live in ``variance_rule.py``, ``threshold_rules.py``, ``noise_scale.py`` and
``goodput.py`` (the schedules take only the state check and the rounding). Every adaptive controller follows
the same conventions:

* a stat that is absent from ``obs.stats``, not a real number, or not finite (the engine writes NaN for
  "not measured") counts as *not measured*: the controller keeps ``obs.batch_size`` and says so in
  ``reason``; it never raises on missing inputs;
* when it decides, its answer lies in ``[min_size, max_size]``;
* it acts at most once per period of ``interval`` steps: at the first call with
  ``obs.step // interval`` larger than at its last decision (steps ``interval``, ``2 * interval``, ...
  when called every step; the next call after them otherwise, e.g. with the engine's ``decide_every``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from .._validation import check_batch_size, check_positive_int
from .base import Observation


def read_stat(obs: Observation, key: str) -> float | None:
    """``obs.stats[key]`` as a finite float, or ``None`` when it is absent, not a real number, or NaN/inf."""
    value: Any = obs.stats.get(key) if obs.stats is not None else None
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:  # a 0-d tensor or numpy array
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def check_real(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = False,
    high_inclusive: bool = False,
    hint: str = "",
) -> float:
    """Return ``value`` as a finite float inside the given (open or closed) interval.

    Raises:
        TypeError: ``value`` is not a real number (bools are rejected).
        ValueError: ``value`` is NaN/inf or outside the interval.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}.{hint}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}.{hint}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low:g}, got {value!r}.{hint}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise ValueError(f"{name} must be {'<=' if high_inclusive else '<'} {high:g}, got {value!r}.{hint}")
    return value


def check_size_bounds(min_size: Any, max_size: Any) -> tuple[int, int]:
    """Validate the required ``[min_size, max_size]`` bounds of an adaptive controller."""
    lo = check_batch_size(min_size, "min_size")
    hi = check_batch_size(max_size, "max_size")
    if lo > hi:
        raise ValueError(
            f"min_size={lo} is larger than max_size={hi}: impossible bounds; swap them or widen max_size."
        )
    return lo, hi


def check_interval(value: Any, name: str = "interval") -> int:
    """Validate a decision period in steps (an int >= 1)."""
    return check_positive_int(value, name)


def clamp(value: int, lo: int, hi: int) -> int:
    """``value`` moved into ``[lo, hi]``."""
    return min(max(value, lo), hi)


def round_half_up(x: float) -> int:
    """``floor(x + 0.5)``: the rounding every batchpilot controller uses."""
    return int(math.floor(x + 0.5))


def floor_size(x: float, hi: int) -> int:
    """``floor(x)`` for a size, saturating at ``hi + 1`` (so ``inf`` or 1e300 never reach ``int()``).

    A relative tolerance of 1e-12 keeps exact ratios exact: ``512 * 1e-3 / 2e-3`` is 255.99999999999997
    in floating point and must floor to 256, not 255.
    """
    if x > hi:
        return hi + 1
    return int(math.floor(x * (1.0 + 1e-12)))


def check_mapping(state: Any, name: str) -> None:
    """Refuse a ``state`` that is not a mapping (``name``: the controller, for the message)."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{name}.load_state_dict expects the dict returned by state_dict(), got {type(state).__name__}."
        )


def check_state(state: Any, name: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
    """Check that ``state`` is a state dict of the controller called ``name`` holding ``keys``."""
    check_mapping(state, name)
    if state.get("name", name) != name:
        raise ValueError(
            f"this state was saved by controller {state.get('name')!r}, not {name!r}; build the same "
            "controller before loading its state."
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{name} state is missing {missing}; pass the dict returned by {name}.state_dict().")
    return state


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def fmt(x: float) -> str:
    """A number for a ``reason`` text: 4 significant digits."""
    return f"{x:.4g}"


NOISE_COUNT_KEY = "stats/noise_count"


def warming_up(obs: Observation, min_measurements: int) -> str | None:
    """A reason to wait when the noise-scale estimate rests on fewer than ``min_measurements`` measured
    steps (early estimates are dominated by noise and can be orders of magnitude off), else ``None``."""
    count = read_stat(obs, NOISE_COUNT_KEY)
    if count is not None and count < min_measurements:
        return f"noise scale from {int(count)} of {min_measurements} measured steps: warming up"
    return None


def limit_step(global_batch_size: int, proposed: int, max_change: float | None) -> int:
    """Limit ``proposed`` to a factor ``max_change`` up or down from ``global_batch_size``: the LR coupled to the
    batch size then changes gradually too (a linear LR rule would otherwise jump by the same factor)."""
    if max_change is None:
        return proposed
    hi = max(global_batch_size + 1, math.floor(global_batch_size * max_change))
    lo = min(global_batch_size - 1, math.ceil(global_batch_size / max_change))
    return max(min(proposed, hi), lo, 1)
