"""LR schedules keyed on ``samples_seen``: step counts lose their meaning when the batch size changes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._validation import check_positive_int
from ._common import _check_optimizer, _get_lr, _rule_name, _set_lr


class SampleLRSchedule:
    """An LR schedule keyed on ``samples_seen``: ``lr = base_lr * fn(samples_seen)`` for every group.

    Step counts lose their meaning when the batch size changes; samples do not. The base LR of each group
    is its ``initial_lr`` (set from ``lr`` at construction if absent, as torch schedulers do), and
    ``fn(0)`` is applied at construction. ``fn`` itself is not saved in the state dict: build the
    schedule with the same ``fn`` before loading.

    Args:
        optimizer: Any ``torch.optim.Optimizer``.
        fn: ``samples_seen -> multiplier`` (finite, >= 0), e.g. :func:`warmup_cosine`.

    Raises:
        TypeError: ``optimizer`` has no ``param_groups`` or ``fn`` is not callable.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fn: Callable[[int], float]) -> None:
        _check_optimizer(optimizer)
        if not callable(fn):
            raise TypeError(
                f"SampleLRSchedule needs a callable samples_seen -> multiplier, got {fn!r}; "
                "pass e.g. warmup_cosine(warmup_samples, total_samples)."
            )
        self.optimizer = optimizer
        self.fn = fn
        self.base_lrs = [float(g.setdefault("initial_lr", _get_lr(g))) for g in optimizer.param_groups]
        self.samples_seen = 0
        self._last_lr: list[float] = []
        self.step(0)

    def step(self, samples_seen: int) -> None:
        """Set every group's LR for the step that starts after ``samples_seen`` samples.

        Raises:
            ValueError: ``fn`` returned something other than a finite real >= 0.
            TypeError, ValueError: ``samples_seen`` is not an int >= 0.
        """
        samples_seen = check_positive_int(samples_seen, "samples_seen", minimum=0)
        multiplier = self.fn(samples_seen)
        if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real) or not (
            math.isfinite(multiplier) and multiplier >= 0
        ):
            raise ValueError(
                f"LR schedule {_rule_name(self.fn)} returned {multiplier!r} at samples_seen={samples_seen}; "
                "it must return a finite real >= 0 (the multiplier of the base LR)."
            )
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            _set_lr(group, base * float(multiplier))
        self._last_lr = [_get_lr(g) for g in self.optimizer.param_groups]
        self.samples_seen = samples_seen

    def get_last_lr(self) -> list[float]:
        """The LRs set by the last :meth:`step`, per group."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: base LRs, the last ``samples_seen`` and the last LRs."""
        return {
            "base_lrs": list(self.base_lrs),
            "samples_seen": self.samples_seen,
            "last_lr": self.get_last_lr(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the optimizer's LRs come from its own state dict)."""
        self.base_lrs = [float(x) for x in state["base_lrs"]]
        self.samples_seen = int(state["samples_seen"])
        self._last_lr = [float(x) for x in state["last_lr"]]


@dataclass(frozen=True)
class _WarmupCosine:
    """Multiplier: linear warm-up to 1, then a half cosine to ``min_ratio`` at ``total_samples``."""

    warmup_samples: int
    total_samples: int
    min_ratio: float = 0.0

    def __call__(self, samples_seen: int) -> float:
        if samples_seen < self.warmup_samples:
            return (samples_seen + 1) / self.warmup_samples
        if samples_seen >= self.total_samples:
            return self.min_ratio
        progress = (samples_seen - self.warmup_samples) / (self.total_samples - self.warmup_samples)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class _WarmupConstant:
    """Multiplier: linear warm-up to 1 over ``warmup_samples``, then 1."""

    warmup_samples: int

    def __call__(self, samples_seen: int) -> float:
        if samples_seen < self.warmup_samples:
            return (samples_seen + 1) / self.warmup_samples
        return 1.0


def warmup_cosine(warmup_samples: int, total_samples: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """``samples_seen -> multiplier``: ``(s + 1) / warmup_samples`` while ``s < warmup_samples``, then a
    half cosine from 1 down to ``min_ratio`` at ``total_samples``, then ``min_ratio``.

    Raises:
        TypeError, ValueError: ``warmup_samples`` not an int >= 0, ``total_samples`` not an int
            > ``warmup_samples``, or ``min_ratio`` not in ``[0, 1]``.
    """
    warmup_samples = check_positive_int(warmup_samples, "warmup_samples", minimum=0)
    total_samples = check_positive_int(total_samples, "total_samples", minimum=warmup_samples + 1)
    if isinstance(min_ratio, bool) or not isinstance(min_ratio, numbers.Real) or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be a real in [0, 1] (final LR / peak LR), got {min_ratio!r}.")
    return _WarmupCosine(warmup_samples, total_samples, float(min_ratio))


def warmup_constant(warmup_samples: int) -> Callable[[int], float]:
    """``samples_seen -> multiplier``: ``(s + 1) / warmup_samples`` while ``s < warmup_samples``, then 1.

    Raises:
        TypeError, ValueError: ``warmup_samples`` is not an int >= 0.
    """
    return _WarmupConstant(check_positive_int(warmup_samples, "warmup_samples", minimum=0))


# ----------------------------------------------------------------------------- AdaScale
