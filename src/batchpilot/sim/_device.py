"""The device side of a trace, as the cluster model reads it."""

from __future__ import annotations

from typing import Protocol

__all__ = ["DeviceSource"]


class DeviceSource(Protocol):
    """What a :class:`Cluster` reads of its device: a :class:`~batchpilot.sim.trace.Trace`, or only its step-time side
    (the bench's cluster clock passes this machine's calibration, :class:`batchpilot.bench.cluster_clock.MeasuredDevice`)."""

    @property
    def step_sizes(self) -> tuple[int, ...]: ...
    @property
    def compute(self) -> tuple[float, float]: ...
    @property
    def max_micro_batch_size(self) -> int: ...
    @property
    def grad_bytes(self) -> int: ...
    def compute_seconds(self, micro_batch: float) -> float: ...  # one step of micro_batch samples, in seconds
