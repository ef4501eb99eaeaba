"""Helpers shared by the LR modules."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

LRRule = str | Callable[[float], float]
"""``"none"``, ``"linear"``, ``"sqrt"``, ``"linear-then-sqrt"`` or a callable ``ratio -> factor``."""

RULES = ("none", "linear", "sqrt", "linear-then-sqrt")


def _check_stat(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number (from the noise-scale estimator), got {value!r} of type "
            f"{type(value).__name__}."
        )
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}; until it is measured pass None to AdaScaleLR.gain_for(size, ...), which then returns min(1, size / base_batch_size).")
    return float(value)


# ----------------------------------------------------------------------------- helpers


def check_rule(rule: Any, name: str = "lr rule", also: tuple[str, ...] = ()) -> LRRule:
    """``rule`` if it is one of ``RULES`` (or of ``also``, names the caller handles itself) or a callable."""
    if callable(rule) or (isinstance(rule, str) and rule in RULES + also):
        return rule
    raise ValueError(
        f"unknown {name} {rule!r}; use one of {', '.join(map(repr, RULES + also))} "
        "or a callable batch_ratio -> lr_factor."
    )


def _rule_name(fn: Any) -> str:
    return str(getattr(fn, "__name__", repr(fn)))


def _check_optimizer(optimizer: Any) -> None:
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"expected a torch.optim.Optimizer (with param_groups), got {type(optimizer).__name__}."
        )


def _get_lr(group: Mapping[str, Any]) -> float:
    return float(group["lr"])


def _set_lr(group: dict[str, Any], value: float) -> None:
    # Tensor LRs (capturable / compiled optimizers) are updated in place so references stay valid.
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(value)
    else:
        group["lr"] = value
