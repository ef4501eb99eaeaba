"""What every controller sees (`Observation`), what it must offer (`Controller`), and the one boundary
every decision passes through (`validate_decision`)."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .._validation import check_bounds

logger = logging.getLogger("batchpilot")


@dataclass(frozen=True)
class Observation:
    """A snapshot of training taken between two optimizer steps.

    Attributes:
        step: Optimizer steps completed so far. The decision made from this observation is the global
            batch size of step index ``step`` (0-based), i.e. the next step.
        samples_seen: Samples consumed since the start of training, over all ranks.
        epoch: Full passes over the data completed.
        coverage: Fraction of the current pass consumed, in ``[0, 1)``.
        batch_size: The global batch size in force: what the last decision set. An epoch's final step may
            have had fewer samples (the log's ``batch/global_size`` has those).
        num_samples: Dataset length (so a controller can reason in epochs).
        losses: Mean training loss of recent steps, oldest first (at most ``Pilot.loss_history``).
        samples_per_s: Recent training throughput (samples per second over all ranks), if measured.
        stats: Further named measurements (gradient statistics, system and cluster metrics), using the
            namespaced metric names (``stats/noise_scale``, ``system/cpu_util``, ...).
    """

    step: int
    samples_seen: int
    epoch: int
    coverage: float
    batch_size: int
    num_samples: int = 0
    losses: tuple[float, ...] = ()
    samples_per_s: float | None = None
    stats: Mapping[str, float] = field(default_factory=dict)

    @property
    def epochs_done(self) -> float:
        """Passes over the data including the current fraction (``epoch + coverage``)."""
        return self.epoch + self.coverage


@runtime_checkable
class Controller(Protocol):
    """Decides the global batch size of the next step. Pure: no I/O, no communication, no ranks."""

    def decide(self, obs: Observation) -> int:
        """Return the global batch size of step ``obs.step``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue deciding identically after a restart."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


class InvalidDecisionError(ValueError):
    """A controller returned something that is not a usable batch size."""


def validate_decision(
    value: Any,
    *,
    current: int,
    min_size: int | None = None,
    max_size: int | None = None,
    on_invalid: str = "raise",
    source: str = "controller",
) -> tuple[int, str | None]:
    """Check and bound one decision; return ``(size, note)``.

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
    size = int(value)
    if min_size is not None and size < min_size:
        return int(min_size), f"clamped {size} up to min_size={min_size}"
    if max_size is not None and size > max_size:
        return int(max_size), f"clamped {size} down to max_size={max_size}"
    return size, None


MAX_DECISION = 2**62
"""Larger decisions are invalid: no dataset is that large, and a size must fit the int64 that ranks exchange."""


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
    from .schedules import Schedule

    return Schedule(value)


def needs_gradient_stats(controller: Any) -> bool:
    """Whether a controller reads gradient statistics (it lists them in ``required_stats``)."""
    required = getattr(controller, "required_stats", ())
    return any(key.startswith("stats/") for key in required)


def controller_name(controller: Any) -> str:
    """The name used in logs: the controller's ``name`` attribute, else its class name."""
    return getattr(controller, "name", None) or type(controller).__name__
