"""Turn benchmark results into ``report.md`` (tables, targets, plots) and a terminal table.

* :func:`write_report` — ``report.md`` plus the plots of :func:`batchpilot.bench.plots.plot_bench`.
* :func:`write_index` — ``report.md`` of a ``--workload all`` run: one section per workload.
* :func:`format_table` — the per-policy table, as Markdown or aligned plain text.
* :func:`plot_log` — plots of a JSONL adjustment log (re-exported from :mod:`.plots`).

Plotting needs matplotlib (``pip install -e ".[plot]"``); it is imported lazily.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from .._plotting import figures
from .cluster_clock import cluster_clock_lines
from .plots import plot_bench, plot_log
from .summary import category, finish_results

__all__ = ["format_table", "plot_log", "write_index", "write_report"]


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:{spec}}{suffix}"


def _refresh(results: dict[str, Any]) -> dict[str, Any]:
    """Summary, best static, grid cost and targets recomputed from the runs (works on partial files)."""
    return finish_results(dict(results))


def _rows(results: dict[str, Any]) -> list[list[str]]:
    summary, best = results["summary"], results.get("best_static_policy")
    rows = []
    for name, s in summary.items():
        chosen = s.get("chosen")
        label = name + (f" ({chosen})" if chosen and chosen != name else "") + (" (best static)" if name == best else "")
        rows.append([
            label, category(name), f"{s['runs_reached']}/{s['runs']}",
            _fmt(s["median_time_to_target_s"], ".2f", " s"),
            _fmt(s.get("median_cost_model_time_to_target_s"), ".2f", " s"),
            _fmt(s["median_epochs_to_target"], ".2f"),
            _fmt(s["median_samples_to_target"], ",.0f"),
            _fmt(s["median_final_accuracy"], ".4f"),
            _fmt(s["ratio_vs_best_static"], ".2f", "x"),
            _fmt(s.get("cost_ratio_vs_best_static"), ".2f", "x"),
            _fmt(s.get("lr"), ".3g"),
            str(s.get("lr_rule") or "—"),
            _fmt(s.get("median_probe_s"), ".1f", " s"),
            str(s.get("rollbacks", 0)),
            f"{s.get('collapsed', 0)}/{s.get('collapse_judged', 0)}" if s.get("collapse_judged") else "—",
            f"{s.get('cached_runs', 0)}/{s['runs']}" if s.get("cached_runs") else "—",
        ])
    return rows


_HEADER = ["policy", "kind", "reached", "median time to target", "median cost-model time", "median epochs",
           "median samples", "median final acc", "time vs best static", "cost vs best static", "LR", "LR rule",
           "median probes", "rollbacks", "collapsed", "from cache"]


def format_table(results: dict[str, Any], markdown: bool = False) -> str:
    """The results table as Markdown (``markdown=True``) or aligned plain text for a terminal."""
    rows = _rows(_refresh(results))
    if markdown:
        lines = ["| " + " | ".join(_HEADER) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(_HEADER) - 2)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(_HEADER, *rows)]
    fmt = "  ".join([f"{{:<{widths[0]}}}", f"{{:<{widths[1]}}}"] + [f"{{:>{w}}}" for w in widths[2:]])
    return "\n".join(fmt.format(*r) for r in [_HEADER, *rows])


def targets_lines(results: dict[str, Any]) -> list[str]:
    """The Markdown bullets of targets (a)-(d)."""
    t = results.get("targets") or {}
    names = {"a": "(a) vs LR-tuned best static", "b": "(b) vs untuned static:32",
             "c": "(c) one run vs the grid search", "d": "(d) collapsed adaptive runs (missed the target and ended "
             "below static:32's final accuracy on the same seed)"}
    lines = [f"Judged policy (auto when it ran, else the best adaptive by median time to target): "
             f"**{t.get('best_adaptive') or '—'}**.", ""]
    for key in ("a", "b", "c", "d"):
        entry = t.get(key) or {"status": "N/A", "text": "not evaluated"}
        lines.append(f"- {names[key]}: **{entry['status']}** — {entry['text']}")
    grid = results.get("grid_search") or {}
    if grid.get("median_s"):
        lines.append(f"- The LR grid search ({len(grid.get('cells', []))} runs per seed) costs "
                     f"{grid['median_s']:.1f} s of training per seed (median over seeds; cost model "
                     f"{_fmt(grid.get('median_cost_model_s'), '.1f', ' s')}); {_fmt(grid.get('total_s'), '.1f', ' s')} "
                     "over all seeds.")
    return lines


def critical_batch_lines(results: dict[str, Any]) -> list[str]:
    """The Markdown section on the critical batch the static grid implies (empty without static runs)."""
    cb = results.get("critical_batch") or {}
    if not cb.get("points"):
        return []
    pts = ", ".join(f"{b}: {e:.2f}" for b, e in cb["points"])
    lines = ["## Critical batch implied by the static grid", "",
             f"Median epochs to target per static batch size (tuned LR where tuned): {pts}."]
    if cb.get("b_crit") is None:
        lines.append(f"No fit: {cb.get('note')}.")
    else:
        lines.append(f"Least-squares fit of McCandlish et al.'s E = E_min (1 + B / B_crit): E_min = "
                     f"{cb['epochs_min']:.2f} epochs, **B_crit = {cb['b_crit']:.0f}** (twice the minimum samples).")
    if cb.get("b_simple_at_target") is not None:
        lines.append(f"Median B_simple measured when the target was reached ({cb['runs_with_noise']} runs): "
                     f"{cb['b_simple_at_target']:.0f}" + ("" if cb.get("ratio") is None else
                     f"; B_crit / B_simple = **{cb['ratio']:.1f}** (NoiseScale and Goodput aim at B_simple "
                     "x factor, default factor 1)") + ".")
    return lines + [""]


def _grid_table(results: dict[str, Any]) -> list[str]:
    tuned = {n: s for n, s in results["summary"].items() if s.get("grid")}
    if not tuned:
        return []
    lines = ["## LR grid of the tuned statics", "", "Median time to target per cell (— : most runs missed); "
             "**bold**: the cell picked.", "", "| policy | cells |", "|---|---|"]
    for name, s in tuned.items():
        cells = []
        for cell, t in s["grid"].items():
            text = f"{cell.split('@lr=')[-1].split('@')[0] if '@lr=' in cell else 'rule LR'}: {_fmt(t, '.2f', ' s')}"
            cells.append(f"**{text}**" if cell == s.get("chosen") else text)
        lines.append(f"| {name} | {'; '.join(cells)} |")
    return lines + [""]


def _calibration_table(results: dict[str, Any]) -> list[str]:
    cal = results.get("calibration")
    if not cal or not cal.get("sizes"):
        return []
    finder = (results.get("finder") or {}).get("batch_size")
    lines = ["## Throughput calibration (the cost model)", "",
             f"{cal.get('steps_per_size', '?')} timed steps per size, {cal.get('seconds', 0):.1f} s in all; "
             f"finder pick: **{finder}** (smallest size within 5% of the best throughput).", "",
             "| batch | step (ms) | step measuring grad stats (ms) | samples/s |", "|---:|---:|---:|---:|"]
    for b, t, p in zip(cal["sizes"], cal["step_s"], cal["probe_step_s"]):
        lines.append(f"| {b}{' (finder)' if b == finder else ''} | {t * 1e3:.2f} | {p * 1e3:.2f} | {b / t:,.0f} |")
    return lines + ["", "![throughput](throughput.png)", ""]


def _stopped(run: dict[str, Any]) -> str:
    reason = run.get("stop_reason") or ("diverged" if run.get("diverged") else None)
    return f" ({reason})" if reason in ("diverged", "stalled") else ""


def _window_text(window: Any) -> str:
    if window == 1:
        return "; the target counts at the first evaluation at or above it"
    return f"; the target counts at the first evaluation where the mean of the last {window} evaluations reaches it"


def _markdown(results: dict[str, Any], plots: dict[str, Path]) -> str:
    cfg = results.get("config", {})
    target = results.get("target_accuracy")
    lines = [
        f"# batchpilot bench: {results.get('workload', '?')}",
        "",
        f"Target test accuracy **{target}**, seeds {cfg.get('seeds', '?')}, budget {cfg.get('budget_s', '?')} s of "
        f"training per run. Time is training wall time with evaluation excluded (evaluated every "
        f"{cfg.get('eval_every_epochs', '?')} epochs of samples, so times are quantised to evaluation points"
        f"{_window_text(cfg.get('target_window', 1))}); the cost-model time sums calibrated step times over the steps, so it does not move with the machine's "
        "load. Medians count a run that missed the target as infinitely slow (— when half or more missed it). "
        f"LR rule: {cfg.get('lr_rule', '?')} from lr {cfg.get('base_lr', '?')} at batch {cfg.get('base_batch_size', '?')}.",
        "",
        "## Targets",
        "",
        *targets_lines(results),
        "",
        "## Median time to target and ratio to the best static",
        "",
        format_table(results, markdown=True),
        "",
        *_grid_table(results),
        *critical_batch_lines(results),
        *cluster_clock_lines(results),
    ]
    for key, title in (("accuracy_vs_time", "accuracy vs time"), ("batch_size_vs_time", "batch size vs time"),
                       ("noise_scale", "noise scale over training")):
        if key in plots:
            lines += [f"![{title}]({plots[key].name})", ""]
    lines += _calibration_table(results)
    lines += [
        "## Runs",
        "",
        "| run | seed | time to target | cost model | steps | samples | epochs | final acc | training time | samples/s "
        "| load avg | probes | rollbacks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        probe = r.get("probe") or {}
        lines.append(
            f"| {r['policy']}{_stopped(r)}{' (cached)' if r.get('cached') else ''} | {r['seed']} | "
            f"{_fmt(r['time_to_target_s'], '.2f', ' s')} | {_fmt(r.get('cost_model_time_to_target_s'), '.2f', ' s')} | "
            f"{_fmt(r['steps_to_target'], ',')} | {_fmt(r['samples_to_target'], ',')} | "
            f"{_fmt(r.get('epochs_to_target'), '.2f')} | {_fmt(r['final_accuracy'], '.4f')} | "
            f"{_fmt(r['wall_s'], '.1f', ' s')} | {_fmt(r.get('samples_per_s'), ',.0f')} | {_fmt(r.get('load_avg_1min'), '.1f')} | "
            f"{_fmt(probe.get('seconds'), '.1f', ' s')} | {r.get('rollbacks', 0)} |"
        )
    lines += ["", "(cached): a static run read from the bench's cache (keyed by everything that determines it; "
              "`--no-cache` trains it again). probes: wall time of auto's start probes, inside its training time.",
              "", "Steps and samples to target do not depend on the machine's load (same seed and thread "
              "count, same numbers), except for goodput and threshold-rules, whose decisions read step times and "
              "CPU load; wall times do. A high load average (other processes) marks a run whose time "
              "is inflated; the cost-model column is immune to it."]
    if cfg:
        lines += ["", "## Setup", ""]
        for key in ("description", "policies", "seeds", "budget_s", "tune_factors", "min_batch_size",
                    "max_batch_size", "train_samples", "test_samples", "torch", "torch_threads", "device", "device_name",
                    "python", "platform"):
            if key in cfg:
                lines.append(f"- {key}: {cfg[key]}")
    return "\n".join(lines) + "\n"


RUN_KEYS = ("policy", "seed", "time_to_target_s", "steps_to_target", "samples_to_target", "final_accuracy", "wall_s")


def check_results(results: Any, path: str | os.PathLike = "results.json") -> None:
    """Raise a ``ValueError`` naming what is missing when ``results`` is not a complete bench results.json:
    the runs :func:`write_report` reads (summaries and targets are recomputed from them)."""
    where = f"{str(path)!r} is not a complete bench results.json"
    runs = results.get("runs")
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise ValueError(f"{where}: 'runs' must be a list of objects; pass one written by `batchpilot bench`.")
    for i, run in enumerate(runs):
        missing = [k for k in RUN_KEYS if k not in run]
        if missing:
            raise ValueError(f"{where}: run {i} lacks {', '.join(missing)}.")


def write_report(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``report.md`` and the plots into ``out_dir`` (without matplotlib: ``report.md`` alone, saying so).

    Args:
        results: What :func:`~batchpilot.bench.runner.run_benchmark` returned (or ``results.json`` loaded).
        out_dir: Folder to write into (created if needed).

    Returns:
        ``{"report": ..., "accuracy_vs_time": ..., "batch_size_vs_time": ...}`` paths, plus
        ``"noise_scale"`` and ``"throughput"`` when there was something to plot.

    Raises:
        ValueError: ``results`` has no runs.
    """
    if not results.get("runs"):
        raise ValueError("the results hold no runs: nothing to report; run `batchpilot bench` first.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = _refresh(results)
    try:
        figures()
    except ImportError as exc:  # the tables are the report; the plots are extra
        path = out / "report.md"
        path.write_text(_markdown(results, {}) + f"\n(No plots: {exc})\n", encoding="utf-8")
        return {"report": path}
    paths = {"report": out / "report.md", **plot_bench(results, out)}
    paths["report"].write_text(_markdown(results, paths), encoding="utf-8")
    return paths


def write_index(all_results: dict[str, dict[str, Any]], out_dir: str | os.PathLike) -> Path:
    """``report.md`` of a ``--workload all`` run: per workload, its targets and table, linking its report."""
    out = Path(out_dir)
    lines = ["# batchpilot bench: all workloads", "",
             "Target (a) asks <= 1.0x the LR-tuned best static on every workload (stretch <= 0.85x on mnist1d and "
             "markov); (b) >= 3x faster than static:32; (c) one run <= 1/10 of the grid search; (d) no collapsed "
             "adaptive run.", ""]
    for name, results in all_results.items():
        results = _refresh(results)
        lines += [f"## {name} (target {results['target_accuracy']})", "", f"Details: [{name}/report.md]({name}/report.md)",
                  "", *targets_lines(results), "", format_table(results, markdown=True), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
