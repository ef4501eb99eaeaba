"""What every controller sees (:class:`Observation`), what it must offer (:class:`Controller`), and the
error raised for a decision that is not a usable global batch size (checked in :mod:`.boundary`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Controller", "InvalidDecisionError", "Observation"]


@dataclass(frozen=True)
class Observation:
    """A snapshot of training taken between two optimizer steps.

    Attributes:
        step: Optimizer steps completed so far. The decision made from this observation is the global
            batch size of step index ``step`` (0-based), i.e. the next step.
        samples_seen: Samples consumed since the start of training, over all ranks.
        epoch: Full passes over the data completed.
        coverage: Fraction of the current pass consumed, in ``[0, 1)``.
        batch_size: The global batch size in force: what the last decision set. An epoch's final step may
            have had fewer samples (the log's ``batch/global_size`` has those).
        num_samples: Dataset length (so a controller can reason in epochs).
        losses: Mean training loss of recent steps, oldest first (at most ``Pilot.loss_history``).
        samples_per_s: Recent training throughput (samples per second over all ranks), if measured.
        stats: Further named measurements (gradient statistics, system and cluster metrics), using the
            namespaced metric names (``stats/noise_scale``, ``system/cpu_util``, ...).
    """

    step: int
    samples_seen: int
    epoch: int
    coverage: float
    batch_size: int
    num_samples: int = 0
    losses: tuple[float, ...] = ()
    samples_per_s: float | None = None
    stats: Mapping[str, float] = field(default_factory=dict)

    @property
    def epochs_done(self) -> float:
        """Passes over the data including the current fraction (``epoch + coverage``)."""
        return self.epoch + self.coverage


@runtime_checkable
class Controller(Protocol):
    """Decides the global batch size of the next step. Pure: no I/O, no communication, no ranks.

    Optional class attributes a Pilot reads: ``adaptive = True`` (it decides from measurements: the rollback guard
    watches its changes by default, docs/rollback.md), ``recommended_lr_rule`` (the ``lr_rule`` that
    ``Pilot(lr_rule=None)`` uses, docs/lr.md) and ``required_stats``. An optional method
    ``on_rollback(from_size, to_size, step) -> None`` is called (on rank 0) after the guard undid the change to
    ``from_size``: training went back to ``to_size`` at ``step``, and the controller's state to what it was then.
    """

    def decide(self, obs: Observation) -> int:
        """Return the global batch size of step ``obs.step``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue deciding identically after a restart."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


class InvalidDecisionError(ValueError):
    """A controller returned something that is not a usable batch size."""
