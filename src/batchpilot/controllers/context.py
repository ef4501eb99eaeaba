"""Context-aware schedules (seed 003 §5.3, §7.1, §7.2): a scheduler ``(step, current_size, context) -> size``
that reads live context (task ratios, the new-to-old data ratio, sample difficulty) from a provider or from
the :class:`Observation`.

The providers that read the data are in :mod:`.context_data` (:class:`~.context_data.DataMix`,
:class:`~.context_data.DataScore`).
"""

from __future__ import annotations

import inspect
import numbers
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._adaptive import check_mapping
from .base import Observation
from .callable import _callable_name

__all__ = [
    "ContextSchedule",
    "curriculum_scheduler",
    "incremental_scheduler",
    "observation_context",
    "task_aware_scheduler",
]


# ---------------------------------------------------------------------- seed 003's three context schedulers
def task_aware_scheduler(step: int, current_size: int, task_ratios: Mapping[str, float], *, grow_task: str = "task_a",
                         grow: int = 2, shrink: int = 1, min_size: int = 8, max_size: int = 64) -> int:
    """Multi-task (seed 003 §5.3): while ``grow_task`` has the largest share of the data, grow the batch by
    ``grow`` up to ``max_size``; otherwise shrink it by ``shrink`` down to ``min_size``.

    ``task_ratios`` maps each task to its share (e.g. :class:`~.context_data.DataMix`'s). The defaults are the
    seed's; bind others with ``functools.partial``.
    """
    if not task_ratios:
        raise ValueError("task_ratios is empty; the provider must give each task's share, e.g. {'task_a': 0.7, ...}.")
    dominant = max(task_ratios, key=lambda task: task_ratios[task])
    if dominant == grow_task:
        return min(current_size + grow, max_size)
    return max(current_size - shrink, min_size)


def incremental_scheduler(step: int, current_size: int, new_data_ratio: float, *, threshold: float = 0.3,
                          grow: int = 1, shrink: int = 1, min_size: int = 8, max_size: int = 32) -> int:
    """Incremental learning (seed 003 §7.1): while new data is less than ``threshold`` of the mix, grow the batch
    by ``grow`` up to ``max_size`` (weight on old knowledge); otherwise shrink it by ``shrink`` down to
    ``min_size`` (weight on the new). The defaults are the seed's."""
    if new_data_ratio < threshold:
        return min(current_size + grow, max_size)
    return max(current_size - shrink, min_size)


def curriculum_scheduler(step: int, current_size: int, difficulty: float, *, threshold: float = 0.8,
                         shrink: int = 2, grow: int = 1, min_size: int = 4, max_size: int = 32) -> int:
    """Curriculum learning (seed 003 §7.2): hard samples (``difficulty > threshold``) get smaller batches (down by
    ``shrink`` to ``min_size``), easy ones larger (up by ``grow`` to ``max_size``). The defaults are the seed's."""
    if difficulty > threshold:
        return max(current_size - shrink, min_size)
    return min(current_size + grow, max_size)


# ---------------------------------------------------------------------- the context
def observation_context(obs: Observation) -> dict[str, Any]:
    """What a :class:`ContextSchedule` without a provider passes: the observation's fields (``step``,
    ``samples_seen``, ``epoch``, ``coverage``, ``epochs_done``, ``batch_size``, ``num_samples``, ``losses``,
    ``loss`` (the last step's, or ``None``), ``samples_per_s``) and its ``stats`` under their own names
    (``stats/noise_scale``, ``grad/norm``, ...)."""
    context: dict[str, Any] = {
        "step": obs.step, "samples_seen": obs.samples_seen, "epoch": obs.epoch, "coverage": obs.coverage,
        "epochs_done": obs.epochs_done, "batch_size": obs.batch_size, "num_samples": obs.num_samples,
        "losses": obs.losses, "loss": obs.losses[-1] if obs.losses else None, "samples_per_s": obs.samples_per_s,
    }
    context.update(obs.stats or {})
    return context


def _check_signature(fn: Callable[..., Any], args: tuple[Any, ...], role: str, shape: str, fix: str) -> None:
    """Refuse a callable that cannot take ``args`` now, not after the first training step."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin whose signature Python cannot read: accepted as it is
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise TypeError(f"a {role} is called as {shape}, but {_callable_name(fn)}{signature} cannot be called that "
                        f"way ({exc}); {fix}") from None


def _short(value: Any) -> str:
    """A context value for the ``reason`` text: floats to 4 significant digits, mappings entry by entry."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return f"{float(value):.4g}"
    return repr(value)


class ContextSchedule:
    """A schedule that reads live context: ``fn(step, current_size, context) -> size`` (seed 003 §5.3, §7.1, §7.2).

    ``context`` is a read-only mapping: the observation's fields and statistics (:func:`observation_context`),
    plus what ``provider()`` returns when there is a provider (task ratios, the data mix, difficulty: e.g.
    :class:`~batchpilot.controllers.DataMix` or :class:`~batchpilot.controllers.DataScore`, which read the
    samples the next step trains, or any zero-argument callable returning a mapping). With ``key``, ``fn`` gets
    only ``context[key]``, which is how seed 003's functions take it (:func:`task_aware_scheduler` takes
    ``task_ratios``, :func:`incremental_scheduler` ``new_data_ratio``, :func:`curriculum_scheduler` ``difficulty``).

    Whatever ``fn`` returns goes through the engine's decision boundary
    (:func:`~batchpilot.controllers.validate_decision`): 0, negatives, NaN, bools and fractions raise
    ``InvalidDecisionError`` naming the schedule and the value (or keep the size with ``on_invalid="keep"``),
    and sizes outside ``[min_batch_size, max_batch_size]`` are clamped. Like every controller it is called on
    rank 0 only and its answer is broadcast, so all ranks train the same size; the context is rank 0's (the
    data providers read the global order and position, the same on every rank).

    Args:
        fn: The scheduler, e.g. ``functools.partial(curriculum_scheduler, max_size=64)``.
        provider: A zero-argument callable returning a mapping of context entries (``None``: the observation
            only). Called once per decision. Its keys must not repeat the observation's.
        key: Pass ``fn`` only this entry of the context instead of the whole mapping.
        name: Name for logs and errors; default: ``fn``'s name.
        required_stats: Statistics ``fn`` reads from the context (e.g. ``("stats/noise_scale",)``): the engine then
            measures them (as for ``NoiseScale``), which it does not do for a schedule by default.

    Attributes:
        last_context: The context of the last decision (a read-only mapping), ``None`` before the first.
        reason: What the last decision was made from, for the adjustment log.

    Raises:
        TypeError: ``fn`` cannot be called with three arguments, ``provider`` is not callable without arguments,
            or ``key``/``name`` is not a string.
    """

    def __init__(self, fn: Callable[[int, int, Any], Any], provider: Callable[[], Mapping[str, Any]] | None = None,
                 *, key: str | None = None, name: str | None = None, required_stats: Sequence[str] = ()) -> None:
        if not callable(fn):
            raise TypeError(f"ContextSchedule needs a callable (step, current_size, context) -> size, got {fn!r} of "
                            f"type {type(fn).__name__}; pass a function or a functools.partial of one.")
        _check_signature(fn, (0, 1, {}), "context schedule", "fn(step, current_size, context)",
                         "give it three parameters, or wrap it: lambda step, size, context: ...")
        if provider is not None:
            if not callable(provider):
                raise TypeError(f"provider must be a zero-argument callable returning a mapping, or None; got "
                                f"{provider!r} of type {type(provider).__name__}.")
            _check_signature(provider, (), "context provider", "provider()",
                             "it takes no arguments and returns a mapping, e.g. lambda: {'difficulty': d.value}")
        for value, what in ((key, "key"), (name, "name")):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{what} must be a str or None, got {value!r} of type {type(value).__name__}.")
        if isinstance(required_stats, str) or not all(isinstance(k, str) for k in required_stats):
            raise TypeError(f"required_stats must be a sequence of statistic names, e.g. ('stats/noise_scale',); got "
                            f"{required_stats!r}.")
        self.fn, self.provider, self.key = fn, provider, key
        self.required_stats = tuple(required_stats)
        self.name = name if name is not None else _callable_name(fn)
        self.last_context: Mapping[str, Any] | None = None
        self.reason = "no decision yet"

    def context(self, obs: Observation) -> Mapping[str, Any]:
        """The context of a decision made from ``obs``: the observation's entries and the provider's (called now).

        Raises:
            TypeError: the provider returned something that is not a mapping with string keys.
            ValueError: a provider key repeats an observation field or statistic.
        """
        return types.MappingProxyType(self._context(obs)[0])

    def _context(self, obs: Observation) -> tuple[dict[str, Any], Mapping[str, Any]]:
        context = observation_context(obs)
        given: Mapping[str, Any] = {}
        if self.provider is not None:
            given = self.provider()
            if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
                raise TypeError(f"{self.name}'s context provider {_callable_name(self.provider)} returned {given!r}; "
                                "it must return a mapping with string keys, e.g. {'difficulty': 0.4}.")
            clash = sorted(set(given) & set(context))
            if clash:
                raise ValueError(f"{self.name}'s context provider returned {clash}, which the observation already "
                                 "provides (see observation_context); give its entries other names.")
            context.update(given)
        return context, given

    def decide(self, obs: Observation) -> Any:
        """Return ``fn(obs.step, obs.batch_size, context)`` (or ``context[key]``), validated by the engine.

        Raises:
            KeyError: ``key`` is not in the context (the message lists what is).
        """
        context, given = self._context(obs)
        self.last_context = types.MappingProxyType(context)
        if self.key is None:
            value: Any = self.last_context
            shown = _short(given) if given else "the observation"
        else:
            if self.key not in context:
                raise KeyError(f"{self.name} reads context[{self.key!r}], which is missing; the context has "
                               f"{sorted(context)}. Fix the provider or key=.")
            value = context[self.key]
            shown = f"{self.key}={_short(value)}"
        decided = self.fn(obs.step, obs.batch_size, value)
        self.reason = f"{shown} -> {decided!r}"[:300]
        return decided

    def state_dict(self) -> dict[str, Any]:
        """``{"name": ...}``, plus ``fn``'s and the provider's own state (``"fn"``, ``"provider"``) if they have
        ``state_dict``; the schedule itself keeps nothing between decisions."""
        state: dict[str, Any] = {"name": self.name}
        for part, obj in (("fn", self.fn), ("provider", self.provider)):
            if callable(getattr(obj, "state_dict", None)):
                state[part] = obj.state_dict()  # type: ignore[union-attr]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``fn``'s and the provider's state if they have any.

        Raises:
            ValueError: the state holds more than a context schedule's (another controller saved it).
        """
        check_mapping(state, self.name)
        extra = set(state) - {"name", "fn", "provider"}
        if extra:
            raise ValueError(f"this state was saved by controller {state.get('name')!r} (it holds {sorted(extra)}), "
                             "not by a ContextSchedule; build the same controller before loading its state.")
        for part, obj in (("fn", self.fn), ("provider", self.provider)):
            if part in state and callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(state[part])  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"ContextSchedule({self.fn!r}, provider={self.provider!r}, key={self.key!r}, name={self.name!r})"
