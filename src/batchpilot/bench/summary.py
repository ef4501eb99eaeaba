"""From runs to verdicts: per-policy medians, the tuned and best static, the grid's cost, targets (a)-(d).

Medians count a run that missed the target as infinitely slow, so a policy's median time is ``None``
unless more than half of its runs reached the target. Everything here is a pure function of the runs, so
``batchpilot report results.json`` recomputes it from a hand-edited or partial file.

The targets are issue 21's, judged for ``auto`` when it ran (else for the best adaptive controller): (a) its
median time to target <= 1.0x the LR-tuned best static's (stretch <= 0.85x on ``STRETCH_WORKLOADS``), at a final
accuracy no lower than the best static's minus 0.3 points; (b) >= 3x faster than ``static:32`` at the base LR;
(c) one run <= 1/10 of the grid search; (d) no *collapsed* run of an adaptive policy with its defaults: one that
missed the target and ended below the final accuracy ``static:32`` reached in the same budget on the same seed
(:func:`collapse_floor`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ACCURACY_SLACK", "collapse_floor", "critical_batch", "evaluate_targets", "finish_results",
           "grid_search_cost", "is_collapsed", "summarize"]

ACCURACY_SLACK = 0.003  # target (a): final accuracy no lower than the best static's minus 0.3 points
ADAPTIVE = ("noise-scale", "goodput", "variance-rule", "threshold-rules", "ppo", "auto")
STRETCH_WORKLOADS = ("mnist1d", "markov")  # target (a)'s stretch, <= 0.85x, is asked on these
LIMIT_A, STRETCH_A, SPEEDUP_B, SHARE_C = 1.0, 0.85, 3.0, 10.0
UNTUNED = "static:32"


def collapse_floor(runs: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """``{seed: final accuracy of static:32}``: what the untuned default reached in the same budget (at least its
    final accuracy: a run that reached the target stopped there)."""
    return {r["seed"]: float(r["final_accuracy"]) for r in runs
            if r["policy"] == UNTUNED and r.get("final_accuracy") is not None}


def is_collapsed(run: Mapping[str, Any], floor: Mapping[int, float]) -> bool | None:
    """Target (d): the run missed the target and ended below ``static:32``'s final accuracy on its seed (``None``
    when ``static:32`` has no run on that seed). A run that reached the target never collapsed."""
    if run.get("time_to_target_s") is not None:
        return False
    if run["seed"] not in floor or run.get("final_accuracy") is None:
        return None
    return float(run["final_accuracy"]) < floor[run["seed"]]


def _median_or_none(values: list[float]) -> float | None:
    """Median where ``inf`` marks a run that missed the target; ``None`` if the median is not finite."""
    if not values:
        return None
    m = statistics.median(values)
    return m if math.isfinite(m) else None


def _cell(rs: list[dict[str, Any]], floor: Mapping[int, float] | None = None) -> dict[str, Any]:
    """Medians over the runs of one configuration, and its rollbacks, collapses and probe times."""

    def med(key: str) -> float | None:
        return _median_or_none([math.inf if r.get(key) is None else float(r[key]) for r in rs])

    finals = [r["final_accuracy"] for r in rs if r.get("final_accuracy") is not None]
    walls = [r["wall_s"] for r in rs if r.get("wall_s") is not None]
    judged = [is_collapsed(r, floor or {}) for r in rs]
    probes = [r["probe"]["seconds"] for r in rs if isinstance(r.get("probe"), dict)]
    return {
        "median_time_to_target_s": med("time_to_target_s"),
        "median_cost_model_time_to_target_s": med("cost_model_time_to_target_s"),
        "median_steps_to_target": med("steps_to_target"),
        "median_samples_to_target": med("samples_to_target"),
        "median_epochs_to_target": med("epochs_to_target"),
        "median_final_accuracy": statistics.median(finals) if finals else None,
        "median_wall_s": statistics.median(walls) if walls else None,
        "runs": len(rs),
        "runs_reached": sum(r.get("time_to_target_s") is not None for r in rs),
        "rollbacks": sum(int(r.get("rollbacks") or 0) for r in rs),
        "runs_with_rollbacks": sum(bool(r.get("rollbacks")) for r in rs),
        "collapsed": sum(c is True for c in judged),
        "collapse_judged": sum(c is not None for c in judged),
        "median_probe_s": statistics.median(probes) if probes else None,
        "cached_runs": sum(bool(r.get("cached")) for r in rs),
        "ratio_vs_best_static": None,
        "cost_ratio_vs_best_static": None,
        # Token budgets (the gpt workload): tokens trained until the target.
        **({"median_tokens_to_target": med("tokens_to_target")} if any("tokens_to_target" in r for r in rs) else {}),
    }


def _key(s: Mapping[str, Any], field: str = "median_time_to_target_s") -> tuple[float, float]:
    """Sort key: median time (missing = inf), then higher final accuracy."""
    t = s.get(field)
    return (math.inf if t is None else t, -(s.get("median_final_accuracy") or 0.0))


def is_static(name: str) -> bool:
    return name.startswith(("static:", "tuned-static:"))


def category(name: str) -> str:
    if is_static(name):
        return "static"
    kind = re.split(r"[:@]", name, maxsplit=1)[0]
    if kind in ADAPTIVE:
        return "adaptive"
    return "finder" if kind == "finder" else "schedule"


def summarize(
    runs: list[dict[str, Any]],
    policies: Sequence[str] | None = None,
    members: Mapping[str, Sequence[str]] | None = None,
) -> tuple[dict[str, Any], str | None]:
    """Per-policy medians and ratios; returns ``(summary, best_static_policy)``.

    Args:
        runs: Run dicts (``policy`` is the run's configuration name).
        policies: Requested policy names, in order (default: the run names in order of appearance).
        members: ``{policy: [run names]}`` (default: each policy is its own run name). A policy with
            several members (``tuned-static:N``: its LR grid) takes the member with the best median time
            to target (then the best median final accuracy), and records ``chosen``, ``lr`` and ``grid``.

    ``ratio_vs_best_static`` divides by the median time of the best static (the smallest median time among
    ``static:*`` and ``tuned-static:*`` policies); ``cost_ratio_vs_best_static`` divides cost-model times by
    the same policy's cost-model time. Both stay ``None`` when that time is 0 (the untrained model already
    met the target).
    """
    names = list(policies) if policies is not None else list(dict.fromkeys(r["policy"] for r in runs))
    members = members or {}
    floor = collapse_floor(runs)
    cells = {n: _cell([r for r in runs if r["policy"] == n], floor) for n in dict.fromkeys(r["policy"] for r in runs)}
    summary: dict[str, Any] = {}
    for name in names:
        group = [m for m in members.get(name, [name]) if m in cells] or [name]
        if len(group) == 1:
            summary[name] = dict(cells.get(group[0]) or _cell([]))
            if group[0] != name:
                summary[name]["chosen"] = group[0]
            continue
        chosen = min(group, key=lambda m: _key(cells[m]))
        summary[name] = {**cells[chosen], "chosen": chosen,
                         "grid": {m: cells[m]["median_time_to_target_s"] for m in group}}
    for name, s in summary.items():
        first = next((r for r in runs if r["policy"] == s.get("chosen", name)), None)
        if first is not None and first.get("lr") is not None:
            s["lr"] = first["lr"]  # the LR of the first step
        if first is not None:
            s["lr_rule"] = first.get("lr_rule")
    statics = {n: s for n, s in summary.items() if is_static(n) and s["median_time_to_target_s"] is not None}
    # Ties (tuned-static:N and the static:N it chose are the same runs) go to the tuned name.
    best = min(statics, key=lambda n: (_key(statics[n]), not n.startswith("tuned-"))) if statics else None
    best_cost = None if best is None else statics[best].get("median_cost_model_time_to_target_s")
    for s in summary.values():
        if best is not None and statics[best]["median_time_to_target_s"] > 0:
            t = s["median_time_to_target_s"]
            s["ratio_vs_best_static"] = None if t is None else t / statics[best]["median_time_to_target_s"]
        c = s.get("median_cost_model_time_to_target_s")
        if best_cost and c is not None:
            s["cost_ratio_vs_best_static"] = c / best_cost
    return summary, best


def grid_search_cost(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the LR-tuned static grid costs: per seed, the sum of training time of every grid run.

    ``median_s`` (the key ``grid_search_total_s`` of results.json) is the median over seeds of that sum:
    what one grid search with one seed costs a user. ``total_s`` sums over every seed.
    """
    per_seed: dict[int, float] = {}
    per_seed_cost: dict[int, float] = {}
    cells = set()
    for r in runs:
        if r.get("grid"):
            cells.add(r["policy"])
            per_seed[r["seed"]] = per_seed.get(r["seed"], 0.0) + float(r["wall_s"])
            per_seed_cost[r["seed"]] = per_seed_cost.get(r["seed"], 0.0) + float(r.get("cost_model_s") or 0.0)
    return {
        "cells": sorted(cells),
        "per_seed_s": {str(k): v for k, v in sorted(per_seed.items())},
        "median_s": statistics.median(per_seed.values()) if per_seed else None,
        "median_cost_model_s": statistics.median(per_seed_cost.values()) if per_seed_cost else None,
        "total_s": sum(per_seed.values()) if per_seed else None,
    }


def _verdict(ok: bool | None) -> str:
    return "N/A" if ok is None else ("PASS" if ok else "MISS")


def _judged(summary: Mapping[str, Any]) -> tuple[str | None, str]:
    """The policy the targets judge: ``auto`` when it has runs, else the fastest adaptive one; and why none."""
    # A policy without runs yet (a partial results.json) has not missed anything: it is not judged.
    adaptive = {n: s for n, s in summary.items() if category(n) == "adaptive" and s.get("runs", 1)}
    if "auto" in adaptive:
        return "auto", ""
    if not adaptive:
        return None, ("no adaptive policy in this run" if not any(category(n) == "adaptive" for n in summary)
                      else "no adaptive run has finished yet")
    return min(adaptive, key=lambda n: _key(adaptive[n])), ""


def _target_d(summary: Mapping[str, Any]) -> dict[str, Any]:
    """(d) no collapsed run among the adaptive policies with their defaults (names without ``@``)."""
    judged = {n: s for n, s in summary.items() if n.split("@")[0] in ADAPTIVE and "@" not in n and s.get("runs")}
    count = sum(s.get("collapse_judged", 0) for s in judged.values())
    if not count:
        return {"status": "N/A", "value": None, "threshold": 0,
                "text": "needs static:32 and an adaptive policy with its defaults on the same seeds"}
    bad = {n: s["collapsed"] for n, s in judged.items() if s.get("collapsed")}
    rolled = sum(s.get("rollbacks", 0) for s in judged.values())
    text = (f"{sum(bad.values())} of {count} runs collapsed" + (f" ({', '.join(f'{n}: {k}' for n, k in bad.items())})"
            if bad else "") + f"; {rolled} rollbacks logged (decision/rollback) in these runs")
    return {"status": _verdict(not bad), "value": sum(bad.values()), "threshold": 0, "text": text}


def evaluate_targets(summary: Mapping[str, Any], best_static: str | None, grid: Mapping[str, Any],
                     untuned: str | None, stretch: bool) -> dict[str, Any]:
    """Issue 21's targets (module docstring) for ``auto``, else the best adaptive policy by median time.

    (a) ratio to the best static <= 1.0 (``stretch``: also says whether <= 0.85), at a median final accuracy no
    lower than the best static's minus 0.3 points; (b) >= 3x faster than the untuned default; (c) one run
    (its median training time) <= 1/10 of the grid search; (d) no collapsed adaptive run. Each entry:
    ``status`` (PASS, MISS, N/A), ``value``, ``threshold``, ``text``; ``best_adaptive`` names the judged policy.
    """
    name, why = _judged(summary)
    out: dict[str, Any] = {"best_adaptive": name, "d": _target_d(summary)}
    if name is None:
        na = {"status": "N/A", "value": None, "threshold": None, "text": why}
        return {**out, "a": na, "b": dict(na), "c": dict(na)}
    s = summary[name]
    t = s["median_time_to_target_s"]
    bs = summary.get(best_static) if best_static else None
    if bs is not None and bs["median_time_to_target_s"] == 0:
        na = {"status": "N/A", "value": None, "threshold": None,
              "text": f"{best_static} met the target before its first step (the untrained model already reaches "
              "it): nothing to compare; raise --target-accuracy"}
        return {**out, "a": na, "b": dict(na), "c": dict(na)}

    # (a)
    ratio = s["ratio_vs_best_static"]
    if bs is None or t is None:
        why = "no static policy reached the target" if bs is None else f"{name} missed the target in most runs"
        a = {"status": "N/A" if bs is None else "MISS", "value": ratio, "threshold": LIMIT_A, "text": why}
    else:
        acc_ok = (s["median_final_accuracy"] or 0.0) >= (bs["median_final_accuracy"] or 0.0) - ACCURACY_SLACK
        ok = ratio <= LIMIT_A and acc_ok
        by = ratio - LIMIT_A
        text = (f"{name} {ratio:.2f}x the best static ({best_static}) vs <= {LIMIT_A:.2f}x: "
                + ("within by" if by <= 0 else "over by") + f" {abs(by):.2f}x ({abs(by) / LIMIT_A:.0%})")
        if stretch:
            text += f"; stretch <= {STRETCH_A:.2f}x: {'met' if ratio <= STRETCH_A else 'not met'}"
        if not acc_ok:
            text += (f"; final accuracy {s['median_final_accuracy']:.4f} < best static's "
                     f"{bs['median_final_accuracy']:.4f} - {ACCURACY_SLACK}")
        cr = s.get("cost_ratio_vs_best_static")
        if cr is not None:
            text += f"; by the cost model {cr:.2f}x"
        a = {"status": _verdict(ok), "value": ratio, "threshold": LIMIT_A, "text": text}
    out["a"] = a

    # (b)
    u = summary.get(untuned) if untuned else None
    ut = None if u is None else u["median_time_to_target_s"]
    if u is None or not u.get("runs", 1):
        b = {"status": "N/A", "value": None, "threshold": SPEEDUP_B,
             "text": "static:32 (the untuned default) " + ("was not run" if u is None else "has no finished run yet")}
    elif t is None:
        b = {"status": "MISS", "value": None, "threshold": SPEEDUP_B, "text": f"{name} missed the target in most runs"}
    elif t == 0:
        b = {"status": "N/A", "value": None, "threshold": SPEEDUP_B,
             "text": f"{name} met the target before its first step: nothing to compare; raise --target-accuracy"}
    elif ut is None:
        b = {"status": "PASS", "value": math.inf, "threshold": SPEEDUP_B,
             "text": f"{untuned} missed the target in most runs; {name} reached it ({t:.2f} s)"}
    else:
        speed = ut / t
        b = {"status": _verdict(speed >= SPEEDUP_B), "value": speed, "threshold": SPEEDUP_B,
             "text": f"{name} is {speed:.2f}x faster than {untuned} ({t:.2f} s vs {ut:.2f} s) vs >= {SPEEDUP_B:g}x: "
             + ("met" if speed >= SPEEDUP_B else f"short by {SPEEDUP_B - speed:.2f}x")}
    out["b"] = b

    # (c)
    g = grid.get("median_s")
    run_s = s.get("median_wall_s")
    if not g or run_s is None:
        c = {"status": "N/A", "value": None, "threshold": SHARE_C, "text": "no LR grid (tuned-static) in this run"}
    else:
        share = g / run_s if run_s > 0 else math.inf
        c = {"status": _verdict(share >= SHARE_C and t is not None), "value": share, "threshold": SHARE_C,
             "text": f"one {name} run {run_s:.1f} s vs the grid search {g:.1f} s ({len(grid.get('cells', []))} "
             f"runs): 1/{share:.1f} of it vs <= 1/{SHARE_C:g}" + ("" if t is not None else "; but it missed the target")}
    out["c"] = c
    return out


def _static_epochs(summary: Mapping[str, Any]) -> dict[int, float]:
    """``{batch: median epochs to target}`` of the static policies, a tuned one preferred per size."""
    points: dict[int, tuple[bool, float]] = {}
    for name, s in summary.items():
        m = re.fullmatch(r"(tuned-)?static:(\d+)", name)
        epochs = s.get("median_epochs_to_target")
        if m is None or epochs is None:
            continue
        global_batch_size, tuned = int(m.group(2)), m.group(1) is not None
        if global_batch_size not in points or (tuned and not points[global_batch_size][0]):
            points[global_batch_size] = (tuned, float(epochs))
    return {b: e for b, (_, e) in sorted(points.items())}


def _noise_at_target(runs: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per run that measured it: the last B_simple recorded at or before the run reached the target."""
    values = []
    for r in runs:
        reached = r.get("epochs_to_target")
        if reached is None:
            continue
        seen = [p["noise_scale"] for p in r.get("curve", [])
                if p.get("noise_scale") is not None and p.get("epochs", math.inf) <= reached + 1e-9]
        if seen:
            values.append(float(seen[-1]))
    return values


def critical_batch(summary: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The critical batch the static grid implies, beside the noise scale the runs measured.

    McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training") model the samples
    needed to reach a target at batch B as ``E = E_min (1 + B / B_crit)``: linear in B, so a least-squares
    line ``E = a + b B`` through the static policies' (batch, median epochs to target) gives
    ``E_min = a`` and ``B_crit = a / b`` (at B_crit a run needs twice the minimum samples). Their
    prediction is ``B_crit ~ B_noise``, approximated by ``B_simple``; ``ratio`` compares the fitted
    B_crit with the median ``B_simple`` the runs had measured when they reached the target, so it says how
    far a ``NoiseScale`` or ``Goodput`` controller, which trust ``B_simple``, aim from the critical batch
    on this workload. ``b_crit`` is ``None`` (with ``note``) when fewer than three static sizes reached
    the target or the epochs do not rise with the batch within the grid.
    """
    points = _static_epochs(summary)
    noise = _noise_at_target(runs)
    out: dict[str, Any] = {"points": [[b, e] for b, e in points.items()], "epochs_min": None, "b_crit": None,
                           "b_simple_at_target": statistics.median(noise) if noise else None,
                           "runs_with_noise": len(noise), "ratio": None, "note": None}
    if len(points) < 3:
        out["note"] = f"{len(points)} static sizes reached the target; the fit needs 3"
        return out
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0:
        out["note"] = (f"epochs to target do not rise with the batch within the grid (fit {intercept:.2f} + "
                       f"{slope:.2g} B): the critical batch lies beyond {max(xs)}")
        return out
    if intercept <= 0:
        out["note"] = (f"epochs to target rise faster than the model allows (fit {intercept:.2f} + {slope:.2g} B, "
                       f"no positive E_min): every size in the grid is past the critical batch, which lies at or "
                       f"below {min(xs)}")
        return out
    out["epochs_min"], out["b_crit"] = intercept, intercept / slope
    if out["b_simple_at_target"]:
        out["ratio"] = out["b_crit"] / out["b_simple_at_target"]
    return out


def finish_results(results: dict[str, Any]) -> dict[str, Any]:
    """(Re)compute ``summary``, ``best_static``, ``grid_search_total_s``, ``untuned_default``, ``targets``
    and ``critical_batch`` from ``runs`` (in place; also returns ``results``)."""
    runs = results["runs"]
    policies = results.get("config", {}).get("policies") or list(dict.fromkeys(r["policy"] for r in runs))
    members = results.get("members")
    summary, best = summarize(runs, policies, members)
    results["summary"], results["best_static_policy"] = summary, best
    results["best_static"] = None if best is None else {"policy": best, **summary[best]}
    grid = grid_search_cost(runs)
    results["grid_search"] = grid
    results["grid_search_total_s"] = grid["median_s"]
    untuned = "static:32" if "static:32" in summary or any(r["policy"] == "static:32" for r in runs) else None
    judged = summary
    if untuned is not None and untuned not in summary:  # trained only as a cell of tuned-static:32's LR grid
        judged = {**summary, untuned: summarize(runs, [*summary, untuned], members)[0][untuned]}
    targets = evaluate_targets(judged, best, grid, untuned, results.get("workload") in STRETCH_WORKLOADS)
    results["targets"] = targets
    ut = judged[untuned]["median_time_to_target_s"] if untuned else None
    ba = targets.get("best_adaptive")
    bt = summary[ba]["median_time_to_target_s"] if ba else None
    results["untuned_default"] = None if untuned is None else {
        "policy": untuned, "median_time_to_target_s": ut,
        "best_adaptive": ba, "speedup_of_best_adaptive": None if not (ut and bt) else ut / bt,
        "ratio_vs_best_static": judged[untuned]["ratio_vs_best_static"],
    }
    results["critical_batch"] = critical_batch(summary, runs)
    return results
