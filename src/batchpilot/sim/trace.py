"""Workload traces: what the simulator needs from one training job (Pollux's simulator, Qiao et al., OSDI '21).

A :class:`Trace` holds, against **progress**, the metric, the training loss and the gradient statistics, and,
against the batch size, the seconds of one optimizer step on the recording device. Progress is counted in
efficiency-weighted samples, ``sum over steps of B_t * E(B_t)`` with the statistical efficiency
``E(B) = (phi + B0) / (phi + B)`` (Pollux, section 3.1; ``phi`` the gradient noise scale ``B_simple`` of McCandlish
et al. 2018 in samples, ``B0`` the trace's base batch). A static run at ``B0`` therefore has progress == samples,
and a run at another batch needs ``1 / E(B)`` times the samples for the same progress. A simulated job ends when its
progress crosses :meth:`Trace.target_progress`.

:func:`record_trace` builds one from a Pilot JSONL log (its step records carry ``stats/noise_scale``,
``stats/grad_sq_norm``, ``stats/trace_cov``), the evaluations made during the run, and a step-time table;
``batchpilot trace`` (:mod:`batchpilot.bench.trace_cmd`) does it for the built-in workloads. The traces the
simulator ships are in ``batchpilot/sim/traces/`` (:func:`shipped_traces`, :func:`load_trace`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ._interp import (
    crossing,
    filled,
    fit_compute,
    fit_noise_scale_factor,
    number,
    samples_to_progress,
    smoothed,
    step_seconds,
    thin,
)

__all__ = ["FORMAT", "FORMAT_VERSION", "Trace", "crossing", "fit_compute", "fit_noise_scale_factor", "load_trace",
           "record_trace", "samples_to_progress", "shipped_traces", "smoothed", "step_seconds"]

FORMAT = "batchpilot-trace"
FORMAT_VERSION = 1
_ARRAYS = ("progress", "metric_values", "loss", "noise_scale", "grad_sq", "grad_var")


def _vector(name: str, value: Any) -> np.ndarray:
    try:
        array = np.array(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"Trace.{name} must be a list of numbers, got {value!r:.80}.") from None
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"Trace.{name} must be a non-empty 1-D list of numbers, got shape {array.shape}; "
                         "record at least one point.")
    if not np.isfinite(array).all():
        raise ValueError(f"Trace.{name} holds a non-finite value at index {int(np.argmin(np.isfinite(array)))}; "
                         "drop that point or fill it from its neighbours.")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Trace:
    """What the simulator needs from one workload (Pollux-style): statistics and metric against progress, and step
    time against batch size. Arrays are read-only float64; see the module docstring for ``progress``.

    Attributes:
        workload: Name.  base_batch_size: ``B0`` of the efficiency.  num_samples: Dataset length (for epochs).
        metric, target: The metric (higher is better) and its target.
        progress: Ascending, starts at 0.  metric_values, loss, noise_scale (``B_simple`` > 0, samples), grad_sq
            (``|G|^2``), grad_var (``tr(Sigma)``): at each progress point.
        step_sizes, step_seconds: Global batch sizes timed on the recording device and seconds per step at each.
        compute: ``(a, b)`` of :func:`fit_compute` over the table.  max_micro_batch_size: The device's memory bound.
        grad_bytes: Bytes of one float32 gradient.  source: How the trace was recorded.
        noise_scale_factor: ``k`` in the efficiency ``(k phi + B0) / (k phi + B)``; 1 is Pollux's model with the
            measured noise scale (what controllers observe stays ``noise_scale`` whatever ``k``).
        static_samples_to_target: Samples to target measured by static runs at other batch sizes (same seed, LR
            rule and target rule): the evidence :meth:`fitted` fits ``k`` to; empty when none were run.
    """

    workload: str
    base_batch_size: int
    num_samples: int
    metric: str
    target: float
    progress: np.ndarray
    metric_values: np.ndarray
    loss: np.ndarray
    noise_scale: np.ndarray
    grad_sq: np.ndarray
    grad_var: np.ndarray
    step_sizes: tuple[int, ...]
    step_seconds: tuple[float, ...]
    compute: tuple[float, float]
    max_micro_batch_size: int
    grad_bytes: int
    source: str = ""
    noise_scale_factor: float = 1.0
    static_samples_to_target: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arrays = {name: _vector(name, getattr(self, name)) for name in _ARRAYS}
        for name, array in arrays.items():
            object.__setattr__(self, name, array)
            if len(array) != len(arrays["progress"]):
                raise ValueError(f"Trace.{name} has {len(array)} points but progress has {len(arrays['progress'])}; "
                                 "give every array one value per progress point.")
        p = arrays["progress"]
        if p[0] != 0 or (np.diff(p) <= 0).any():
            bad = 0 if p[0] != 0 else int(np.argmax(np.diff(p) <= 0)) + 1
            raise ValueError(f"Trace.progress must start at 0 and strictly ascend; index {bad} is {float(p[bad])!r} "
                             f"(after {float(p[bad - 1]) if bad else 'nothing'}); sort the points and drop repeats.")
        if (arrays["noise_scale"] <= 0).any():
            i = int(np.argmax(arrays["noise_scale"] <= 0))
            raise ValueError(f"Trace.noise_scale must be > 0 samples; index {i} is {float(arrays['noise_scale'][i])!r}; "
                             "fill points without a positive estimate from their neighbours.")
        for name in ("base_batch_size", "num_samples", "max_micro_batch_size", "grad_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Trace.{name} must be a whole number >= 1, got {value!r}.")
            object.__setattr__(self, name, int(value))
        if not (isinstance(self.target, (int, float)) and math.isfinite(self.target)):
            raise ValueError(f"Trace.target must be a finite number, got {self.target!r}.")
        sizes = tuple(int(s) for s in self.step_sizes)
        seconds = tuple(float(t) for t in self.step_seconds)
        if not sizes or len(sizes) != len(seconds):
            raise ValueError(f"Trace.step_sizes ({len(sizes)}) and step_seconds ({len(seconds)}) must be non-empty "
                             "and of the same length: one timing per batch size.")
        if any(s < 1 for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"Trace.step_sizes must be ascending whole numbers >= 1, got {sizes}.")
        if not all(math.isfinite(t) and t > 0 for t in seconds):
            raise ValueError(f"Trace.step_seconds must be finite and > 0, got {seconds}.")
        k = self.noise_scale_factor
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not (math.isfinite(k) and k > 0):
            raise ValueError(f"Trace.noise_scale_factor must be a finite number > 0, got {k!r}; 1 is Pollux's model.")
        object.__setattr__(self, "noise_scale_factor", float(k))
        try:
            static = {int(b): float(v) for b, v in dict(self.static_samples_to_target).items()}
        except (TypeError, ValueError):
            static = {0: math.nan}
        if any(b < 1 or not (math.isfinite(v) and v > 0) for b, v in static.items()):
            raise ValueError(f"Trace.static_samples_to_target must map batch sizes >= 1 to samples > 0, got "
                             f"{self.static_samples_to_target!r:.120}.")
        object.__setattr__(self, "static_samples_to_target", static)
        a, b = (float(v) for v in self.compute)
        if not (math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0):
            raise ValueError(f"Trace.compute (a, b) must be finite and >= 0, got {self.compute!r}; use fit_compute().")
        object.__setattr__(self, "step_sizes", sizes)
        object.__setattr__(self, "step_seconds", seconds)
        object.__setattr__(self, "compute", (a, b))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------------------------------------- queries
    def at(self, progress: float) -> dict[str, float]:
        """``{"metric", "loss", "noise_scale", "grad_sq", "grad_var"}`` interpolated linearly at ``progress``
        (clamped to the first and last point outside the recorded range)."""
        keys = {"metric": self.metric_values, "loss": self.loss, "noise_scale": self.noise_scale,
                "grad_sq": self.grad_sq, "grad_var": self.grad_var}
        return {k: float(np.interp(progress, self.progress, v)) for k, v in keys.items()}

    def efficiency(self, batch_size: float, progress: float) -> float:
        """Pollux's statistical efficiency ``(phi + B0) / (phi + B)``, ``phi = noise_scale_factor x`` the noise scale at
        ``progress`` (the factor is 1 unless ``batchpilot trace --fit-sizes`` measured another one)."""
        return float(self.efficiencies(batch_size, np.asarray(progress, dtype=float)))

    def efficiencies(self, batch_size: float, progress: np.ndarray) -> np.ndarray:
        """:meth:`efficiency` at every entry of ``progress`` (an array)."""
        if not batch_size > 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size!r}.")
        phi = self.noise_scale_factor * np.interp(progress, self.progress, self.noise_scale)
        return (phi + self.base_batch_size) / (phi + batch_size)

    def samples_to_target(self, batch_size: float) -> float:
        """Samples a static run at ``batch_size`` needs to reach the target: the integral of ``dp / E(B, p)``."""
        return samples_to_progress(self.progress, self.noise_scale, self.base_batch_size, batch_size,
                                   self.target_progress(), self.noise_scale_factor)

    def fitted(self) -> Trace:
        """A copy whose :attr:`noise_scale_factor` makes the efficiency model give the
        :attr:`static_samples_to_target` measured at other batch sizes (:func:`fit_noise_scale_factor`)."""
        if not self.static_samples_to_target:
            raise ValueError(f"trace {self.workload!r} has no static_samples_to_target to fit to; record it with "
                             "`batchpilot trace --fit-sizes 512` (or set the field from your own static runs).")
        factor = fit_noise_scale_factor(self.progress, self.noise_scale, self.base_batch_size, self.target_progress(),
                                        self.static_samples_to_target)
        return replace(self, noise_scale_factor=factor)

    def target_progress(self) -> float:
        """The first progress at which the metric reaches the target (linear interpolation between the points)."""
        reach = crossing(self.progress, self.metric_values, self.target)
        if reach is None:
            raise ValueError(f"trace {self.workload!r} never reaches its target {self.target:g} (best {self.metric} "
                             f"{self.metric_values.max():g}); lower it with dataclasses.replace(trace, target=...) or "
                             "record a longer run.")
        return reach

    def compute_seconds(self, micro_batch: float) -> float:
        """Seconds of one step of ``micro_batch`` samples on the recording device: the step-time table interpolated
        linearly, extended outside it with the slope ``b`` of :attr:`compute` (never below ``t0 * m / s0``)."""
        return step_seconds(self.step_sizes, self.step_seconds, self.compute[1], micro_batch)

    def perturbed(self, rng: np.random.Generator, scale: float = 0.3) -> Trace:
        """A randomised copy for training a policy: four independent log-normal factors ``exp(scale * N(0, 1))``
        multiply the noise scale (and ``grad_var``, so ``grad_var / grad_sq`` stays the noise scale), the progress
        axis (a job that needs more or fewer samples), and the compute fit's ``a`` and ``b``; the step-time table
        moves with the fit: ``t'(B) = t(B) + (f_a - 1) a + (f_b - 1) b B``. ``scale = 0`` returns an equal trace."""
        if not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"scale must be a finite number >= 0, got {scale!r}; 0.3 is the default.")
        f_noise, f_progress, f_a, f_b = np.exp(scale * rng.standard_normal(4))
        a, b = self.compute
        seconds = tuple(max(t + (f_a - 1) * a + (f_b - 1) * b * s, 1e-9) for s, t in zip(self.step_sizes,
                                                                                        self.step_seconds))
        return replace(self, progress=self.progress * f_progress, noise_scale=self.noise_scale * f_noise,
                       grad_var=self.grad_var * f_noise, compute=(a * f_a, b * f_b), step_seconds=seconds,
                       source=self.source if scale == 0 else f"{self.source}; perturbed (scale {scale:g})")

    # ------------------------------------------------------------------------------------------- files
    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``format``/``version`` first); :meth:`from_json` reads it back exactly."""
        out: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                value = {str(k): v for k, v in value.items()}  # JSON keys are text; from_json reads them back
            out[f.name] = value.tolist() if isinstance(value, np.ndarray) else (
                list(value) if isinstance(value, tuple) else value)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trace:
        """The trace :meth:`to_json` wrote; ``ValueError`` naming what is wrong for anything else."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"not a batchpilot trace (format {got!r}, expected {FORMAT!r}); pass a file written by "
                             "Trace.save or `batchpilot trace`.")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(f"trace format version {version!r} is not {FORMAT_VERSION}, the one this batchpilot "
                             "reads; record the trace again with this version (or upgrade batchpilot).")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data and n not in ("source", "noise_scale_factor",
                                                                  "static_samples_to_target")]
        if missing:
            raise ValueError(f"the trace lacks {', '.join(missing)}; record it again with `batchpilot trace`.")
        values = {n: data[n] for n in names if n in data}
        try:
            values["step_sizes"] = tuple(values["step_sizes"])
            values["step_seconds"] = tuple(values["step_seconds"])
            values["compute"] = tuple(values["compute"])
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"the trace holds a value of the wrong kind ({exc}); record it again.") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (folders created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read a trace file; ``ValueError`` naming the file when it is not valid JSON or not a trace."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{str(path)!r} is not JSON ({exc}); pass a trace written by Trace.save or "
                             "`batchpilot trace`.") from None
        try:
            return cls.from_json(data)
        except ValueError as exc:
            raise ValueError(f"{str(path)!r}: {exc}") from None


def _shipped_folder() -> Any:
    return resources.files("batchpilot.sim").joinpath("traces")


def shipped_traces() -> list[str]:
    """Names of the traces shipped in ``batchpilot/sim/traces/`` (``load_trace(name)`` reads one)."""
    folder = _shipped_folder()
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_trace(name_or_path: str | os.PathLike) -> Trace:
    """A shipped trace by name (:func:`shipped_traces`), or a trace file by path."""
    text = str(name_or_path)
    if text in shipped_traces():
        with resources.as_file(_shipped_folder().joinpath(f"{text}.json")) as path:
            return Trace.load(path)
    path = Path(text).expanduser()
    if path.is_file():
        return Trace.load(path)
    raise ValueError(f"no shipped trace named {text!r} and no such file; pass one of {shipped_traces()} or the path "
                     "of a trace file.")


# --------------------------------------------------------------------------------------------- recording
def _read_steps(log: str | os.PathLike | Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if isinstance(log, (str, os.PathLike)):
        from ..logs import read_log

        records: Iterable[Mapping[str, Any]] = read_log(log)
    else:
        records = log
    steps = [r for r in records if r.get("type", "step") == "step" and "samples_seen" in r]
    if not steps:
        raise ValueError(f"the log {str(log)[:80]!r} has no step records; pass a JSONL log written by "
                         "Pilot(log_path=...).")
    return steps


def record_trace(log: str | os.PathLike | Iterable[Mapping[str, Any]], evaluations: Sequence[tuple[float, float]],
                 step_sizes: Sequence[int], step_seconds: Sequence[float], *, workload: str, target: float,
                 num_samples: int, grad_bytes: int, base_batch_size: int | None = None, metric: str = "accuracy",
                 max_micro_batch_size: int | None = None, source: str = "", max_points: int = 200, smooth: int = 1,
                 noise_scale_factor: float = 1.0) -> Trace:
    """Build a :class:`Trace` from a Pilot run.

    Args:
        log: The run's JSONL log (``Pilot(log_path=..., noise_every=...)``: its step records need
            ``stats/noise_scale`` and ``stats/trace_cov``; ``grad_sq`` is ``trace_cov / noise_scale``, the engine's
            ``stats/grad_sq_norm`` wherever that is positive), or its records.
        evaluations: ``(samples_seen, metric)`` pairs made during the run (one at 0 samples is recommended: the
            trace starts there; without one, the first evaluation's value stands for it).
        step_sizes, step_seconds: Seconds per optimizer step at each batch size on the recording device
            (:func:`batchpilot.bench.calibrate.calibrate` gives them).
        base_batch_size: ``B0`` (default: the log's first batch size).
        max_micro_batch_size: The memory bound (default: the largest size timed).
        max_points: Evaluation points kept, >= 6 (evenly thinned; the first, the last, and the first at the target
            and the one before it stay).
        smooth: The metric is the centred moving average over this many evaluations (:func:`~._interp.smoothed`;
            1: as measured), so that the target is where the expected metric reaches it, not where one noisy
            evaluation first does.
        noise_scale_factor: See :attr:`Trace.noise_scale_factor`.

    Progress is ``sum B_t E(B_t)`` over the steps, each ``E`` with the noise scale last measured (the first
    measurement before that; ``noise_scale_factor`` applies). Statistics at a point are the engine's smoothed
    values at the last step before it (the point at 0, before any step, takes the next point's); loss is the mean
    over the steps since the previous kept point.
    """
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 6:
        raise ValueError(f"max_points must be a whole number >= 6, got {max_points!r}.")
    steps = _read_steps(log)
    samples = np.array([float(r["samples_seen"]) for r in steps])
    sizes = np.array([float(r.get("batch/global_size") or 0) for r in steps])
    if (sizes <= 0).any():
        sizes = np.diff(np.concatenate([[0.0], samples]))
    b0 = int(base_batch_size if base_batch_size is not None else sizes[0])
    phi = filled([r.get("stats/noise_scale") for r in steps])
    var = filled([r.get("stats/trace_cov") for r in steps])
    if phi is None or var is None:
        raise ValueError("the log has no positive stats/noise_scale and stats/trace_cov in any step record; record "
                         "the run with Pilot(noise_every=1) (or another period) so the gradient statistics are "
                         "measured.")
    k_phi = noise_scale_factor * phi
    progress = np.cumsum(sizes * (k_phi + b0) / (k_phi + sizes))
    losses = np.array([number(r.get("loss")) if number(r.get("loss")) is not None else np.nan for r in steps])

    evals = sorted((float(s), float(m)) for s, m in evaluations)
    if not evals:
        raise ValueError("no evaluations given; pass (samples_seen, metric) pairs measured during the run.")
    if evals[0][0] > 0:
        evals.insert(0, (0.0, evals[0][1]))
    ev_samples = np.array([s for s, _ in evals])
    ev_progress = np.interp(ev_samples, np.concatenate([[0.0], samples]), np.concatenate([[0.0], progress]))
    keep_mask = np.concatenate([[True], np.diff(ev_progress) > 0])  # evaluations past the log's end collapse
    ev_progress = ev_progress[keep_mask]
    ev_metric = smoothed(np.array([m for _, m in evals])[keep_mask], smooth)
    hits = np.nonzero(ev_metric >= target)[0]
    keep = {0, len(ev_progress) - 1} | ({int(hits[0]), max(int(hits[0]) - 1, 0)} if len(hits) else set())
    chosen = thin(len(ev_progress), keep, max_points)
    points = ev_progress[chosen]
    last_step = np.searchsorted(progress, points, side="right") - 1  # the last step at or before each point
    index = np.clip(last_step, 0, len(steps) - 1)
    loss: list[float] = []
    for k, i in enumerate(last_step):
        window = losses[last_step[k - 1] + 1: i + 1] if k else losses[:1]
        window = window[~np.isnan(window)]
        loss.append(float(window.mean()) if len(window) else (loss[-1] if loss else 0.0))
    if len(index) > 1:  # nothing is measured at 0: the first point takes the statistics of the next one
        index[0] = index[1]
    noise, grad_var = phi[index], var[index]
    table_sizes = [int(s) for s in step_sizes]
    return Trace(workload=workload, base_batch_size=b0, num_samples=num_samples, metric=metric, target=float(target),
                 progress=points, metric_values=ev_metric[chosen], loss=np.nan_to_num(loss), noise_scale=noise,
                 grad_sq=grad_var / noise, grad_var=grad_var, step_sizes=tuple(table_sizes),
                 step_seconds=tuple(float(t) for t in step_seconds), compute=fit_compute(table_sizes, step_seconds),
                 max_micro_batch_size=int(max_micro_batch_size or max(table_sizes)), grad_bytes=int(grad_bytes),
                 source=source, noise_scale_factor=noise_scale_factor)
