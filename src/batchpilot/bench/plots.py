"""Plots of the benchmark and of adjustment logs (PNG files drawn by :mod:`batchpilot._plotting`: no display,
no pyplot, the process's backend untouched).

Bench plots (one line per run, one colour per policy; grid cells other than a tuned policy's chosen LR
are left out to keep the figures readable): ``accuracy_vs_time.png``, ``batch_size_vs_time.png``,
``noise_scale.png`` (B_simple over training, for runs that measured it) and ``throughput.png`` (the
calibrated samples/s against batch size, with the finder's pick). :func:`plot_log` plots any JSONL
adjustment log. matplotlib is imported lazily (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .._plotting import figures, finish

__all__ = ["plot_bench", "plot_log"]


def _batch_steps(run: dict[str, Any]) -> tuple[list[float], list[int]]:
    """(times, sizes) of a run's batch-size trace, extended to the end of the run, for a step plot."""
    trace = run.get("batch_sizes") or []
    if trace and isinstance(trace[0], dict):
        times = [float(p["time_s"]) for p in trace]
        sizes = [int(p["batch_size"]) for p in trace]
    else:  # a plain list of per-step sizes: no times, spread evenly over the run
        n = max(len(trace), 1)
        times = [run.get("wall_s", 0.0) * i / n for i in range(len(trace))]
        sizes = [int(s) for s in trace]
    if times:
        times.append(max(float(run.get("wall_s") or times[-1]), times[-1]))
        sizes.append(sizes[-1])
    return times, sizes


def _log2_axis(ax: Any) -> None:
    """Log-2 y axis labelled with plain integers (32, 64, ...) rather than powers of two."""
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(_int_formatter())



def _plotted_runs(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, run) for the runs of each requested policy (a tuned policy: its chosen LR), each run once."""
    summary = results.get("summary") or {}
    names = list(summary) or list(dict.fromkeys(r["policy"] for r in results["runs"]))
    out, seen = [], set()
    for name in names:
        member = (summary.get(name) or {}).get("chosen", name)
        if member in seen:
            continue
        seen.add(member)
        label = name if member == name else f"{name} ({member})"
        out += [(label, r) for r in results["runs"] if r["policy"] == member]
    listed = {r["policy"] for _, r in out}
    if not out or not summary:  # no summary: every run as itself
        out += [(r["policy"], r) for r in results["runs"] if r["policy"] not in listed]
    return out


def _colours(labels: list[str]) -> dict[str, Any]:
    plt = figures()
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {p: cmap(i % cmap.N) for i, p in enumerate(labels)}


def plot_bench(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write the bench plots into ``out``; returns ``{name: path}`` of the files written."""
    plt = figures()
    runs = _plotted_runs(results)
    labels = list(dict.fromkeys(label for label, _ in runs))
    colours = _colours(labels)
    target = results.get("target_accuracy")
    workload = results.get("workload", "")
    paths = {"accuracy_vs_time": out / "accuracy_vs_time.png", "batch_size_vs_time": out / "batch_size_vs_time.png"}

    # Accuracy vs training wall time; the legend names each policy once.
    fig, ax = plt.subplots(figsize=(9, 5.5))
    labelled: set[str] = set()
    for label, run in runs:
        curve = run.get("curve") or []
        if not curve:
            continue
        ax.plot([p["time_s"] for p in curve], [p["accuracy"] for p in curve], color=colours[label], alpha=0.85,
                lw=1.3, label=None if label in labelled else label, marker=".", ms=3)
        labelled.add(label)
        if run.get("time_to_target_s") is not None and target is not None:
            ax.plot([run["time_to_target_s"]], [target], marker="o", color=colours[label], ms=5)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
    accs = [p["accuracy"] for _, r in runs for p in (r.get("curve") or [])]
    if accs and target is not None:
        # Zoom in on the interesting part: from a bit below the target to the top.
        ax.set_ylim(max(0.0, min(target - 0.25, sorted(accs)[len(accs) // 10])), min(1.0, max(max(accs), target) + 0.01))
    finish(fig, ax, paths["accuracy_vs_time"], "training wall time (s, evaluation excluded)", "test accuracy",
            f"{workload}: test accuracy vs training time", legend="lower right", grid="major")

    # Batch size vs training wall time (log scale: the sizes are powers of two apart).
    fig, ax = plt.subplots(figsize=(9, 4.5))
    seen: set[str] = set()
    for label, run in runs:
        times, sizes = _batch_steps(run)
        if times:
            ax.step(times, sizes, where="post", color=colours[label], alpha=0.85, lw=1.3,
                    label=None if label in seen else label)
            seen.add(label)
    _log2_axis(ax)
    finish(fig, ax, paths["batch_size_vs_time"], "training wall time (s, evaluation excluded)", "global batch size",
            f"{workload}: batch size vs training time")

    # Gradient noise scale over training, where it was measured.
    noisy = [(label, run) for label, run in runs if any(p.get("noise_scale") for p in run.get("curve") or [])]
    if noisy:
        paths["noise_scale"] = out / "noise_scale.png"
        fig, ax = plt.subplots(figsize=(9, 4.5))
        seen = set()
        for label, run in noisy:
            pts = [(p["epochs"], p["noise_scale"], p["batch_size"]) for p in run["curve"] if p.get("noise_scale")]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colours[label], lw=1.3,
                    label=None if label in seen else f"{label}: B_simple")
            # A point's batch size is that of the step before the evaluation: it held up to the point.
            ax.step([p[0] for p in pts], [p[2] for p in pts], where="pre", color=colours[label], lw=0.8, ls=":",
                    label=None if label in seen else f"{label}: batch size")
            seen.add(label)
        ax.set_yscale("log")
        finish(fig, ax, paths["noise_scale"], "epochs", "samples",
                f"{workload}: gradient noise scale B_simple (McCandlish et al. 2018) and batch size")

    cal = results.get("calibration")
    if cal and cal.get("sizes"):
        paths["throughput"] = out / "throughput.png"
        fig, ax = plt.subplots(figsize=(7, 4))
        rates = cal.get("samples_per_s") or [b / t for b, t in zip(cal["sizes"], cal["step_s"])]
        ax.plot(cal["sizes"], rates, marker="o", label="plain steps")
        ax.plot(cal["sizes"], [b / t for b, t in zip(cal["sizes"], cal["probe_step_s"])], marker=".", ls="--",
                label="steps measuring gradient statistics")
        pick = (results.get("finder") or {}).get("batch_size")
        if pick in cal["sizes"]:
            ax.plot([pick], [rates[cal["sizes"].index(pick)]], marker="*", ms=14, color="C3", ls="",
                    label=f"finder: {pick}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_int_formatter())
        finish(fig, ax, paths["throughput"], "global batch size", "samples / s (calibration)",
                f"{workload}: throughput vs batch size", legend_size=8)
    return paths


def _int_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


# --------------------------------------------------------------------------------------- log plots
def _num(value: Any) -> float:
    try:
        return float(value)  # NaN/inf are logged as strings ("nan"), which float() reads back
    except (TypeError, ValueError):
        return math.nan


def plot_log(log_path: str | os.PathLike, out_dir: str | os.PathLike, x: str = "samples") -> list[Path]:
    """Plot an adjustment log: ``batch_size.png``, ``loss.png`` and ``lr.png`` in ``out_dir``.

    Args:
        log_path: A JSONL log written by :class:`batchpilot.Pilot` (``log_path=``).
        out_dir: Folder for the PNGs (created if needed).
        x: ``"samples"`` (``samples_seen``) or ``"time"`` (wall time, the sum of ``perf/step_time_s``).

    Returns:
        The three paths.

    Raises:
        FileNotFoundError: ``log_path`` does not exist.
        ValueError: the file is empty, not JSONL, or holds no step records; ``x`` is unknown.
        ImportError: matplotlib is missing.
    """
    from ..logs import read_log

    if x not in ("samples", "time"):
        raise ValueError(f"x must be 'samples' or 'time', got {x!r}.")
    path = Path(log_path)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a folder; pass the .jsonl adjustment log file inside it.")
    records = read_log(path)
    if not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{str(path)!r} holds JSON lines that are not objects; is this a batchpilot log?")
    steps = [r for r in records if r.get("type") == "step"]
    if not steps:
        raise ValueError(
            f"{str(path)!r} has {len(records)} records but none of type 'step'; is this a batchpilot "
            "adjustment log (Pilot(log_path=...))?"
        )
    missing = [k for k in ("samples_seen", "batch/global_size") if k not in steps[0]]
    if missing:
        raise ValueError(f"{str(path)!r}: step records lack {', '.join(missing)}; is this a batchpilot log?")
    decisions = [r for r in records if r.get("type") == "decision"]

    if x == "samples":
        xs = [_num(r["samples_seen"]) for r in steps]
        xlabel = "samples seen"
    else:
        total, xs = 0.0, []
        for r in steps:
            t = _num(r.get("perf/step_time_s"))
            total += t if math.isfinite(t) else 0.0
            xs.append(total)
        xlabel = "wall time (s, sum of step times)"

    plt = figures()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, name, ylabel, log_y in (
        ("batch/global_size", "batch_size.png", "global batch size", True),
        ("loss", "loss.png", "training loss", True),
        ("lr", "lr.png", "learning rate", False),
    ):
        ys = [_num(r.get(key)) for r in steps]
        fig, ax = plt.subplots(figsize=(8, 4))
        if key == "batch/global_size":
            # A step's x is where it ended: its size holds over (previous x, x]. The first step starts at
            # its samples_seen less its size (0 unless the log starts after a resume), or at time 0.
            start = xs[0] - ys[0] if x == "samples" else 0.0
            ax.step([start, *xs], [ys[0], *ys], where="pre", lw=1.5)
            # Mark where a decision changed the size (it applies from the next step on).
            x_of_step = {r.get("step"): xv for r, xv in zip(steps, xs)}
            marks = [(x_of_step[d["step"]], _num(d.get("new_size"))) for d in decisions
                     if d.get("old_size") != d.get("new_size") and d.get("step") in x_of_step]
            if marks:
                ax.plot([m[0] for m in marks], [m[1] for m in marks], "o", ms=3, color="C3", label="decision")
                ax.legend(loc="best")
        else:
            ax.plot(xs, ys, lw=1)
            if key == "loss" and len(ys) > 50:
                # A moving average makes the trend readable under per-step noise.
                k = max(5, len(ys) // 50)
                # Over the finite losses of each window only: a skipped (NaN) step is no loss of 0.
                csum, count = [0.0], [0]
                for y in ys:
                    ok = math.isfinite(y)
                    csum.append(csum[-1] + (y if ok else 0.0))
                    count.append(count[-1] + ok)
                smooth = []
                for i in range(len(ys)):
                    n = count[i + 1] - count[max(0, i - k + 1)]
                    smooth.append((csum[i + 1] - csum[max(0, i - k + 1)]) / n if n else math.nan)
                ax.plot(xs, smooth, lw=2, color="C1", label=f"mean of {k} steps")
                ax.legend(loc="best")
        finite = [y for y in ys if math.isfinite(y)]
        # A log axis only when every value can be drawn on it (a loss may be <= 0: GaussianNLLLoss, say).
        if log_y and finite and min(finite) > 0 and max(finite) / min(finite) > 4:
            if key == "batch/global_size":
                _log2_axis(ax)
            else:
                ax.set_yscale("log")
        target = out / name
        finish(fig, ax, target, xlabel, ylabel, f"{path.name}: {ylabel}", legend=None)
        paths.append(target)
    return paths
