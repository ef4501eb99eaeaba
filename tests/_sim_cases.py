"""Traces built from arrays for the simulator's tests (no shipped recording needed)."""

from __future__ import annotations

import numpy as np

from batchpilot.sim.trace import Trace


def make_trace(*, phi: float | tuple[float, float] = 2000.0, a: float = 0.1, b: float = 1e-3, target_progress: float = 2e6,
               base: int = 64, memory: int = 1 << 20, points: int = 41, grad_bytes: int = 4_000_000,
               workload: str = "synthetic") -> Trace:
    """A workload whose metric is ``progress / target_progress`` (target 1.0 at ``target_progress``, recorded to 1.5x),
    whose noise scale is ``phi`` (or rises geometrically from ``phi[0]`` to ``phi[1]``), and whose step takes exactly
    ``a + b * B`` seconds on the recording device (``memory``: its micro-batch bound)."""
    p = np.linspace(0.0, 1.5 * target_progress, points)
    noise = np.full(points, float(phi)) if np.isscalar(phi) else np.geomspace(phi[0], phi[1], points)
    metric = p / target_progress
    sizes = (1, 1 << 16)
    return Trace(
        workload=workload, base_batch_size=base, num_samples=100_000, metric="accuracy", target=1.0, progress=p,
        metric_values=metric, loss=2.0 * np.exp(-p / target_progress), noise_scale=noise, grad_sq=np.full(points, 0.5),
        grad_var=0.5 * noise, step_sizes=sizes, step_seconds=tuple(a + b * s for s in sizes), compute=(a, b),
        max_micro_batch_size=memory, grad_bytes=grad_bytes, source="tests/_sim_cases.py",
    )
