"""The dynamic-programming oracle: the least time to target when a size is held for ``interval`` steps.

The greedy oracle (:func:`batchpilot.sim.oracle.best_size`) maximises the goodput *now*; it is optimal when a
size can change at any moment (:mod:`.oracle`). A policy that decides every ``interval`` steps holds its size while
the noise scale moves, and a recorded noise scale can move a lot within fifty steps (early in training, or from
measurement noise kept in the trace): greedy then holds a size that was right for the first step only. The value
function ``V(p)``, the least time from progress ``p`` to the target when sizes are chosen every ``interval`` steps,
follows Bellman's recursion over progress

    ``V(p) = min over B of  [ interval * T(B) + V(p') ]``,  ``p'`` = progress after ``interval`` steps at ``B``

(the steps that cross the target count only up to the crossing, and ``V = 0`` there). It is solved backwards on a
progress grid (``V`` interpolated linearly between points; when ``p'`` lands inside the grid cell of ``p``, the size
is taken as repeated until it leaves the cell), over the candidate sizes of :func:`candidates` (the static grid
among them, so the oracle never loses to a static size beyond the grid's interpolation error), with ``T(B)`` the
cluster's step times when the table is built. At each decision the oracle looks one interval ahead with the step
times *now* (load, healthy devices) and ``V`` beyond it, and refines the best candidate to the integer; the table is
built again when the step times moved by more than 1% (``REBUILD``). This is exact for a cluster whose state does
not change; under a load that swings faster than the job (a 10-minute period in ``tests/test_sim_oracle.py``) it
came within 6e-5 of greedy, which is exact there in the limit of continuous decisions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .episode import SimJob

__all__ = ["ValueTable", "candidates", "integer_search"]

GRID = 48
"""Geometric candidates between the bounds."""
MAX_POINTS = 4000
"""Most progress points of the value table."""
REBUILD = 0.01
"""Relative change of a probed step time that makes :meth:`ValueTable.choose` build the table again."""


def candidates(job: SimJob) -> np.ndarray:
    """``GRID`` geometric sizes, the static grid (powers of ``sqrt(2)``), the multiples of ``devices x memory bound``
    (where every micro-batch is full) and the trace's ``B0``, all within the job's bounds, ascending."""
    lo, hi = job.min_size, job.max_size
    sizes = {round(lo * (hi / lo) ** (i / (GRID - 1))) for i in range(GRID)} | {lo, hi}
    steps = int(math.floor(2 * math.log2(hi / lo) + 1e-9))
    sizes |= {round(lo * 2 ** (k / 2)) for k in range(steps + 1)}
    memory = min(d.memory or job.trace.max_micro_batch_size for d in job.cluster.spec.devices)
    full = len(job.cluster.spec.devices) * memory
    sizes |= {k * full for k in range(1, hi // full + 1)}
    sizes.add(job.trace.base_batch_size)
    return np.array(sorted(s for s in sizes if lo <= s <= hi), dtype=np.int64)


def _interval(job: SimJob, start: np.ndarray, sizes: np.ndarray, seconds: np.ndarray,
              steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``steps`` steps from progress ``start`` at ``sizes`` (broadcast together): the progress reached, the seconds
    spent (up to the crossing for those that cross the target) and whether they crossed."""
    trace, target = job.trace, job.target
    p = np.array(start, dtype=np.float64) + np.zeros(np.broadcast(start, sizes).shape)
    crossed_at = np.full(p.shape, np.nan)
    b0 = trace.base_batch_size
    for k in range(steps):
        phi = trace.noise_scale_factor * np.interp(p, trace.progress, trace.noise_scale)  # the true model's
        gain = sizes * (phi + b0) / (phi + sizes)
        new = p + gain
        hit = (new >= target) & np.isnan(crossed_at)
        crossed_at[hit] = k + (target - p[hit]) / gain[hit]
        p = new
    crossed = ~np.isnan(crossed_at)
    return p, np.where(crossed, crossed_at, steps) * seconds, crossed


class ValueTable:
    """``V`` on a progress grid for ``job`` (module docstring), built with the step times at the job's clock now."""

    def __init__(self, job: SimJob, interval: int, sizes: np.ndarray | None = None) -> None:
        self.interval = interval
        self.sizes = candidates(job) if sizes is None else np.asarray(sizes, dtype=np.int64)
        self.rebuilds = 0
        self._build(job)

    def _build(self, job: SimJob) -> None:
        seconds = np.array([job.cluster.step_time(int(s)).seconds for s in self.sizes])
        self.seconds = seconds
        interval = self.interval
        target = job.target
        smallest = float(self.sizes.min())
        phi_min = job.trace.noise_scale_factor * float(job.trace.noise_scale.min())
        least_gain = interval * smallest * (phi_min + job.trace.base_batch_size) / (phi_min + smallest)
        n = int(min(max(math.ceil(2 * target / least_gain), 64), MAX_POINTS))
        grid = np.linspace(0.0, target, n + 1)
        reached, cost, crossed = _interval(job, grid[:, None], self.sizes[None, :], seconds[None, :], interval)
        value = np.zeros(n + 1)
        for i in range(n - 1, -1, -1):
            later = np.interp(reached[i], grid[i + 1:], value[i + 1:])
            total = cost[i] + np.where(crossed[i], 0.0, later)
            inside = ~crossed[i] & (reached[i] < grid[i + 1])
            if inside.any():  # repeat the size until it leaves the cell: V_i = (c + (1 - w) V_{i+1}) / (1 - w)
                w = (grid[i + 1] - reached[i][inside]) / (grid[i + 1] - grid[i])
                total[inside] = (cost[i][inside] + (1 - w) * value[i + 1]) / (1 - w)
            value[i] = total.min()
        self.grid, self.value = grid, value

    def time_to_target(self, progress: float) -> float:
        """``V(progress)``: the least time from there to the target."""
        return float(np.interp(progress, self.grid, self.value))

    def score(self, job: SimJob, sizes: np.ndarray) -> np.ndarray:
        """Minus the time to target when the next interval runs at each of ``sizes`` with the step times now."""
        seconds = np.array([job.cluster.step_time(int(s)).seconds for s in sizes])
        reached, cost, crossed = _interval(job, np.full(len(sizes), job.progress), np.asarray(sizes, dtype=np.float64),
                                           seconds, self.interval)
        later = np.interp(reached, self.grid, self.value)
        return -(cost + np.where(crossed, 0.0, later))

    def choose(self, job: SimJob) -> int:
        """The size to hold for the next interval (ties: the smaller). The table is built again first when the step
        time of the smallest, the largest or the middle candidate moved by more than ``REBUILD`` since it was built
        (the load changed, a device failed or came back)."""
        probe = [0, len(self.sizes) // 2, len(self.sizes) - 1]
        now = np.array([job.cluster.step_time(int(self.sizes[i])).seconds for i in probe])
        if np.any(np.abs(now / self.seconds[probe] - 1.0) > REBUILD):
            self._build(job)
            self.rebuilds += 1
        return integer_search(self.sizes.tolist(), lambda s: self.score(job, np.asarray(s)))


def integer_search(grid: list[int], score: Callable[[list[int]], np.ndarray]) -> int:
    """The integer with the highest ``score`` (ties: the smaller): the best of ``grid``, then 9 evenly spaced sizes
    between its neighbours, narrowed around the best until the bracket holds at most 9 sizes, all tried. ``score``
    takes a list of sizes and returns their scores."""
    table: dict[int, float] = {}

    def best_of(sizes: list[int]) -> int:
        new = [s for s in dict.fromkeys(sizes) if s not in table]
        if new:
            table.update(zip(new, (float(v) for v in score(new))))
        return max(sizes, key=lambda s: (table[s], -s))

    best = best_of(grid)
    i = grid.index(best)
    left, right = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    while right - left > 8:
        points = sorted({round(left + (right - left) * j / 8) for j in range(9)} | {best})
        best = best_of(points)
        j = points.index(best)
        left, right = points[max(j - 1, 0)], points[min(j + 1, len(points) - 1)]
    return best_of(list(range(left, right + 1)) + [best])
