"""Step-time calibration: the cost model of the benchmark and the batch-size finder.

Wall time on a shared machine moves with other processes (the seed-to-seed spread of one configuration
is 2-3x on 2 busy cores), while the number of steps at each batch size does not. So once per workload,
before the timed runs, :func:`calibrate` times a few optimizer steps at every batch size of a grid (powers
of two from the workload's smallest to its largest batch, plus any size a policy starts or ends at), in
two modes: plain steps, and steps that also measure gradient statistics (the engine splits such a step
into two micro-batches and reads their gradient norms, ``Pilot(noise_every=1)``). The median of
a few timed steps, the smallest over three interleaved rounds, is ``t_step(B)`` (see :func:`calibrate`).

A run's **cost-model time** is then ``sum over its steps of t_step(B_step)`` (the measured-mode time on
the steps where the engine measured gradient statistics), with ``t_step`` interpolated linearly in ``B``
between calibrated sizes and extrapolated from the nearest segment outside them. It removes machine
noise from the comparison and is reported beside wall time; it leaves out what is not a step (the
controller's decision, evaluation), which is small.

The calibration doubles as the warm-up of every batch size (allocator, kernels) and as the measurement
a batch-size finder makes. The **finder rule** (:meth:`Calibration.finder_size`): among the calibrated
sizes up to the workload's largest batch (the memory bound: on CPU, memory never binds at these sizes),
take the smallest whose throughput ``B / t_step(B)`` is within 5% of the best measured throughput: the
knee of the throughput curve. A memory-only finder (Lightning's ``BatchSizeFinder``, HF's
``auto_find_batch_size``) would take the largest size that fits instead.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import TensorDataset

from .workloads import Workload

__all__ = ["Calibration", "calibrate", "size_grid"]

FINDER_TOLERANCE = 0.05


def size_grid(min_size: int, max_size: int, extra: Sequence[int] = ()) -> list[int]:
    """Powers of two from ``min_size`` up to ``max_size`` (both included), plus ``extra`` sizes."""
    sizes = {min_size, max_size, *extra}
    b = min_size
    while b < max_size:
        sizes.add(b)
        b *= 2
    return sorted(s for s in sizes if s >= 1)


@dataclass
class Calibration:
    """Median seconds per optimizer step at each calibrated batch size.

    Attributes:
        sizes: Calibrated batch sizes, ascending.
        step_s: Plain step time at each size.
        probe_step_s: Step time when the engine also measures gradient statistics on that step.
        seconds: Wall time the calibration took (plain and measured modes together).
        plain_seconds: Wall time of one round of plain-mode measurements (what a finder would pay).
        raw_step_s: Plain step time at each size before a larger size's faster time was carried down
            (:func:`_suffix_min`); the finder redoes that over its own sizes only.
    """

    sizes: list[int]
    step_s: list[float]
    probe_step_s: list[float]
    seconds: float = 0.0
    plain_seconds: float = 0.0
    steps: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    raw_step_s: list[float] | None = None

    def step_time(self, batch_size: int, probe: bool = False) -> float:
        """Interpolated ``t_step(batch_size)`` in seconds (measured-mode time with ``probe=True``)."""
        ys = self.probe_step_s if probe else self.step_s
        xs = self.sizes
        if len(xs) == 1:
            return ys[0] * max(batch_size, 1) / xs[0]
        i = bisect.bisect_left(xs, batch_size)
        if i < len(xs) and xs[i] == batch_size:
            return ys[i]
        i = min(max(i, 1), len(xs) - 1)  # the segment [xs[i-1], xs[i]], or the nearest one outside
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        t = y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)
        # Outside the grid a noisy segment could extrapolate to nonsense: keep within sane limits.
        if batch_size < xs[0]:
            return min(max(t, 0.5 * ys[0]), ys[0])
        if batch_size > xs[-1]:
            return max(t, ys[-1])
        return t

    def throughput(self) -> dict[int, float]:
        """Samples per second at each calibrated size (plain steps)."""
        return {b: b / t for b, t in zip(self.sizes, self.step_s) if t > 0}

    def finder_size(self, max_size: int | None = None, tolerance: float = FINDER_TOLERANCE,
                    among: Sequence[int] | None = None) -> int:
        """The smallest calibrated size within ``tolerance`` of the best throughput (sizes <= ``max_size``,
        and in ``among`` when given: the benchmark passes its grid without the policies' own sizes, so the
        pick does not depend on which policies are run)."""
        rates = {b: r for b, r in self.throughput().items() if max_size is None or b <= max_size}
        if among is not None:
            allowed = set(among)
            if self.raw_step_s is not None and allowed & set(self.sizes):
                # The other sizes must not lower the allowed ones' times through the monotone fix-up either.
                own = [(b, t) for b, t in zip(self.sizes, self.raw_step_s) if b in allowed]
                rates = {b: b / t for (b, _), t in zip(own, _suffix_min([t for _, t in own]))
                         if t > 0 and (max_size is None or b <= max_size)}
            rates = {b: r for b, r in rates.items() if b in allowed} or rates
        if not rates:
            raise ValueError(f"no calibrated batch size is <= {max_size}; calibrate smaller sizes.")
        best = max(rates.values())
        return min(b for b, r in rates.items() if r >= (1.0 - tolerance) * best)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """The calibration :meth:`to_json` wrote (``KeyError``/``TypeError``/``ValueError`` if it is not one)."""
        known = {"sizes", "step_s", "probe_step_s", "samples_per_s", "seconds", "plain_seconds", "steps_per_size",
                 "raw_step_s"}
        raw = data.get("raw_step_s")  # absent in results.json written before it was kept
        return cls([int(b) for b in data["sizes"]], [float(t) for t in data["step_s"]],
                   [float(t) for t in data["probe_step_s"]], float(data["seconds"]), float(data["plain_seconds"]),
                   int(data["steps_per_size"]), {k: v for k, v in data.items() if k not in known},
                   None if raw is None else [float(t) for t in raw])

    def to_json(self) -> dict[str, Any]:
        return {
            "sizes": self.sizes,
            "step_s": self.step_s,
            "probe_step_s": self.probe_step_s,
            "samples_per_s": [b / t if t > 0 else None for b, t in zip(self.sizes, self.step_s)],
            "seconds": self.seconds,
            "plain_seconds": self.plain_seconds,
            "steps_per_size": self.steps,
            **({} if self.raw_step_s is None else {"raw_step_s": self.raw_step_s}),
            **self.meta,
        }


def _time_steps(workload: Workload, train: TensorDataset, global_batch_size: int, steps: int, warm: int,
                noise_every: int | None) -> list[float]:
    """Seconds of each of ``steps`` optimizer steps at ``global_batch_size`` after ``warm`` untimed ones."""
    from ..engine import Pilot

    model = workload.build_model(0).to(train.tensors[0].device)  # the model goes where the data is
    optimizer = workload.make_optimizer(model.parameters(), workload.base_lr * 1e-3)  # timing only
    extra = {} if workload.pilot_settings is None else workload.pilot_settings(train)  # e.g. gpt's token budgets
    pilot = Pilot(model, optimizer, train, batch_size=global_batch_size, progress=False, seed=0,
                  noise_every=noise_every, **extra)
    times: list[float] = []
    pilot.add_callback(lambda p, record: times.append(record["perf/step_time_s"]))
    loss_fn = workload.loss_fn
    try:
        for x, y in pilot.batches(max_steps=warm + steps):
            pilot.backward(loss_fn(model(x), y))
    finally:
        pilot.close()
    return times[warm:] or times


def warm_up(workload: Workload, train: TensorDataset, sizes: Sequence[int], warm: int = 2) -> None:
    """A throwaway pass at each of ``sizes``, plain and measured, to pay one-off costs (imports, allocator,
    first kernels) before anything is timed: the calibration does it for its first size; a resumed bench,
    whose calibration is loaded, for every size."""
    for global_batch_size in sizes:
        _time_steps(workload, train, global_batch_size, 1, warm, None)
        _time_steps(workload, train, global_batch_size, 1, warm, 1)


def _suffix_min(times: list[float]) -> list[float]:
    """``t[i] = min(t[i:])``: a step of a smaller batch is never slower than one of a larger batch, so a
    small size that measured slower than a larger one was pre-empted; it takes the larger one's time."""
    out = list(times)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def calibrate(workload: Workload, train: TensorDataset, sizes: Sequence[int], steps: int = 4,
              warm: int = 2, rounds: int = 3) -> Calibration:
    """Time ``steps`` steps (after ``warm`` untimed ones) at every size, plain and measured, ``rounds`` times.

    The rounds are interleaved (every size and mode once, then again, ...), and ``t_step`` is the smallest
    of a size's per-round medians: a burst of load from another process must then hit that size in every
    round to inflate it; and a size that still measured slower than a larger size takes the larger
    size's time (:func:`_suffix_min`). A short throwaway pass first pays one-off costs (imports, allocator, first
    kernels). Sizes larger than the dataset are left out (a step cannot be larger than an epoch).
    """
    n = len(train)
    sizes = sorted({int(s) for s in sizes if 1 <= s <= n}) or [n]
    t0 = time.perf_counter()
    warm_up(workload, train, sizes[:1], warm)
    plain: dict[int, list[float]] = {b: [] for b in sizes}  # per-round medians
    probe: dict[int, list[float]] = {b: [] for b in sizes}
    plain_s = 0.0
    for _ in range(rounds):
        for b in sizes:
            t = time.perf_counter()
            plain[b].append(statistics.median(_time_steps(workload, train, b, steps, warm, None)))
            plain_s += time.perf_counter() - t
            probe[b].append(statistics.median(_time_steps(workload, train, b, steps, warm, 1)))
    seconds = time.perf_counter() - t0
    raw = [min(plain[b]) for b in sizes]
    return Calibration(sizes, _suffix_min(raw), _suffix_min([min(probe[b]) for b in sizes]),
                       seconds=seconds, plain_seconds=plain_s / rounds, steps=steps * rounds, raw_step_s=raw)
