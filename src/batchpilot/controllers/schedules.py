"""Batch-size schedules: controllers whose decision is a fixed function of training progress.

Every class here is a closed form of ``obs.step``, ``obs.samples_seen`` or ``obs.epochs_done`` (not of
the previous decision), so a resumed run decides exactly as an uninterrupted one and the state dicts
carry no state. Sizes computed from real numbers are rounded half up (``floor(x + 0.5)``). The seed-003
style callable ``(step, current_size) -> size`` and its wrapper :class:`Schedule` are in :mod:`.callable`.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any

from .._validation import (
    check_batch_size,
    check_bounds,
    check_choice,
    check_positive_int,
)
from ._adaptive import check_mapping, round_half_up
from .base import Observation
from .callable import Schedule, linear_increase_scheduler

__all__ = [
    "Constant",
    "Exponential",
    "LinearIncrease",
    "MultiplicativeStep",
    "Piecewise",
    "Schedule",
    "WarmupRamp",
    "linear_increase_scheduler",
]


class _Stateless:
    """Shared plumbing of the schedules: a name, a repr, and a state dict that holds only the name."""

    name: str

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"name": ...}``: the decision is a closed form of progress, so there is no state."""
        return {"name": self.name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Accept what :meth:`state_dict` returned (nothing to restore).

        Raises:
            ValueError: the state was saved by another controller.
        """
        check_mapping(state, self.name)
        if state.get("name", self.name) != self.name or set(state) - {"name"}:
            raise ValueError(f"this state was saved by controller {state.get('name')!r}, not {self.name!r}; build "
                             "the same controller before loading its state.")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "name")
        return f"{type(self).__name__}({args})"


class Constant(_Stateless):
    """Always the same global batch size (the baseline every adaptive controller is compared with).

    Raises:
        TypeError, ValueError: ``size`` is not an int >= 1.
    """

    def __init__(self, size: int) -> None:
        self.size = check_batch_size(size, "size")
        self.name = "Constant"

    def decide(self, obs: Observation) -> int:
        """Return ``size``."""
        return self.size


class LinearIncrease(_Stateless):
    """``min(start + increment * (step // interval), max_size)``: seed 003's linear increase in closed form.

    Equals calling :func:`linear_increase_scheduler` after every step ``1, 2, ...`` from ``start``, but
    depends only on ``obs.step``, so it survives resumes, skipped calls (``decide_every > 1``) and
    sizes clamped by the engine.

    Raises:
        TypeError, ValueError: an argument is not an int >= 1, or ``start > max_size``.
    """

    def __init__(self, start: int, increment: int, interval: int, max_size: int) -> None:
        self.start = check_batch_size(start, "start")
        self.increment = check_positive_int(increment, "increment")
        self.interval = check_positive_int(interval, "interval")
        self.max_size = check_batch_size(max_size, "max_size")
        if self.start > self.max_size:
            raise ValueError(
                f"start={self.start} is larger than max_size={self.max_size}; lower start or raise max_size."
            )
        self.name = "LinearIncrease"

    def decide(self, obs: Observation) -> int:
        """Return the size of step ``obs.step``."""
        return min(self.start + self.increment * (obs.step // self.interval), self.max_size)


class MultiplicativeStep(_Stateless):
    """``start * factor**k``, ``k`` = completed periods of ``every_steps`` steps or ``every_samples`` samples.

    Smith et al. 2018, "Don't Decay the Learning Rate, Increase the Batch Size": where a step schedule
    would divide the LR by ``a``, multiply the batch size by ``a`` instead. ``factor < 1`` shrinks the
    batch instead. The result is rounded half up and clamped to ``[min_size, max_size]`` (``min_size``
    defaults to 1).

    Raises:
        TypeError, ValueError: ``factor`` is not a finite real > 0 and != 1; not exactly one of
            ``every_steps``/``every_samples`` is given; ``factor > 1`` without ``max_size``; bad bounds;
            ``start`` outside them.
    """

    def __init__(
        self,
        start: int,
        factor: float,
        *,
        every_steps: int | None = None,
        every_samples: int | None = None,
        min_size: int | None = None,
        max_size: int | None = None,
    ) -> None:
        self.start = check_batch_size(start, "start")
        self.factor = _check_real(factor, "factor", low=0.0)
        if self.factor == 1.0:
            raise ValueError("factor=1 never changes the batch size; use Constant(start) instead.")
        self.every_steps, self.every_samples = _one_of(
            every_steps, every_samples, "every_steps", "every_samples"
        )
        self.min_size, self.max_size = check_bounds(min_size, max_size)
        if self.factor > 1 and self.max_size is None:
            raise ValueError(
                f"factor={factor!r} grows the batch without limit; pass max_size= (e.g. the largest "
                "batch that fits in memory)."
            )
        _check_inside(self.start, self.min_size, self.max_size)
        self.name = "MultiplicativeStep"

    def decide(self, obs: Observation) -> int:
        """Return the size of step ``obs.step``."""
        if self.every_steps is not None:
            k = obs.step // self.every_steps
        else:
            k = obs.samples_seen // self.every_samples  # type: ignore[operator]
        lo = self.min_size if self.min_size is not None else 1
        hi = self.max_size
        # Decide in log space first, so a huge k never overflows factor**k.
        log_size = math.log(self.start) + k * math.log(self.factor)
        if hi is not None and log_size > math.log(hi) + 1.0:
            return hi
        if log_size < math.log(lo) - 1.0:
            return lo
        return _clamp(round_half_up(self.start * self.factor**k), lo, hi)


class Exponential(_Stateless):
    """Geometric ramp ``start * (end / start) ** min(1, progress)``, rounded half up.

    ``progress = step / total_steps`` or ``samples_seen / total_samples``. The smooth counterpart of the
    LLM batch-size ramps (DeepSeek-V3 technical report, 2024: 3072 -> 15360 sequences; batch warm-up,
    Merrill et al. 2025). ``end < start`` gives a geometric decay.

    Raises:
        TypeError, ValueError: a size is not an int >= 1, or not exactly one of
            ``total_steps``/``total_samples`` is an int >= 1.
    """

    def __init__(
        self, start: int, end: int, *, total_steps: int | None = None, total_samples: int | None = None
    ) -> None:
        self.start = check_batch_size(start, "start")
        self.end = check_batch_size(end, "end")
        self.total_steps, self.total_samples = _one_of(
            total_steps, total_samples, "total_steps", "total_samples"
        )
        self.name = "Exponential"

    def decide(self, obs: Observation) -> int:
        """Return the size of step ``obs.step``."""
        if self.total_steps is not None:
            progress = obs.step / self.total_steps
        else:
            progress = obs.samples_seen / self.total_samples  # type: ignore[operator]
        if progress >= 1.0:
            return self.end
        return max(1, round_half_up(self.start * (self.end / self.start) ** max(progress, 0.0)))


class WarmupRamp(_Stateless):
    """Small batches for the first epochs, then a linear ramp to the target (seed 000, section 4.2).

    Uses ``obs.epochs_done`` (``epoch + coverage``): ``small_size`` while it is below ``warmup_epochs``,
    then linear to ``target_size`` over ``ramp_epochs`` (rounded half up), then ``target_size``.

    Raises:
        TypeError, ValueError: a size is not an int >= 1, or an epoch count is not a finite real >= 0.
    """

    def __init__(
        self,
        small_size: int,
        target_size: int,
        *,
        warmup_epochs: float = 5.0,
        ramp_epochs: float = 5.0,
    ) -> None:
        self.small_size = check_batch_size(small_size, "small_size")
        self.target_size = check_batch_size(target_size, "target_size")
        self.warmup_epochs = _check_real(warmup_epochs, "warmup_epochs", low=0.0, inclusive=True)
        self.ramp_epochs = _check_real(ramp_epochs, "ramp_epochs", low=0.0, inclusive=True)
        self.name = "WarmupRamp"

    def decide(self, obs: Observation) -> int:
        """Return the size of step ``obs.step``."""
        done = obs.epochs_done - self.warmup_epochs
        if done < 0:
            return self.small_size
        if done >= self.ramp_epochs:
            return self.target_size
        fraction = done / self.ramp_epochs
        return round_half_up(self.small_size + (self.target_size - self.small_size) * fraction)


_PIECEWISE_KEYS = ("step", "samples_seen", "epoch", "coverage")


class Piecewise(_Stateless):
    """``sizes[i]`` where ``i`` = number of ``boundaries`` <= the progress value: a staged batch ramp.

    The step-wise batch ramps of LLM training (OLMo, DeepSeek-V3) written as a table.
    ``key`` picks the progress value: ``"step"``, ``"samples_seen"``, ``"epoch"`` (``obs.epochs_done``,
    fractional) or ``"coverage"`` (fraction of the current pass; restarts every epoch).

    Example: ``Piecewise([1000, 5000], [64, 128, 256], key="step")`` gives 64 before step 1000, 128 from
    step 1000 and 256 from step 5000.

    Raises:
        TypeError, ValueError: ``len(sizes) != len(boundaries) + 1``; boundaries not finite or not
            strictly increasing (or outside ``[0, 1]`` for ``key="coverage"``); a size not an int >= 1;
            unknown ``key``.
    """

    def __init__(
        self, boundaries: Sequence[float], sizes: Sequence[int], *, key: str = "samples_seen"
    ) -> None:
        self.key = check_choice(key, "key", _PIECEWISE_KEYS)
        self.boundaries = [_check_real(b, f"boundaries[{i}]") for i, b in enumerate(boundaries)]
        self.sizes = [check_batch_size(s, f"sizes[{i}]") for i, s in enumerate(sizes)]
        if len(self.sizes) != len(self.boundaries) + 1:
            raise ValueError(
                f"Piecewise needs len(sizes) == len(boundaries) + 1 (one size before the first boundary, "
                f"one after each), got {len(self.sizes)} sizes and {len(self.boundaries)} boundaries."
            )
        for i, (a, b) in enumerate(zip(self.boundaries, self.boundaries[1:])):
            if not a < b:
                raise ValueError(
                    f"boundaries must be strictly increasing, but boundaries[{i}]={a!r} >= "
                    f"boundaries[{i + 1}]={b!r}; sort them and drop duplicates."
                )
        if self.key == "coverage" and any(not 0.0 <= b <= 1.0 for b in self.boundaries):
            raise ValueError(
                f"with key='coverage' the boundaries are fractions of an epoch in [0, 1], got "
                f"{self.boundaries}; use key='epoch' for boundaries counted in epochs."
            )
        self.name = "Piecewise"

    def decide(self, obs: Observation) -> int:
        """Return the size of step ``obs.step``."""
        if self.key == "step":
            value: float = obs.step
        elif self.key == "samples_seen":
            value = obs.samples_seen
        elif self.key == "epoch":
            value = obs.epochs_done
        else:
            value = obs.coverage
        return self.sizes[bisect_right(self.boundaries, value)]


# ----------------------------------------------------------------------------- helpers


def _clamp(value: int, lo: int, hi: int | None) -> int:
    value = max(value, lo)
    return value if hi is None else min(value, hi)


def _check_real(value: Any, name: str, *, low: float | None = None, inclusive: bool = False) -> float:
    """Return ``value`` as a finite float, optionally ``> low`` (``>= low`` with ``inclusive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}; check what produced it.")
    if low is not None and (value < low or (value == low and not inclusive)):
        relation = ">=" if inclusive else ">"
        raise ValueError(f"{name} must be {relation} {low:g}, got {value!r}.")
    return value


def _one_of(a: Any, b: Any, name_a: str, name_b: str) -> tuple[int | None, int | None]:
    """Validate that exactly one of two optional positive ints is given."""
    if (a is None) == (b is None):
        raise ValueError(
            f"pass exactly one of {name_a}= or {name_b}=, got {name_a}={a!r} and {name_b}={b!r}."
        )
    if a is not None:
        return check_positive_int(a, name_a), None
    return None, check_positive_int(b, name_b)


def _check_inside(start: int, lo: int | None, hi: int | None) -> None:
    if (lo is not None and start < lo) or (hi is not None and start > hi):
        raise ValueError(
            f"start={start} is outside [min_size={lo}, max_size={hi}]; move start inside the bounds."
        )
