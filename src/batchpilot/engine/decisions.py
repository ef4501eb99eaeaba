"""A `Pilot`'s end of the decision path (:class:`Decisions`) and what a controller observes after a step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..controllers.boundary import validate_decision
from ..data.loader import AdaptiveDataLoader
from .driver import Decision, SizeDriver, decision_record
from .tokens import micro_bound


def observed_stats(record: Mapping[str, Any], *, world_size: int, max_micro_batch_size: int | None,
                   rank_weights: Sequence[float] | None = None) -> dict[str, Any]:
    """The ``stats`` a controller observes after a step: the step record's statistics (``stats/``, ``grad/``,
    ``perf/``, ``system/``), the world size, rank 0's share of the global batch when ``rank_weights`` make the
    shares uneven (its step times are the ones measured), and the micro-batch bound when there is one."""
    stats = {k: v for k, v in record.items() if k.startswith(("stats/", "grad/", "perf/", "system/"))}
    stats["dist/world_size"] = world_size
    if rank_weights is not None and len(rank_weights) == world_size > 1:
        stats["dist/lead_share"] = float(rank_weights[0]) / float(sum(rank_weights))
    if max_micro_batch_size is not None:
        stats["perf/max_micro_batch_size"] = max_micro_batch_size
    return stats


class Decisions:
    """A `Pilot`'s end of the decision path: the sizes it trains, set on its loader and logged.

    After each step the driver decides (a ``set_batch_size()`` made during the step overrides the
    controller); between steps a ``set_batch_size()`` applies at once. Every change goes to the adjustment log
    with the controller's reason and the step's inputs.

    Args:
        log: Writes a decision record (the adjustment log).
        on_failure: Runs on every rank before a failed decision is raised (see :meth:`SizeDriver.next_size`).
    """

    def __init__(self, driver: SizeDriver, loader: AdaptiveDataLoader, *, log: Callable[[dict[str, Any]], None],
                 on_failure: Callable[[BaseException], None]) -> None:
        self.driver, self.loader, self.log, self.on_failure = driver, loader, log, on_failure
        self.override: int | None = None  # a set_batch_size() made inside the step
        self.last_decision: dict[str, Any] | None = None

    def after_step(self, record: dict[str, Any]) -> Decision | None:
        """Set the next step's size: the override made inside the step, else the controller's when due; return
        the decision (``None``: nothing decided)."""
        global_batch_size, driver = self.loader.batch_size, self.driver
        override, self.override = self.override, None
        if override is None and not driver.due():
            return None  # nothing decides after this step: no observation to build (the common case's cost)
        stats = observed_stats(record, world_size=driver.world_size or 1,
                               max_micro_batch_size=micro_bound(self.loader),  # (in tokens: engine/tokens.py)
                               rank_weights=self.loader.sampler.rank_weights)
        decided = driver.next_size(global_batch_size, epoch=record["epoch"], coverage=record["coverage"], stats=stats,
                                   override=override, on_failure=self.on_failure)
        if decided is not None:
            self.record(global_batch_size, decided.global_batch_size, decided.source, decided.note, record)
            self.loader.set_batch_size(decided.global_batch_size)
        return decided

    def set_between_steps(self, requested: int, record: dict[str, Any]) -> None:
        """Apply a ``set_batch_size(requested)`` made between steps, bounded like a decision (it replaces an
        override made in a step the loop left unfinished)."""
        self.override = None
        global_batch_size = self.loader.batch_size
        decided, note = validate_decision(requested, current=global_batch_size, min_size=self.driver.min_batch_size,
                                          max_size=self.driver.max_batch_size, source="set_batch_size()")
        self.record(global_batch_size, decided, "user", note, record)
        self.loader.set_batch_size(decided)

    def record(self, global_batch_size: int, decided: int, source: str, note: str | None,
               record: dict[str, Any]) -> None:
        """Log a change from the ``global_batch_size`` of the step of ``record`` to the ``decided`` one of the
        next (or a note on keeping it)."""
        if decided == global_batch_size and note is None:
            return
        reason = getattr(self.driver.controller, "reason", None) if source != "user" else None
        self.last_decision = decision_record(step=self.driver.step, samples_seen=self.driver.samples_seen,
                                             global_batch_size=global_batch_size, decided=decided, source=source,
                                             reason=reason, note=note, record=record)
        self.log(self.last_decision)
