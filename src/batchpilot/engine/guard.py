"""The rollback guard: a change of size the controller made is watched, and undone when training breaks after it.

Just before the first step at a size the controller changed to, the guard takes an in-memory snapshot
(:mod:`.snapshot`). For the next ``rollback_window`` steps it watches the step losses. A non-finite loss, a step
skipped for non-finite gradients, or a loss spike (:class:`SpikeRule`) restores the snapshot (model, optimizer, data
position, RNG, counters: the discarded steps' samples are trained again, so every epoch still sees every sample
once), puts the old size back, and backs off: for a cooldown the controller may not go as far as the failed size
again (:class:`~batchpilot.engine.driver.BackOff`; the cooldown doubles with each rollback). A controller with an
``on_rollback(from_size, to_size, step)`` method is told. The log gets a decision record with
``"decision/rollback": true``; the steps it discarded keep their lines. Rank 0 decides; all ranks restore together.
docs/rollback.md has the reasoning behind the defaults.
"""

from __future__ import annotations

import logging
import math
import numbers
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import distributed as bpdist
from .driver import BackOff
from .snapshot import restore_snapshot, take_snapshot

__all__ = ["RollbackGuard", "SpikeRule", "check_rollback_settings"]

logger = logging.getLogger("batchpilot")

NOISE_SIGMAS = 4.0
"""A spike must clear the reference median by this many noise standard deviations, as well as by the factor."""
PATIENCE = 7
"""A spike is a median of the last this many watched steps above the threshold: a short bump (a few noisy or
transient steps) never rolls back, a sustained rise does within about half of it."""
REFERENCE = 50
"""The losses before the change the rule is measured on (at most; the driver keeps ``loss_history`` of them)."""
MIN_REFERENCE = 5
"""Finite losses before the change that the spike rule needs (with fewer, only non-finite steps roll back)."""
START = 10
"""The run's first finite step losses, whose median is its starting loss (the progress a spike may undo)."""
_REASONS = ("", "non-finite step", "loss spike")


def check_rollback_settings(rollback: Any, window: Any, spike: Any, cooldown: Any) -> None:
    """Check the ``rollback*`` settings of :class:`~batchpilot.engine.config.DecisionConfig`.

    Raises:
        TypeError, ValueError: a setting is invalid (the message names it, the value and what to pass).
    """
    if rollback is not None and not isinstance(rollback, bool):
        raise TypeError(f"rollback must be None (on for adaptive controllers), True or False; got {rollback!r}.")
    for name, value in (("rollback_window", window), ("rollback_cooldown", cooldown)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (steps), got {value!r}; the default is "
                             f"{100 if name == 'rollback_window' else 200}.")
    if isinstance(spike, bool) or not isinstance(spike, numbers.Real) or not math.isfinite(spike) or spike <= 1:
        raise ValueError(f"rollback_spike must be a finite number > 1 (a loss this many times the median before the "
                         f"change is a spike), got {spike!r}; the default is 2.0.")


@dataclass(frozen=True)
class SpikeRule:
    """How high a watched step's loss is: ``score = (loss - median) / allowance(B)``, with

    ``allowance(B) = max(min((spike - 1) |median|, (start - median) / 2), NOISE_SIGMAS sigma_B)``.

    ``median`` and ``sigma`` (1.4826 x the median absolute deviation: a standard deviation that a few outliers do
    not move) are those of the finite losses of the last :data:`REFERENCE` steps before the change, at
    ``reference_size``; ``start`` is the run's starting loss (the median of its first :data:`START` losses; the
    half-progress term drops out when it is unknown or not above the median). So a loss is high when it rose by the
    factor, or undid half the progress since the start (a collapse to chance level from a loss not yet half of
    it), and in either case by more than its noise. A step loss is a mean over ``B`` samples, so its noise scales
    as ``1/sqrt(B)``: after a shrink ``sigma_B = sigma sqrt(reference_size / B)``; after a growth the reference's
    larger noise is kept, erring on the quiet side. While the loss falls, the median of the steps before lies
    above the current level, which only makes a spike harder to reach. A spike is a median score above 1 over the
    last :data:`PATIENCE` watched steps.
    """

    median: float
    sigma: float
    reference_size: int
    spike: float
    start: float | None = None

    @classmethod
    def from_losses(cls, losses: Sequence[float], reference_size: int, spike: float,
                    start: float | None = None) -> SpikeRule | None:
        """The rule for these losses before the change (``None``: fewer than :data:`MIN_REFERENCE` finite ones)."""
        finite = [x for x in losses if math.isfinite(x)][-REFERENCE:]
        if len(finite) < MIN_REFERENCE:
            return None
        median = statistics.median(finite)
        sigma = 1.4826 * statistics.median(abs(x - median) for x in finite)
        return cls(median, sigma, reference_size, spike, start)

    def allowance(self, batch_size: int) -> float:
        """How far above the median a loss of a step of ``batch_size`` samples may go before it is high."""
        rise = (self.spike - 1.0) * abs(self.median)
        if self.start is not None and self.start > self.median:
            rise = min(rise, (self.start - self.median) / 2)
        noise = NOISE_SIGMAS * self.sigma * math.sqrt(max(1.0, self.reference_size / max(batch_size, 1)))
        return max(rise, noise, 1e-12)

    def threshold(self, batch_size: int) -> float:
        """The loss above which a step of ``batch_size`` samples is high."""
        return self.median + self.allowance(batch_size)

    def score(self, loss: float, batch_size: int) -> float:
        """``(loss - median) / allowance``: above 1 is high."""
        return (loss - self.median) / self.allowance(batch_size)


def guard_enabled(rollback: bool | None, controller: Any) -> bool:
    """``rollback=None``: on for controllers that decide from measurements (class attribute ``adaptive = True``)."""
    return bool(getattr(controller, "adaptive", False)) if rollback is None else rollback


class RollbackGuard:
    """Watches the steps after each change of size by the controller, and rolls a failed change back.

    A change made while a window is open extends it (``window`` steps after the latest change) and keeps its
    snapshot, the oldest, so a failure goes back to before every change it may come from; a window open for
    ``3 x window`` steps is closed at the next change instead, which opens a new one.

    Args:
        enabled: Whether it watches at all (see :func:`guard_enabled`).
        window, spike, cooldown: ``rollback_window``, ``rollback_spike``, ``rollback_cooldown``.
        driver: The Pilot's :class:`~batchpilot.engine.driver.SizeDriver` (its back-off is saved here).
        rank, world_size: This process's place (rank 0 decides; the verdict is broadcast).
    """

    def __init__(self, *, enabled: bool, window: int, spike: float, cooldown: int, driver: Any, rank: int,
                 world_size: int) -> None:
        self.enabled, self.window, self.spike, self.cooldown = enabled, window, spike, cooldown
        self.driver, self.rank, self.world_size = driver, rank, world_size
        self.rollbacks = 0
        self.start_losses: list[float] = []  # the run's first finite step losses (its starting loss)
        self.watch: dict[str, Any] | None = None  # the open watch window (its snapshot inside), or None
        self._changed_to: int | None = None  # the size the controller changed to at this boundary

    @classmethod
    def from_config(cls, decisions: Any, driver: Any, *, rank: int, world_size: int) -> RollbackGuard:
        """The guard of a Pilot's :class:`~batchpilot.engine.config.DecisionConfig` (``rollback=None``: on for the
        driver's controller if it is adaptive, see :func:`guard_enabled`)."""
        return cls(enabled=guard_enabled(decisions.rollback, driver.controller), window=decisions.rollback_window,
                   spike=decisions.rollback_spike, cooldown=decisions.rollback_cooldown, driver=driver, rank=rank,
                   world_size=world_size)

    # ------------------------------------------------------------------ the hooks (engine/finish.py)
    def check_step(self, pilot: Any, global_batch_size: int, loss: float, skipped: bool) -> bool:
        """After a step (between steps): in a watch window, judge it; roll back on a failure. Return whether it
        rolled back (the step's end then stops: the Pilot is at the snapshot's boundary, at the old size)."""
        self._changed_to = None
        if not self.enabled:
            return False
        if len(self.start_losses) < START and math.isfinite(loss):
            self.start_losses.append(float(loss))
        w = self.watch
        if w is None:
            return False
        verdict = self._verdict(w, global_batch_size, loss, skipped and pilot.scaler is None) if self.rank == 0 else 0
        if self.world_size > 1:
            verdict = bpdist.broadcast_int(verdict)
        if verdict:
            self._roll_back(pilot, _REASONS[verdict])
            return True
        if pilot.step - w["changed_at"] >= self.window:
            self.watch = None  # the change held: drop the snapshot
        return False

    def after_decision(self, decided: Any, global_batch_size: int) -> None:
        """Note a decision (a :class:`~batchpilot.engine.driver.Decision` or ``None``) after a step of
        ``global_batch_size``: a change by the controller is watched from the next step on."""
        if self.enabled and decided is not None and decided.source != "user" \
                and decided.global_batch_size != global_batch_size:
            self._changed_to = decided.global_batch_size

    def before_next_step(self, pilot: Any, previous_size: int) -> None:
        """At the end of a step's end (after callbacks; before a checkpoint, which then holds the window): open a
        watch window for a change that still stands, or extend the open one."""
        changed_to, self._changed_to = self._changed_to, None
        if changed_to is None or pilot.loader.batch_size != changed_to:
            return  # no change by the controller, or a callback's set_batch_size() replaced it
        if self.watch is not None and pilot.step - self.watch["step"] < 3 * self.window:
            self.watch.update(changed_at=pilot.step, tried_size=changed_to)
            return
        self.watch = None  # (an old window: the changes in it held long enough)
        start = statistics.median(self.start_losses) if len(self.start_losses) >= START else None
        rule = SpikeRule.from_losses(list(pilot.driver.losses), previous_size, self.spike, start)
        self.watch = {"snapshot": take_snapshot(pilot), "step": pilot.step, "changed_at": pilot.step,
                      "restored_size": previous_size, "tried_size": changed_to,
                      "rule": None if rule is None else asdict(rule), "losses": [], "scores": []}

    # ------------------------------------------------------------------ the rule and the rollback
    def _verdict(self, w: dict[str, Any], global_batch_size: int, loss: float, skipped_nonfinite: bool) -> int:
        """0: fine so far; 1: a non-finite step; 2: a loss spike (see :class:`SpikeRule`)."""
        w["losses"].append(float(loss))
        if not math.isfinite(loss) or skipped_nonfinite:
            return 1
        if w["rule"] is None:
            return 0
        w["scores"].append(SpikeRule(**w["rule"]).score(loss, global_batch_size))
        recent = w["scores"][-PATIENCE:]
        return 2 if len(recent) == PATIENCE and statistics.median(recent) > 1.0 else 0

    def _roll_back(self, pilot: Any, reason: str) -> None:
        """Restore the window's snapshot (every rank), put the old size back, back off, tell the controller, log."""
        w, driver = self.watch, self.driver
        assert w is not None
        failed, restored = w["tried_size"], w["restored_size"]
        discarded = pilot.step - w["step"]
        keep = self.rollbacks, self.start_losses, driver.backoff, driver.rollback_failures
        restore_snapshot(pilot, w["snapshot"])  # (it loads this guard's state of then: put its own back)
        self.watch, self._changed_to = None, None
        self.rollbacks, self.start_losses, driver.backoff, driver.rollback_failures = keep[0] + 1, *keep[1:]
        backoff = driver.back_off(failed, restored, self.cooldown)
        pilot.loader.set_batch_size(restored)
        coupling = pilot.coupling
        if coupling.is_scaled:  # the LR of the size put back
            coupling.unscale()
            coupling.scale(pilot.loader.next_step_size())
        hook = getattr(driver.controller, "on_rollback", None)
        if self.rank == 0 and callable(hook):
            hook(failed, restored, driver.step)
        rule = None if w["rule"] is None else SpikeRule(**w["rule"])
        note = (f"rollback: {reason} within {discarded} steps at {failed}; back to {restored} (step {driver.step}); "
                f"sizes {'>=' if failed > restored else '<='} {backoff.failed_size} refused until step "
                f"{backoff.until_step}")
        record = {
            "step": driver.step, "samples_seen": driver.samples_seen, "old_size": failed, "new_size": restored,
            "controller": "rollback", "reason": reason, "note": note,
            "decision/rollback": True, "rollback/from_size": failed, "rollback/to_size": restored,
            "rollback/steps_discarded": discarded, "rollback/reason": reason, "rollback/losses": w["losses"],
            "rollback/reference_median": None if rule is None else rule.median,
            "rollback/threshold": None if rule is None else rule.threshold(failed),
            "rollback/until_step": backoff.until_step, "rollback/count": self.rollbacks,
        }
        pilot._decisions.last_decision = record
        pilot._decisions.log(record)
        if self.rank == 0:
            logger.warning("batchpilot: %s", note)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The rollbacks so far, the back-off, the starting loss, and an open watch window (with its snapshot: a
        checkpoint taken in a window resumes exactly, rolling back as the run that saved it would)."""
        backoff = self.driver.backoff
        return {"rollbacks": self.rollbacks, "failures": self.driver.rollback_failures,
                "backoff": None if backoff is None else asdict(backoff), "start_losses": list(self.start_losses),
                "watch": self.watch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.rollbacks = int(state["rollbacks"])
        self.driver.rollback_failures = int(state["failures"])
        backoff = state["backoff"]
        self.driver.backoff = None if backoff is None else BackOff(**backoff)
        self.start_losses = [float(x) for x in state["start_losses"]]
        self.watch = None if state["watch"] is None or not self.enabled else dict(state["watch"])
        self._changed_to = None
