"""Input checks shared by every public entry point.

Every error names the offending value, the rule it broke and how to fix it (STYLE.md rule 7).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

_Choice = TypeVar("_Choice")


def check_positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= ``minimum``.

    Raises:
        TypeError: ``value`` is a bool, a float, a string or anything else that is not an integer.
        ValueError: ``value`` is NaN or smaller than ``minimum``.
    """
    if isinstance(value, bool):
        raise TypeError(
            f"{name} must be an int, got the bool {value!r}; pass a whole number such as {max(minimum, 1)}."
        )
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif isinstance(value, numbers.Real) and math.isnan(float(value)):
        raise ValueError(f"{name} must be an int >= {minimum}, got NaN; check what produced it.")
    elif isinstance(value, numbers.Real) and float(value).is_integer():
        raise TypeError(
            f"{name} must be an int, got the float {value!r}; pass int({value!r}) = {int(float(value))} instead."
        )
    else:
        raise TypeError(
            f"{name} must be an int >= {minimum}, got {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (a truthy int or string is a mistake, not a flag).

    Raises:
        TypeError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return value


def check_batch_size(value: Any, name: str = "batch_size") -> int:
    """Validate a batch size: an int >= 1 (bools, floats, NaN, 0 and negatives are rejected)."""
    return check_positive_int(value, name, minimum=1)


def check_bounds(min_size: int | None, max_size: int | None,
                 names: tuple[str, str] = ("min_size", "max_size")) -> tuple[int | None, int | None]:
    """Validate optional ``[min_size, max_size]`` bounds on the global batch size (``names``: the caller's
    argument names, for the message)."""
    lo_name, hi_name = names
    lo = None if min_size is None else check_batch_size(min_size, lo_name)
    hi = None if max_size is None else check_batch_size(max_size, hi_name)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(
            f"{lo_name}={lo} is larger than {hi_name}={hi}: impossible bounds; swap them or widen {hi_name}."
        )
    return lo, hi


def check_choice(value: Any, name: str, choices: tuple[_Choice, ...]) -> _Choice:
    """Validate that ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")
    return value


def collect_problems(**checks: Callable[[], Any]) -> list[str]:
    """Run every check and return the messages of those that raised TypeError/ValueError, so that a
    constructor can report all problems at once (STYLE.md rule 5)."""
    problems = []
    for check in checks.values():
        try:
            check()
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    return problems
