"""`SizeDriver`: the one decision path, shared by `Pilot` and the framework integrations.

A training loop (the Pilot's, or a framework's) counts its steps here and asks, between two optimizer steps,
"what is the global batch size of the next step?": the driver builds the :class:`Observation`, rank 0 asks the
controller, :func:`validate_decision` checks and bounds the answer, and every rank receives the broadcast
value, so all ranks cut the same global batches. The caller hands it to its loader. The driver never touches
data or models.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from .. import distributed as bpdist
from .._validation import (
    check_batch_size,
    check_bounds,
    check_choice,
    check_positive_int,
)
from ..controllers.base import Controller, Observation
from ..controllers.boundary import as_controller, controller_name, validate_decision

_FORMAT = "batchpilot.integrations.SizeDriver"
logger = logging.getLogger("batchpilot")


class Decision(NamedTuple):
    """One answer of the decision path: the next step's global batch size, who set it (``"user"`` for a
    :meth:`SizeDriver.next_size` override, else the controller's name), and what was changed (``None``: used as is)."""

    global_batch_size: int
    source: str
    note: str | None


@dataclass(frozen=True)
class BackOff:
    """After a rollback (:mod:`.guard`): until step ``until_step`` the controller's decisions that go as far as the
    size that failed, or beyond it (``>= failed_size`` when growing to it failed, ``<= failed_size`` when shrinking
    to it did), keep the current size instead. ``set_batch_size()`` is not bounded."""

    failed_size: int
    restored_size: int
    until_step: int
    noted: bool = False  # whether a refusal was logged (one line per back-off)

    def refuses(self, size: int, step: int) -> bool:
        """Whether a decision of ``size`` made after ``step`` steps is refused."""
        if step >= self.until_step:
            return False
        grew = self.failed_size > self.restored_size
        return size >= self.failed_size if grew else size <= self.failed_size


class SizeDriver:
    """Keep the counters a controller observes and turn its answers into validated, broadcast sizes.

    Args:
        controller: A controller, a seed-003 callable, or ``None`` (the size never changes).
        batch_size: Global batch size of the first step.
        num_samples: Dataset length.
        min_batch_size, max_batch_size: Every decision is clamped to these bounds.
        decide_every: Ask the controller after every ``decide_every``-th step.
        on_invalid: ``"raise"`` or ``"keep"`` (see :func:`~batchpilot.controllers.validate_decision`).
        loss_history: How many recent step losses an :class:`~batchpilot.Observation` carries.
        rank: This process's rank (only rank 0 calls the controller).
        names: How the integration calls the controller and the first size, for error messages.
        world_size: Ranks the decision is broadcast to (``None``: the process group, if there is one; 1: none,
            this process trains on its own).
        label: How the other ranks' error names the controller that failed on rank 0.

    Raises:
        TypeError, ValueError: an argument is invalid (all problems in one message).
    """

    def __init__(
        self,
        controller: Controller | Callable[[int, int], int] | None,
        *,
        batch_size: int,
        num_samples: int,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        decide_every: int = 1,
        on_invalid: str = "raise",
        loss_history: int = 50,
        rank: int = 0,
        names: tuple[str, str] = ("batch_size_scheduler", "per_device_train_batch_size"),
        world_size: int | None = None,
        label: str = "batch size controller",
    ) -> None:
        problems = []
        for check in (
            lambda: check_batch_size(batch_size),
            lambda: check_bounds(min_batch_size, max_batch_size, ("min_batch_size", "max_batch_size")),
            lambda: check_positive_int(decide_every, "decide_every"),
            lambda: check_choice(on_invalid, "on_invalid", ("raise", "keep")),
            lambda: check_positive_int(loss_history, "loss_history"),
            lambda: as_controller(controller, names[0]),
        ):
            try:
                check()
            except (TypeError, ValueError) as exc:
                problems.append(str(exc))
        if not problems and (
            (min_batch_size is not None and batch_size < min_batch_size)
            or (max_batch_size is not None and batch_size > max_batch_size)
        ):
            problems.append(
                f"the initial global batch size {batch_size} lies outside [min_batch_size={min_batch_size}, "
                f"max_batch_size={max_batch_size}]; change {names[1]} or the bounds."
            )
        if problems:
            raise ValueError("invalid batch size settings:\n  - " + "\n  - ".join(problems))
        self.controller = as_controller(controller)
        self.initial_batch_size = batch_size
        self.num_samples = num_samples
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self.decide_every = decide_every
        self.on_invalid = on_invalid
        self.rank = rank
        self.world_size, self.label = world_size, label
        self.step = 0
        self.samples_seen = 0
        self.losses: collections.deque[float] = collections.deque(maxlen=loss_history)
        self.samples_per_s: float | None = None
        self.last_decision: dict[str, Any] | None = None
        self.min_useful = 1  # world size x micro-batches per step: smaller sizes leave micro-batches empty
        # The last rollback's bound on the controller's decisions, and the rollbacks so far (each doubles the next
        # cooldown); a Pilot's rollback guard saves and loads them (engine/guard.py).
        self.backoff: BackOff | None = None
        self.rollback_failures = 0
        self._warned_small = False
        self._clock: float | None = None

    # ------------------------------------------------------------------ counters
    def start_clock(self) -> None:
        """Start timing the next step (call after anything that is not training, e.g. evaluation)."""
        self._clock = time.perf_counter()

    def end_step(self, global_batch_size: int, loss: float | None, *, finite_only: bool = True) -> float:
        """Count a finished optimizer step of ``global_batch_size`` samples and its mean loss (``None``: none
        to record; ``finite_only=False`` records a non-finite one too); return its seconds since the clock
        started (0.0 without a clock)."""
        self.step += 1
        self.samples_seen += global_batch_size
        if loss is not None and (math.isfinite(loss) or not finite_only):
            self.losses.append(float(loss))
        now = time.perf_counter()
        seconds = 0.0 if self._clock is None else now - self._clock
        if self._clock is not None and now > self._clock:
            rate = global_batch_size / (now - self._clock)
            self.samples_per_s = rate if self.samples_per_s is None else 0.9 * self.samples_per_s + 0.1 * rate
        self._clock = now
        return seconds

    def restore_counters(self, step: int, samples_seen: int, losses: Any, samples_per_s: float | None) -> None:
        """Set the counters to a saved run's (the controller's state is loaded on its own)."""
        self.step, self.samples_seen, self.samples_per_s = step, samples_seen, samples_per_s
        self.losses = collections.deque(losses, maxlen=self.losses.maxlen)

    # ------------------------------------------------------------------ decisions
    def decide(self, global_batch_size: int, *, epoch: int, coverage: float,
               stats: Mapping[str, float] | None = None) -> int:
        """Return the global batch size of the next step (this one's: ``global_batch_size``); equal on every rank.

        Every rank must call this after every step (it is a collective when the controller is consulted).

        Raises:
            InvalidDecisionError: the controller returned an unusable size and ``on_invalid="raise"``.
            RuntimeError: rank 0's controller failed (raised on the other ranks).
        """
        decided = self.next_size(global_batch_size, epoch=epoch, coverage=coverage, stats=stats)
        return global_batch_size if decided is None else decided.global_batch_size

    def due(self) -> bool:
        """Whether the controller is asked after the current step (one of every ``decide_every``)."""
        return self.controller is not None and self.step % self.decide_every == 0

    def next_size(self, global_batch_size: int, *, epoch: int, coverage: float,
                  stats: Mapping[str, float] | None = None, override: int | None = None,
                  on_failure: Callable[[BaseException], None] | None = None) -> Decision | None:
        """The next step's :class:`Decision` (this one's size: ``global_batch_size``), or ``None`` when nothing
        decides after this step.

        ``override`` (a size the user set during the step) replaces the controller's answer; it is bounded like
        one, and broadcast only when the controller is due (rank 0's then wins). ``on_failure(error)`` runs on
        every rank before the controller's failure is raised (e.g. to save the finished step).

        Raises:
            InvalidDecisionError: the controller returned an unusable size and ``on_invalid="raise"``.
            RuntimeError: rank 0's controller failed (raised on the other ranks).
        """
        due = self.due()
        if override is None and not due:
            return None
        source = "user" if override is not None else controller_name(self.controller)
        decided, note = global_batch_size, None
        if self.rank == 0 or not due:
            try:
                if override is not None:
                    decided, note = validate_decision(override, current=global_batch_size,
                                                      min_size=self.min_batch_size, max_size=self.max_batch_size,
                                                      source="set_batch_size()")
                    note = note or "set_batch_size() override"
                else:
                    assert self.controller is not None  # due
                    decided, note = validate_decision(
                        self.controller.decide(self.observation(global_batch_size, epoch=epoch, coverage=coverage,
                                                                stats=stats)),
                        current=global_batch_size,
                        min_size=self.min_batch_size,
                        max_size=self.max_batch_size,
                        on_invalid=self.on_invalid,
                        source=source,
                    )
                    b = self.backoff
                    if b is not None and decided != global_batch_size and b.refuses(decided, self.step):
                        decided, note = global_batch_size, None if b.noted else (  # logged once per back-off
                            f"{source} asked for {decided}; kept {global_batch_size}: back-off after the rollback "
                            f"from {b.failed_size} (until step {b.until_step})")
                        self.backoff = replace(b, noted=True)
            except Exception as exc:
                if due:
                    self._broadcast(-1)  # the other ranks wait in the broadcast: tell them to stop too
                    if on_failure is not None:
                        on_failure(exc)
                raise
        if due:
            decided = self._broadcast(decided)
            if decided < 1:
                error = RuntimeError(f"rank 0's {self.label} failed (see rank 0's error); stopping this rank too.")
                if on_failure is not None:
                    on_failure(error)
                raise error
        if decided < self.min_useful and not self._warned_small:
            self._warned_small = True
            logger.warning(
                "batch size %d is smaller than the %d micro-batches of a step (world size x accumulation): some "
                "micro-batches carry no sample of their own and run at weight 0; min_batch_size=%d avoids that.",
                decided, self.min_useful, self.min_useful,
            )
        if decided != global_batch_size or note is not None:
            self.last_decision = {
                "step": self.step, "samples_seen": self.samples_seen, "old_size": global_batch_size,
                "new_size": decided, "note": note,
            }
        return Decision(decided, source, note)

    def observation(self, global_batch_size: int, *, epoch: int, coverage: float,
                    stats: Mapping[str, float] | None = None) -> Observation:
        """What the controller sees after the current step, whose size was ``global_batch_size``."""
        return Observation(
            step=self.step,
            samples_seen=self.samples_seen,
            epoch=epoch,
            coverage=coverage,
            batch_size=global_batch_size,
            num_samples=self.num_samples,
            losses=tuple(self.losses),
            samples_per_s=self.samples_per_s,
            stats=dict(stats or {}),
        )

    def back_off(self, failed_size: int, restored_size: int, cooldown: int) -> BackOff:
        """Bound the controller's decisions after a rollback from ``failed_size`` to ``restored_size`` (call it
        on every rank, after the restore) for ``cooldown`` steps, doubled for each earlier rollback; return the
        bound. A bound still in force from an earlier rollback in the same direction stays when it is tighter."""
        until = self.step + cooldown * 2 ** min(self.rollback_failures, 30)
        self.rollback_failures += 1
        old = self.backoff
        if old is not None and self.step < old.until_step and \
                (old.failed_size > old.restored_size) == (failed_size > restored_size):
            tighter = min if failed_size > restored_size else max
            failed_size = tighter(failed_size, old.failed_size)
        self.backoff = BackOff(failed_size, restored_size, until)
        return self.backoff

    def _broadcast(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (no collective when this process trains on its own)."""
        return value if self.world_size == 1 else bpdist.broadcast_int(value)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters, loss history, throughput and the controller's state (JSON-serialisable if the
        controller's state is)."""
        return {
            "format": _FORMAT,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "losses": list(self.losses),
            "samples_per_s": self.samples_per_s,
            "controller": None if self.controller is None else self.controller.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: ``state`` is not a driver state.
        """
        if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
            raise ValueError("not a batchpilot SizeDriver state; pass what SizeDriver.state_dict() returned.")
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.losses = collections.deque((float(x) for x in state["losses"]), maxlen=self.losses.maxlen)
        self.samples_per_s = state["samples_per_s"]
        if self.controller is not None and state["controller"] is not None:
            self.controller.load_state_dict(state["controller"])


def decision_record(*, step: int, samples_seen: int, global_batch_size: int, decided: int, source: str, reason: Any,
                    note: str | None, record: dict[str, Any]) -> dict[str, Any]:
    """A decision's line in the adjustment log: ``global_batch_size`` is that of ``step``, ``decided`` that of the
    next (logged as ``old_size`` and ``new_size``)."""
    return {
        "step": step,
        "samples_seen": samples_seen,
        "old_size": global_batch_size,
        "new_size": decided,
        "controller": source,
        "reason": reason,
        "note": note,
        "inputs": {k: record.get(k) for k in ("loss", "perf/samples_per_s", "epoch", "coverage", "grad/norm")},
    }
