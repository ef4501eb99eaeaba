"""Seed 003's scheduler API: any callable ``(step, current_size) -> size`` as a controller (:class:`Schedule`),
and seed 003's :func:`linear_increase_scheduler`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ._adaptive import check_mapping
from .base import Observation

__all__ = ["Schedule", "linear_increase_scheduler"]


def linear_increase_scheduler(
    step: int, current_size: int, interval: int = 100, max_size: int = 32, increment: int = 2
) -> int:
    """Grow the batch by ``increment`` every ``interval`` steps, up to ``max_size`` (seed 003, verbatim).

    Meant to be bound with ``functools.partial(linear_increase_scheduler, interval=50, max_size=64,
    increment=4)`` and wrapped in :class:`Schedule`. Note that it increments at step 0 too, and that it
    only fires when it is called on a multiple of ``interval``; :class:`LinearIncrease` is the closed form
    that does not depend on being called every step.
    """
    if step % interval == 0 and current_size < max_size:
        return min(current_size + increment, max_size)
    return current_size


def _check_two_arguments(fn: Callable[..., Any]) -> None:
    """Refuse a callable that cannot be called as ``fn(step, current_size)`` (else it would fail only after the
    first training step); one whose signature Python cannot read (some builtins) is accepted as it is."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(0, 1)
    except TypeError as exc:
        raise TypeError(
            f"a schedule is called as fn(step, current_size) -> size, but {_callable_name(fn)}{signature} cannot "
            f"take those two arguments ({exc}); give it two parameters, or wrap it: lambda step, size: ..."
        ) from None


class Schedule:
    """Wrap any callable ``fn(step, current_size) -> size`` as a controller (seed 003's scheduler API).

    ``decide`` returns ``fn(obs.step, obs.batch_size)`` untouched: the engine's ``validate_decision``
    boundary rejects or clamps whatever it returns. The wrapper is stateless; if ``fn`` itself has
    ``state_dict``/``load_state_dict`` they are delegated to.

    Args:
        fn: The schedule, e.g. ``functools.partial(linear_increase_scheduler, interval=50, max_size=64,
            increment=4)``.
        name: Name for logs; default: the function's name (looking through ``functools.partial``).

    Raises:
        TypeError: ``fn`` is not callable or ``name`` is not a string.
    """

    def __init__(self, fn: Callable[[int, int], Any], *, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(
                f"Schedule needs a callable (step, current_size) -> size, got {fn!r} of type "
                f"{type(fn).__name__}; pass a function or a functools.partial of one."
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {name!r}; pass e.g. name='my_schedule'.")
        _check_two_arguments(fn)
        self.fn = fn
        self.name = name if name is not None else _callable_name(fn)

    def decide(self, obs: Observation) -> Any:
        """Return ``fn(obs.step, obs.batch_size)`` (validated by the engine, not here)."""
        return self.fn(obs.step, obs.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"name": ...}``, plus ``fn``'s own state under ``"fn"`` if it has any."""
        state: dict[str, Any] = {"name": self.name}
        if callable(getattr(self.fn, "state_dict", None)):
            state["fn"] = self.fn.state_dict()  # type: ignore[attr-defined]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``fn``'s own state if it has any; the wrapper itself is stateless.

        Raises:
            ValueError: the state holds more than a schedule's (another controller saved it).
        """
        check_mapping(state, self.name)
        if set(state) - {"name", "fn"}:
            raise ValueError(f"this state was saved by controller {state.get('name')!r} (it holds "
                             f"{sorted(set(state) - {'name', 'fn'})}), not by a Schedule; build the same controller "
                             "before loading its state.")
        if "fn" in state and callable(getattr(self.fn, "load_state_dict", None)):
            self.fn.load_state_dict(state["fn"])  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"Schedule({self.fn!r}, name={self.name!r})"



def _callable_name(fn: Callable[..., Any]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__name__", type(fn).__name__))
