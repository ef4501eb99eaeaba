"""`Pilot`'s read-only view: where training stands (step, samples, epoch, coverage) and what it decided."""

from __future__ import annotations

from typing import Any

from ..data.loader import AdaptiveDataLoader, MicroBatch
from .accumulate import Accumulation
from .decisions import Decisions
from .driver import SizeDriver
from .guard import RollbackGuard
from .replay import StepReplay


class PilotView:
    """The properties of :class:`~batchpilot.engine.pilot.Pilot` (a base class: the Pilot sets these parts)."""

    loader: AdaptiveDataLoader
    driver: SizeDriver
    num_samples: int
    _acc: Accumulation
    _decisions: Decisions
    _guard: RollbackGuard
    _replay: StepReplay

    @property
    def batch_size(self) -> int:
        """Global batch size of the next step (inside a step, a :meth:`set_batch_size` made in it; between
        steps, after a loop left a step unfinished, that step's own size: it runs again first)."""
        override = self._decisions.override
        return override if self._acc.micro is not None and override is not None else self.loader.batch_size

    @property
    def step(self) -> int:
        """Optimizer steps taken (skipped ones included)."""
        return self.driver.step

    @property
    def samples_seen(self) -> int:
        """Samples consumed by the steps taken (the loader may have planned further ahead)."""
        if self.loader.sampler.token_plan is None:
            return self.driver.samples_seen
        micro = self._acc.micro  # in tokens the driver counts tokens: the samples are the data position's
        return micro.samples_seen if micro is not None else self.loader.position()[2]

    @property
    def tokens_seen(self) -> int | None:
        """Tokens consumed by the steps taken, with ``batch_unit="tokens"`` (``None`` when batches count samples)."""
        return None if self.loader.sampler.token_plan is None else self.driver.samples_seen

    @property
    def epoch(self) -> int:
        """Full passes over the data completed (during a step: before that step; between steps an epoch
        whose only rest is a tail ``drop_last`` drops counts as completed)."""
        return self._acc.micro.epoch if self._acc.micro is not None else self.loader.epochs_done()

    @property
    def coverage(self) -> float:
        """Fraction of the current pass consumed, in ``[0, 1)`` (during a step: before that step)."""
        if self._acc.micro is not None:
            return self._acc.micro.offset / self.num_samples
        epoch, offset, _ = self.loader.position()
        return 0.0 if self.loader.epochs_done() > epoch else offset / self.num_samples  # (a tail to drop: 0)

    @property
    def virtual_epoch(self) -> float:
        """``samples_seen / len(dataset)`` (seed 003's logged ``epoch``)."""
        return self.samples_seen / self.num_samples

    @property
    def micro_batch(self) -> MicroBatch | None:
        """The micro-batch being processed (its indices, sizes, position in the step), or ``None`` between steps."""
        return self._acc.micro

    @property
    def last_decision(self) -> dict[str, Any] | None:
        """The last change of size (or note on keeping it), as logged; ``None`` before the first."""
        return self._decisions.last_decision

    @property
    def rank_weights(self) -> tuple[float, ...] | None:
        """Each rank's weight in the share of the next global batches (``None``: even; docs/distributed.md)."""
        return self.loader.sampler.rank_weights

    @property
    def rollbacks(self) -> int:
        """Changes of size the rollback guard undid (docs/rollback.md)."""
        return self._guard.rollbacks

    @property
    def oom_replays(self) -> int:
        """Steps run again after running out of memory."""
        return self._replay.replays
