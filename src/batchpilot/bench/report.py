"""Turn benchmark results and adjustment logs into a Markdown report and PNG plots.

* :func:`write_report` — ``report.md`` (one row per policy) plus ``accuracy_vs_time.png`` and
  ``batch_size_vs_time.png`` (all policies on one figure, one line per run, one colour per policy).
* :func:`plot_log` — ``batch_size.png``, ``loss.png`` and ``lr.png`` from any JSONL adjustment log.

Plotting needs matplotlib (``pip install "batchpilot[plot]"``); it is imported lazily with the
non-interactive Agg backend, so nothing here opens a window or needs a display.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

__all__ = ["format_table", "plot_log", "write_report"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            'plotting needs matplotlib, an optional extra of batchpilot; install it with: pip install "batchpilot[plot]"'
        ) from exc
    matplotlib.use("Agg", force=True)  # files only; never a GUI backend
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------- report
def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:{spec}}{suffix}"


def _rows(results: dict[str, Any]) -> list[list[str]]:
    from .runner import summarize

    runs = results["runs"]
    policies = list(results.get("summary") or dict.fromkeys(r["policy"] for r in runs))
    summary, best = summarize(runs, policies)  # recomputed: also works on hand-edited or partial results
    rows = []
    for name in policies:
        s = summary[name]
        rows.append([
            name + (" (best static)" if name == best else ""),
            f"{s['runs_reached']}/{s['runs']}",
            _fmt(s["median_time_to_target_s"], ".2f", " s"),
            _fmt(s["median_samples_to_target"], ",.0f"),
            _fmt(s["median_epochs_to_target"], ".2f"),
            _fmt(s["median_final_accuracy"], ".4f"),
            _fmt(s["ratio_vs_best_static"], ".2f", "x"),
        ])
    return rows


_HEADER = ["policy", "reached", "median time to target", "median samples", "median epochs",
           "median final acc", "time vs best static"]


def format_table(results: dict[str, Any], markdown: bool = False) -> str:
    """The results table as Markdown (``markdown=True``) or aligned plain text for a terminal."""
    rows = _rows(results)
    if markdown:
        lines = ["| " + " | ".join(_HEADER) + " |", "|" + "|".join(["---"] + ["---:"] * (len(_HEADER) - 1)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(_HEADER, *rows)]
    fmt = "  ".join(["{:<%d}" % widths[0]] + ["{:>%d}" % w for w in widths[1:]])
    return "\n".join(fmt.format(*r) for r in [_HEADER, *rows])


def _colours(policies: list[str]) -> dict[str, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {p: cmap(i % 10) for i, p in enumerate(policies)}


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


def write_report(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``report.md``, ``accuracy_vs_time.png`` and ``batch_size_vs_time.png`` into ``out_dir``.

    Args:
        results: What :func:`~batchpilot.bench.runner.run_benchmark` returned (or ``results.json`` loaded).
        out_dir: Folder to write into (created if needed).

    Returns:
        ``{"report": ..., "accuracy_vs_time": ..., "batch_size_vs_time": ...}`` paths.

    Raises:
        ImportError: matplotlib is missing (names the extra to install).
        ValueError: ``results`` has no runs.
    """
    if not results.get("runs"):
        raise ValueError("the results hold no runs: nothing to report; run `batchpilot bench` first.")
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    colours = _colours(policies)
    target = results.get("target_accuracy")
    paths = {"report": out / "report.md", "accuracy_vs_time": out / "accuracy_vs_time.png",
             "batch_size_vs_time": out / "batch_size_vs_time.png"}

    # Accuracy vs training wall time: one line per run; the legend names each policy once.
    fig, ax = plt.subplots(figsize=(8, 5))
    labelled: set[str] = set()
    for run in runs:
        curve = run.get("curve") or []
        if not curve:
            continue
        label = None if run["policy"] in labelled else run["policy"]
        labelled.add(run["policy"])
        ax.plot([p["time_s"] for p in curve], [p["accuracy"] for p in curve], color=colours[run["policy"]],
                alpha=0.85, lw=1.5, label=label, marker=".", ms=3)
        if run.get("time_to_target_s") is not None:
            ax.plot([run["time_to_target_s"]], [target], marker="o", color=colours[run["policy"]], ms=5)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
    accs = [p["accuracy"] for r in runs for p in (r.get("curve") or [])]
    if accs and target is not None:
        # Zoom in on the interesting part: from a bit below the target to the top.
        ax.set_ylim(max(0.0, min(target - 0.25, sorted(accs)[len(accs) // 10])), min(1.0, max(max(accs), target) + 0.01))
    ax.set_xlabel("training wall time (s, evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{results.get('workload', '')}: test accuracy vs training time")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(paths["accuracy_vs_time"], dpi=110)
    plt.close(fig)

    # Batch size vs training wall time (log scale: the sizes are powers of two apart).
    fig, ax = plt.subplots(figsize=(8, 4))
    seen: set[str] = set()
    for run in runs:
        times, sizes = _batch_steps(run)
        if not times:
            continue
        label = None if run["policy"] in seen else run["policy"]
        seen.add(run["policy"])
        ax.step(times, sizes, where="post", color=colours[run["policy"]], alpha=0.85, lw=1.5, label=label)
    _log2_axis(ax)
    ax.set_xlabel("training wall time (s, evaluation excluded)")
    ax.set_ylabel("global batch size")
    ax.set_title(f"{results.get('workload', '')}: batch size vs training time")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(paths["batch_size_vs_time"], dpi=110)
    plt.close(fig)

    paths["report"].write_text(_markdown(results), encoding="utf-8")
    return paths


def _log2_axis(ax: Any) -> None:
    """Log-2 y axis labelled with plain integers (32, 64, ...) rather than powers of two."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _markdown(results: dict[str, Any]) -> str:
    cfg = results.get("config", {})
    target = results.get("target_accuracy")
    lines = [
        f"# batchpilot bench: {results.get('workload', '?')}",
        "",
        f"Target test accuracy **{target}**; time is training wall time with evaluation excluded "
        f"(evaluated every {cfg.get('eval_every_epochs', '?')} epochs of samples, so times are quantised "
        "to evaluation points). Medians count a run that missed the target as infinitely slow (— when "
        "half or more missed it). LR rule: "
        f"{cfg.get('lr_rule', '?')} from lr {cfg.get('base_lr', '?')} at batch {cfg.get('base_batch_size', '?')}.",
        "",
        format_table(results, markdown=True),
        "",
        "![accuracy vs time](accuracy_vs_time.png)",
        "",
        "![batch size vs time](batch_size_vs_time.png)",
        "",
        "## Runs",
        "",
        "| policy | seed | time to target | steps | samples | final acc | training time | samples/s | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['policy']} | {r['seed']} | {_fmt(r['time_to_target_s'], '.2f', ' s')} | "
            f"{_fmt(r['steps_to_target'], ',')} | {_fmt(r['samples_to_target'], ',')} | "
            f"{_fmt(r['final_accuracy'], '.4f')} | {_fmt(r['wall_s'], '.1f', ' s')} | "
            f"{_fmt(r.get('samples_per_s'), ',.0f')} | {_fmt(r.get('load_avg_1min'), '.1f')} |"
        )
    lines += ["", "Steps and samples to target do not depend on the machine's load (same seed and thread "
              "count, same numbers); times do. A high load average (other processes) marks a run whose time "
              "is inflated."]
    if cfg:
        lines += ["", "## Setup", ""]
        for key in ("description", "seeds", "budget_s", "train_samples", "test_samples", "torch",
                    "torch_threads", "python", "platform"):
            if key in cfg:
                lines.append(f"- {key}: {cfg[key]}")
    return "\n".join(lines) + "\n"


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

    plt = _pyplot()
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
            ax.step(xs, ys, where="post", lw=1.5)
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
                clean = [y if math.isfinite(y) else 0.0 for y in ys]
                csum = [0.0]
                for y in clean:
                    csum.append(csum[-1] + y)
                smooth = [(csum[i + 1] - csum[max(0, i - k + 1)]) / (i + 1 - max(0, i - k + 1)) for i in range(len(ys))]
                ax.plot(xs, smooth, lw=2, color="C1", label=f"mean of {k} steps")
                ax.legend(loc="best")
        finite = [y for y in ys if math.isfinite(y) and y > 0]
        if log_y and finite and max(finite) / min(finite) > 4:
            if key == "batch/global_size":
                _log2_axis(ax)
            else:
                ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{path.name}: {ylabel}")
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        target = out / name
        fig.savefig(target, dpi=110)
        plt.close(fig)
        paths.append(target)
    return paths
