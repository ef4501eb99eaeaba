"""The limit and the baselines of the simulator: the goodput oracle, the best static batch, and our real controllers.

**The goodput oracle** (:func:`goodput_oracle`) knows the true model: the trace's noise scale at every progress
and the cluster's step time at every clock. Pollux's objective is the goodput ``B * E(B, progress) / T(B)``
(Qiao et al., OSDI '21).

*Greedy* (``method="greedy"``, :func:`best_size`): at each decision, the size with the highest goodput now.
Progress obeys ``dp/dt = G(B(t), p, t)``, and a choice changes nothing but the rate: a batch change costs nothing
(:mod:`.episode`) and the load and the failures follow the clock, not the policy. If the size could change at any
moment, greedy would follow ``dp/dt = G*(p, t) = max_B G(B, p, t)`` while any other policy has
``dp/dt <= G*(p, t)``; by the comparison theorem for differential equations no policy would then get ahead of it.

*Dynamic program* (``method="dp"``, the default; :mod:`.oracle_dp`): the policies compared here decide every
``interval`` steps, so a size is held while the noise scale moves, and the recorded noise scale can move a lot
within fifty steps. Greedy then holds a size that suited the first of them only: on an earlier, unsmoothed
recording of ``seqsum`` a static batch of 32 beat it by 0.6%. The dynamic program minimises the time to target over policies that hold a size
for ``interval`` steps (Bellman's recursion over progress), so it also beats every static size, which is such a
policy. Where the noise scale is smooth, the two agree to a fraction of a percent.

**The best static batch** (:func:`best_static`) runs every size of a grid (default: powers of ``sqrt(2)`` between
the bounds) through the same simulator and keeps the fastest. :func:`run_controller` and :func:`goodput_policy` run
our real controllers (``Goodput(...)``, ``NoiseScale(...)``, schedules) through their own ``decide()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..controllers.goodput import Goodput
from .cluster import ClusterSpec
from .episode import SimJob, SimResult, drive, make_job, run_policy
from .oracle_dp import ValueTable, candidates, integer_search
from .trace import Trace

__all__ = ["best_size", "best_static", "goodput_oracle", "goodput_policy", "run_controller", "static_sizes",
           "true_goodput"]

def true_goodput(job: SimJob, size: int) -> float:
    """``B * E(B) / T(B)``: efficiency-weighted samples per second at ``size`` now (the job's progress and clock)."""
    return size * float(job.efficiency(size, job.progress)) / float(job.cluster.step_time(size).seconds)


def best_size(job: SimJob) -> int:
    """The size in ``[job.min_size, job.max_size]`` with the highest :func:`true_goodput` now (ties: the smaller):
    the best of :func:`~.oracle_dp.candidates`, refined to the integer by :func:`~.oracle_dp.integer_search`."""
    return integer_search(candidates(job).tolist(), lambda sizes: np.array([true_goodput(job, s) for s in sizes]))


def goodput_oracle(trace: Trace, spec: ClusterSpec | str, *, min_size: int = 32, max_size: int = 4096,
                   interval: int = 50, seed: int = 0, time_limit_s: float | None = None,
                   method: str = "dp") -> SimResult:
    """Run the goodput oracle (module docstring; ``method`` ``"dp"`` or ``"greedy"``); it picks its first size
    before the first step.

    Raises:
        ValueError: an unknown ``method``.
    """
    job = make_job(trace, spec, start_size=min_size, min_size=min_size, max_size=max_size, seed=seed)
    if method == "greedy":
        choose: Callable[[SimJob], int] = best_size
    elif method == "dp":
        choose = ValueTable(job, interval).choose
    else:
        raise ValueError(f"method must be 'dp' or 'greedy', got {method!r}.")
    return drive(job, choose, interval=interval, time_limit_s=time_limit_s, name="oracle", first=True)


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
