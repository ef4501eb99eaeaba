"""The limit and the baselines of the simulator: the goodput oracle, the best static batch, and our real controllers.

**The goodput oracle** (:func:`goodput_oracle`) knows the true model: at each decision (before the first step, then
every ``interval`` steps) it picks the global batch ``B`` that maximises the true goodput
``B * E(B, progress) / T(B)`` (Pollux's objective, Qiao et al., OSDI '21), with ``E`` from the trace's noise scale
at the current progress and ``T`` the cluster's step time at the current clock (load, healthy devices).

*Why greedy and not a dynamic program over progress.* Progress obeys ``dp/dt = G(B(t), p, t)``, and no choice
changes anything but the rate: a batch change costs nothing (:mod:`.episode`), and the cluster's load and failures
follow the clock, not the policy. The greedy oracle solves ``dp/dt = G*(p, t) = max_B G(B, p, t)``; any other
policy has ``dp/dt <= G*(p, t)``, so by the comparison theorem for ordinary differential equations its progress is
never ahead of the oracle's at any time, and it cannot reach the target first. A dynamic program over progress
would find the same policy. What greedy leaves on the table comes only from the discretisation: ``B`` is held for
``interval`` steps while the noise scale moves (tens of steps out of thousands), and the candidate search
(:func:`best_size`: a geometric grid, the sizes that fill whole micro-batches, then a local integer search).

**The best static batch** (:func:`best_static`) runs every size of a grid (default: powers of ``sqrt(2)`` between
the bounds) through the same simulator and keeps the fastest. :func:`run_controller` and :func:`goodput_policy` run
our real controllers (``Goodput(...)``, ``NoiseScale(...)``, schedules) through their own ``decide()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..controllers.goodput import Goodput
from .cluster import ClusterSpec
from .episode import SimJob, SimResult, drive, make_job, run_policy
from .trace import Trace

__all__ = ["best_size", "best_static", "goodput_oracle", "goodput_policy", "run_controller", "static_sizes",
           "true_goodput"]

GRID = 48
"""Geometric candidates of the oracle's coarse search."""


def true_goodput(job: SimJob, size: int) -> float:
    """``B * E(B) / T(B)``: efficiency-weighted samples per second at ``size`` now (the job's progress and clock)."""
    return size * float(job.efficiency(size, job.progress)) / float(job.cluster.step_time(size).seconds)


def best_size(job: SimJob) -> int:
    """The size in ``[job.min_size, job.max_size]`` with the highest :func:`true_goodput` (ties: the smaller).

    Candidates: ``GRID`` geometric sizes, the multiples of ``world x memory bound`` (where micro-batches are full),
    then an integer search around the best: 9 evenly spaced sizes between its neighbours, narrowed around the best
    of them until the bracket holds at most 9 sizes, all of which are tried."""
    lo, hi = job.min_size, job.max_size
    table: dict[int, float] = {}

    def score(size: int) -> float:
        if size not in table:
            table[size] = true_goodput(job, size)
        return table[size]

    grid = sorted({round(lo * (hi / lo) ** (i / (GRID - 1))) for i in range(GRID)} | {lo, hi})
    full = len(job.cluster.spec.devices) * job.trace.max_micro_batch_size
    grid = sorted(set(grid) | {k * full for k in range(1, hi // full + 1) if lo <= k * full <= hi} if full else set(grid))
    best = max(grid, key=lambda s: (score(s), -s))
    i = grid.index(best)
    left, right = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    while right - left > 8:
        points = sorted({round(left + (right - left) * j / 8) for j in range(9)})
        best = max(points + [best], key=lambda s: (score(s), -s))
        j = points.index(best) if best in points else 0
        left, right = points[max(j - 1, 0)], points[min(j + 1, len(points) - 1)]
    return max(list(range(left, right + 1)) + [best], key=lambda s: (score(s), -s))


def goodput_oracle(trace: Trace, spec: ClusterSpec | str, *, min_size: int = 32, max_size: int = 4096,
                   interval: int = 50, seed: int = 0, time_limit_s: float | None = None) -> SimResult:
    """Run the goodput oracle (module docstring): it picks its first size before the first step."""
    job = make_job(trace, spec, start_size=min_size, min_size=min_size, max_size=max_size, seed=seed)
    return drive(job, best_size, interval=interval, time_limit_s=time_limit_s, name="oracle", first=True)


def static_sizes(min_size: int, max_size: int) -> list[int]:
    """Powers of ``sqrt(2)`` from ``min_size`` up to ``max_size`` (both included), rounded."""
    steps = int(math.floor(2 * math.log2(max_size / min_size) + 1e-9))
    return sorted({round(min_size * 2 ** (k / 2)) for k in range(steps + 1)} | {min_size, max_size})


def best_static(trace: Trace, spec: ClusterSpec | str, sizes: Sequence[int] | None = None, *, min_size: int = 32,
                max_size: int = 4096, interval: int = 50, seed: int = 0,
                time_limit_s: float | None = None) -> tuple[int, SimResult]:
    """The fastest static global batch of ``sizes`` (default :func:`static_sizes`) in the simulator, and its run.

    Raises:
        ValueError: ``sizes`` is empty.
    """
    sizes = list(static_sizes(min_size, max_size) if sizes is None else sizes)
    if not sizes:
        raise ValueError("best_static needs at least one size; pass sizes=None for the default grid.")
    lo, hi = min(min(sizes), min_size), max(max(sizes), max_size)
    results = {}
    for size in sizes:
        job = make_job(trace, spec, start_size=size, min_size=lo, max_size=hi, seed=seed)
        results[size] = drive(job, _constant(size), interval=interval, time_limit_s=time_limit_s,
                              name=f"static:{size}")
    best = min(sizes, key=lambda s: (results[s].time_to_target_s, s))
    return best, results[best]


def _constant(size: int) -> Callable[[SimJob], int]:
    return lambda job: size


def run_controller(controller: Any, trace: Trace, spec: ClusterSpec | str, *, start_size: int | None = None,
                   min_size: int = 32, max_size: int = 4096, interval: int = 50, seed: int = 0,
                   time_limit_s: float | None = None, observation_noise: float = 0.0,
                   observe_system: bool = True) -> SimResult:
    """Run a real controller (its own ``decide()``) in the simulator with :func:`~.episode.run_policy`, asked every
    ``interval`` steps; it starts at ``start_size`` (default: the trace's base batch, clamped to the bounds)."""
    start = start_size if start_size is not None else min(max(trace.base_batch_size, min_size), max_size)
    return run_policy(controller, trace, spec, start_size=start, min_size=min_size, max_size=max_size,
                      interval=interval, seed=seed, time_limit_s=time_limit_s, observation_noise=observation_noise,
                      observe_system=observe_system)


def goodput_policy(trace: Trace, spec: ClusterSpec | str, *, start_size: int | None = None, min_size: int = 32,
                   max_size: int = 4096, interval: int = 50, seed: int = 0, time_limit_s: float | None = None,
                   **goodput_kw: Any) -> SimResult:
    """Our :class:`~batchpilot.controllers.Goodput` controller (``goodput_kw`` passed to it) in the simulator."""
    controller = Goodput(min_size=min_size, max_size=max_size, interval=interval, **goodput_kw)
    return run_controller(controller, trace, spec, start_size=start_size, min_size=min_size, max_size=max_size,
                          interval=interval, seed=seed, time_limit_s=time_limit_s)
