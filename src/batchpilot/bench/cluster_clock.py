"""The bench's simulated cluster clock: ``batchpilot bench --clock cluster:SPEC``.

Beside wall time and the cost model, a bench can report the time to target that the *same runs* would take on a
simulated cluster (:class:`batchpilot.sim.cluster.Cluster`): the steps, batch sizes, statistics and accuracy are the
real ones of each run; only the seconds per step come from the cluster model, whose device is this machine's
calibrated step-time curve (scaled by the spec's ``speed``/``speedup``) and whose all-reduce moves the model's
gradient. The best static batch is picked again under that clock, so the comparison is fair on the cluster.

What the clock counts, step by step up to the run's target evaluation:

- every optimizer step at the size the policy set for it (the change points in ``batch_sizes``; an epoch's
  smaller last step is counted at the policy's size, which slightly over-counts it),
- ``auto``'s start probes: ``warmup_steps + timed_steps`` steps at each size the sweep timed and the rest of its
  probe steps (the range test) at the knee, as the cost model counts them,
- the cluster's background load and failures as its clock advances (each run starts the clock at 0).

Not counted: the extra cost of steps that also measure gradient statistics (the cluster has no model of it; the
wall clock and the cost model include it). Every figure it writes is labelled *simulated*.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..sim.cluster import Cluster, ClusterSpec
from ..sim.trace import fit_compute, step_seconds
from .calibrate import Calibration
from .train import probe_steps

__all__ = ["CLOCK_HELP", "MeasuredDevice", "add_cluster_clock", "parse_clock", "run_cluster_seconds"]

CLOCK_HELP = ("cluster:SPEC adds the time to target the same runs would take on a simulated cluster (SPEC as in "
              "docs/simulator.md, e.g. cluster:gpus=16,speedup=20): simulated, reported beside wall time")


@dataclass(frozen=True)
class MeasuredDevice:
    """This machine as the cluster's device: the calibration's step-time table (what :class:`Cluster` reads from a
    trace's compute side, without a training curve)."""

    step_sizes: tuple[int, ...]
    step_seconds: tuple[float, ...]
    compute: tuple[float, float]
    max_micro_batch_size: int
    grad_bytes: int

    @classmethod
    def from_calibration(cls, calibration: Calibration, grad_bytes: int, max_micro_batch_size: int) -> MeasuredDevice:
        """The device of ``calibration`` (plain step times), with the model's gradient size in bytes."""
        if grad_bytes < 1 or max_micro_batch_size < 1:
            raise ValueError(f"grad_bytes ({grad_bytes}) and max_micro_batch_size ({max_micro_batch_size}) must be "
                             ">= 1.")
        sizes = tuple(int(s) for s in calibration.sizes)
        seconds = tuple(float(t) for t in calibration.step_s)
        return cls(sizes, seconds, fit_compute(sizes, seconds), int(max_micro_batch_size), int(grad_bytes))

    def compute_seconds(self, micro_batch: float) -> float:
        """Seconds of one step of ``micro_batch`` samples, read from the table as a trace reads its own."""
        return step_seconds(self.step_sizes, self.step_seconds, self.compute[1], micro_batch)


def parse_clock(text: str) -> ClusterSpec:
    """The cluster of ``--clock cluster:SPEC`` (``ValueError`` naming the accepted form otherwise)."""
    kind, sep, spec = text.partition(":")
    if kind.strip().lower() != "cluster" or not sep or not spec.strip():
        raise ValueError(f"--clock {text!r}: the accepted form is {CLOCK_HELP}.")
    return ClusterSpec.parse(spec.strip())


def _steps_by_size(run: Mapping[str, Any], steps: int) -> list[tuple[int, int]]:
    """``[(batch size, steps at it), ...]`` of the run's first ``steps`` steps, from its change points."""
    points = [(int(p["step"]), p["batch_size"]) for p in run["batch_sizes"] if p.get("batch_size")]
    out: list[tuple[int, int]] = []
    for (start, size), nxt in zip(points, points[1:] + [(steps, None)]):
        count = min(nxt[0], steps) - start
        if count > 0:
            out.append((int(size), count))
    return out


def run_cluster_seconds(run: Mapping[str, Any], spec: ClusterSpec, device: MeasuredDevice,
                        seed: int = 0) -> float | None:
    """Simulated seconds from the run's start to its target evaluation on ``spec`` (``None``: no target)."""
    steps = run.get("steps_to_target")
    if steps is None:
        return None
    cluster = Cluster(spec, device, seed=seed)
    probe = run.get("probe")
    for size, count in (probe_steps(probe) if probe else []) + _steps_by_size(run, int(steps)):
        for _ in range(count):
            cluster.advance(cluster.step_time(size).seconds)
    return cluster.time_s


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def add_cluster_clock(results: dict[str, Any], spec_text: str, device: MeasuredDevice) -> dict[str, Any]:
    """Add ``results["cluster_clock"]``: each run's simulated time to target on ``spec_text``'s cluster, each
    policy's median (a run without the target counts as missing, as in the wall-clock summary), the best static
    policy under this clock and every policy's ratio to it. Returns the added dict."""
    spec = parse_clock(spec_text)
    per_run: dict[str, dict[str, float | None]] = {}
    for run in results["runs"]:
        seconds = run_cluster_seconds(run, spec, device, seed=int(run["seed"]))
        per_run.setdefault(run["policy"], {})[str(run["seed"])] = seconds
    members: Mapping[str, Sequence[str]] = results.get("members", {})
    medians: dict[str, float | None] = {}
    for policy, runs in members.items():  # a tuned static is its best (size, LR) cell, picked again here
        cells = [_median([t for t in per_run.get(r, {}).values() if t is not None]) for r in runs]
        reached = [c for c in cells if c is not None]
        medians[policy] = min(reached) if reached else None
    statics = {p: t for p, t in medians.items() if t is not None and p.split(":")[0] in ("static", "tuned-static")}
    best = min(statics, key=lambda p: statics[p]) if statics else None
    ratios = {p: (None if t is None or best is None else t / statics[best]) for p, t in medians.items()}
    clock = {"spec": spec_text, "simulated": True, "devices": spec.size, "runs": per_run,
             "median_time_to_target_s": medians, "best_static_policy": best, "ratio_to_best_static": ratios,
             "device": {"step_sizes": list(device.step_sizes), "step_seconds": list(device.step_seconds),
                        "grad_bytes": device.grad_bytes, "max_micro_batch_size": device.max_micro_batch_size},
             "note": "simulated: the runs' real steps and batch sizes timed by the cluster model, not measured"}
    results["cluster_clock"] = clock
    return clock


def cluster_clock_lines(results: Mapping[str, Any]) -> list[str]:
    """The report's section for ``results["cluster_clock"]`` (empty without one)."""
    clock = results.get("cluster_clock")
    if not clock:
        return []
    lines = [f"## Simulated cluster clock: `{clock['spec']}` ({clock['devices']} devices)", "",
             "*Simulated*: the same runs (their real steps, batch sizes and accuracy) timed by the cluster model "
             "(docs/simulator.md); the best static batch is picked again under this clock.", "",
             "| policy | simulated time to target (median) | ratio to the best static |", "|---|---|---|"]
    for policy, seconds in clock["median_time_to_target_s"].items():
        ratio = clock["ratio_to_best_static"].get(policy)
        best = " (best static)" if policy == clock["best_static_policy"] else ""
        lines.append(f"| {policy}{best} | {'—' if seconds is None else f'{seconds:.3g} s'} | "
                     f"{'—' if ratio is None else f'{ratio:.2f}x'} |")
    return lines + [""]
