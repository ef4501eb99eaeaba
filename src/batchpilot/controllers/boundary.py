"""The boundary between a controller and the engine: what may be passed as a controller
(:func:`check_controller`, :func:`as_controller`) and what a decision must be (:func:`validate_decision`)."""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any

from .._validation import check_bounds
from .base import Controller, InvalidDecisionError
from .callable import Schedule

__all__ = [
    "MAX_DECISION",
    "as_controller",
    "check_controller",
    "controller_name",
    "needs_gradient_stats",
    "validate_decision",
]

logger = logging.getLogger("batchpilot")

MAX_DECISION = 2**62
"""Larger decisions are invalid: no dataset is that large, and a size must fit the int64 that ranks exchange."""


def validate_decision(
    value: Any,
    *,
    current: int,
    min_size: int | None = None,
    max_size: int | None = None,
    on_invalid: str = "raise",
    source: str = "controller",
) -> tuple[int, str | None]:
    """Check and bound one decision; return ``(global_batch_size, note)``.

    ``note`` is ``None`` when ``value`` was used as is, else a short text saying what was changed
    (clamped to a bound, or an invalid value replaced), for the adjustment log.

    Args:
        value: What the controller returned.
        current: The current global batch size (kept when ``on_invalid="keep"``).
        min_size, max_size: Optional bounds; a valid value outside them is clamped (and noted).
        on_invalid: ``"raise"`` (default) rejects 0, negatives, NaN/inf, bools, non-integers and sizes above
            ``MAX_DECISION`` (2**62);
            ``"keep"`` keeps ``current`` instead and logs a warning.
        source: Name of the controller, for messages.

    Raises:
        InvalidDecisionError: ``value`` is invalid and ``on_invalid == "raise"``.
        ValueError: ``on_invalid`` is neither ``"raise"`` nor ``"keep"``, a bound is not an int >= 1, or
            ``min_size > max_size``.
        TypeError: a bound is not an int.
    """
    if on_invalid not in ("raise", "keep"):
        raise ValueError(f"on_invalid must be 'raise' or 'keep'; got {on_invalid!r}.")
    min_size, max_size = check_bounds(min_size, max_size)
    problem = _problem(value)
    if problem is not None:
        message = (
            f"{source} returned {value!r} ({problem}); a decision must be a whole number >= 1. "
            "Fix the controller, or pass on_invalid='keep' to keep the current size instead."
        )
        if on_invalid == "raise":
            raise InvalidDecisionError(message)
        logger.warning("%s Keeping batch size %d.", message, current)
        return current, f"invalid value {value!r} ({problem}); kept {current}"
    global_batch_size = int(value)
    if min_size is not None and global_batch_size < min_size:
        return int(min_size), f"clamped {global_batch_size} up to min_size={min_size}"
    if max_size is not None and global_batch_size > max_size:
        return int(max_size), f"clamped {global_batch_size} down to max_size={max_size}"
    return global_batch_size, None


def _problem(value: Any) -> str | None:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, numbers.Integral):
        v = int(value)
    elif isinstance(value, numbers.Real):
        f = float(value)
        if math.isnan(f) or math.isinf(f):
            return "not finite"
        if not f.is_integer():
            return "not a whole number"
        v = int(f)
    else:
        return f"of type {type(value).__name__}"
    if v < 1:
        return "not positive"
    return None if v <= MAX_DECISION else f"larger than {MAX_DECISION}"


def check_controller(value: Any, name: str = "controller") -> None:
    """Accept ``None``, a :class:`Controller`, or a callable ``(step, current_size) -> size`` (``name``: the
    caller's argument name, for the message).

    Raises:
        TypeError: anything else, a class passed instead of an instance included.
    """
    if isinstance(value, type):  # a class is callable and even passes the Protocol check
        raise TypeError(
            f"{name} must be an instance, got the class {value.__name__}; call it: {name}={value.__name__}(...)."
        )
    if value is None or isinstance(value, Controller) or callable(value):
        return
    raise TypeError(
        f"{name} must be a batchpilot controller (decide/state_dict/load_state_dict) or a callable "
        f"(step, current_size) -> size, got {value!r} of type {type(value).__name__}."
    )


def as_controller(value: Any, name: str = "controller") -> Controller | None:
    """A :class:`Controller` for ``value`` (``None`` stays ``None``): a plain callable is wrapped in
    :class:`~batchpilot.controllers.Schedule` (``TypeError`` for anything :func:`check_controller` refuses)."""
    check_controller(value, name)
    if value is None or isinstance(value, Controller):
        return value
    return Schedule(value)


def needs_gradient_stats(controller: Any) -> bool:
    """Whether a controller reads gradient statistics (it lists them in ``required_stats``)."""
    required = getattr(controller, "required_stats", ())
    return any(key.startswith("stats/") for key in required)


def controller_name(controller: Any) -> str:
    """The name used in logs: the controller's ``name`` attribute, else its class name."""
    return getattr(controller, "name", None) or type(controller).__name__
