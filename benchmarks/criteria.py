"""How robust is a bench verdict to the way "time to target" is read? (a benchmark, not a test)

``batchpilot bench`` stops a run at the first evaluation (every ``--eval-every`` epochs) at or above the target.
At a constant LR the test accuracy of a small model fluctuates from one evaluation to the next (by 2-3 points on
``seqsum``, 1-3 on ``digits``); a target inside that band is then first "reached" by a lucky evaluation, and the
time to target depends on how often one looks. This benchmark trains the bench's own run specs (the same
policies, seeds, LR grid and cost model) *past* the target on a fine evaluation grid, and then reads every run
again under several criteria:

* the evaluation grid: every ``stride``-th point of the fine grid (``--strides 1,4`` with ``--eval-every
  0.0625``: every 1/16 and every 1/4 epoch, the bench's default);
* the window: the target counts at the first grid point where the mean accuracy of the last ``window`` points
  reaches it (``batchpilot bench --target-window``; 1 is the bench's default).

For each criterion it recomputes the bench's summary (``batchpilot.bench.summary.finish_results``: medians, the
LR-tuned best static, targets (a), (b), (c)) as if the bench had run with it, and reports how the ratios move.
A run counts as stopped where the criterion is met (its wall and cost-model time for target (c) end there).

Output: ``criteria.json`` (settings, every run with its full curve, one summary per criterion) and
``criteria.png`` (the accuracy curves of one seed around the target, and the (a)/(b) ratios per criterion;
needs matplotlib).

    PYTHONPATH=src python benchmarks/criteria.py --workload seqsum --policies default --epochs 3 \
        --calibration bench-out/seqsum/results.json --out bench-out/criteria-seqsum
    PYTHONPATH=src python benchmarks/criteria.py --reread bench-out/criteria-seqsum/criteria.json --windows 1,3,6

``--reread`` reads the runs of an earlier ``criteria.json`` again under other ``--strides``/``--windows``
(multiples of its grid) without training.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

from batchpilot.bench.calibrate import Calibration, calibrate, size_grid
from batchpilot.bench.policies import parse_policies, workload_grid
from batchpilot.bench.runner import write_json
from batchpilot.bench.specs import Plan, expand
from batchpilot.bench.summary import finish_results
from batchpilot.bench.train import reaches_target, train_one
from batchpilot.bench.workloads import get_workload

NEVER = 2.0  # a target accuracy no run reaches: runs stop at --epochs or at the budget
UNTUNED = "static:32"  # target (b)'s untuned default


def on_grid(curve: list[dict[str, Any]], grid_samples: float) -> list[dict[str, Any]]:
    """The curve's points that lie on a grid of ``grid_samples`` samples: the step-0 point, then the first
    point at or past each further multiple (a step that crosses several multiples gives one point; an
    evaluation made only because a run stopped between grid points is not on it)."""
    points, last = [], -1
    for p in curve:
        slot = math.floor(p["samples_seen"] / grid_samples + 1e-9)
        if slot > last:
            points.append(p)
            last = slot
    return points


def reach(curve: list[dict[str, Any]], target: float, grid_samples: float, window: int) -> dict[str, Any] | None:
    """The first grid point where the mean accuracy of the last ``window`` grid points is >= ``target``."""
    last: list[float] = []
    for point in on_grid(curve, grid_samples):
        last = (last + [point["accuracy"]])[-window:]
        if reaches_target(last, window, target):
            return point
    return None


def read_run(run: dict[str, Any], target: float, grid_samples: float, window: int) -> dict[str, Any]:
    """``run`` as the bench would have recorded it under this criterion (stopped at the target if reached)."""
    point = reach(run["curve"], target, grid_samples, window)
    out = {**run, "curve": []}  # the full curve stays in the run list once, not in every criterion
    if point is None:
        return {**out, **{k: None for k in ("time_to_target_s", "cost_model_time_to_target_s", "steps_to_target",
                                            "samples_to_target", "epochs_to_target")}}
    return {**out, "time_to_target_s": point["time_s"], "cost_model_time_to_target_s": point["cost_s"],
            "steps_to_target": point["step"], "samples_to_target": point["samples_seen"],
            "epochs_to_target": point["epochs"], "final_accuracy": point["accuracy"], "wall_s": point["time_s"],
            "cost_model_s": point["cost_s"], "stop_reason": "target"}


def criterion_summary(base: dict[str, Any], runs: list[dict[str, Any]], num_samples: int, eval_every: float,
                      stride: int, window: int) -> dict[str, Any]:
    """The bench's summary and targets had it read time to target this way."""
    grid_samples = stride * max(1, round(eval_every * num_samples))  # the bench's grid, in samples
    results = {**base, "runs": [read_run(r, base["target_accuracy"], grid_samples, window) for r in runs]}
    finish_results(results)
    summary, best, targets = results["summary"], results["best_static_policy"], results["targets"]
    best_adaptive = targets.get("best_adaptive")

    def cost(name: str | None) -> float | None:
        return None if name is None else summary.get(name, {}).get("median_cost_model_time_to_target_s")

    untuned, ours = cost(UNTUNED), cost(best_adaptive)
    return {
        "eval_every_epochs": stride * eval_every, "window": window, "best_static": best,
        "best_adaptive": best_adaptive,
        "targets": {k: {key: targets[k][key] for key in ("status", "value", "threshold", "text")} for k in ("a", "b", "c", "d")},
        "a_cost_ratio": None if best_adaptive is None else summary[best_adaptive]["cost_ratio_vs_best_static"],
        "b_cost_speedup": untuned / ours if untuned is not None and ours else None,
        "summary": summary,
    }


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _row(c: dict[str, Any]) -> str:
    a, b = c["targets"]["a"], c["targets"]["b"]
    return (f"{c['eval_every_epochs']:>8.4g} {c['window']:>6d}  {str(c['best_static']):34s} {str(c['best_adaptive']):30s} "
            f"(a) {_x(a.get('value')):>6s} cost {_x(c['a_cost_ratio']):>6s} {a['status']:5s} "
            f"(b) {_x(b.get('value')):>6s} cost {_x(c['b_cost_speedup']):>6s} {b['status']}")


def plot(out: Path, runs: list[dict[str, Any]], criteria: list[dict[str, Any]], target: float) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'batchpilot[plot]')")
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    fine = min(criteria, key=lambda c: (c["eval_every_epochs"], c["window"]))
    seed = runs[0]["seed"]
    shown = [fine["summary"].get(fine["best_static"] or "", {}).get("chosen", fine["best_static"]), UNTUNED,
             fine["best_adaptive"]]
    for name in dict.fromkeys(s for s in shown if s):
        run = next((r for r in runs if r["seed"] == seed and name in (r["policy"], *r["serves"])), None)
        if run is not None:
            left.plot([p["epochs"] for p in run["curve"]], [p["accuracy"] for p in run["curve"]], lw=1, label=name)
    left.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:g}")
    left.set_ylim(max(0.0, target - 0.08), min(1.0, target + 0.03))
    left.set(xlabel="epochs", ylabel="test accuracy", title=f"seed {seed}: every evaluation")
    left.legend(fontsize=7)
    for key, marker in (("a", "o"), ("b", "s")):
        for every in sorted({c["eval_every_epochs"] for c in criteria}):
            cs = [c for c in criteria if c["eval_every_epochs"] == every]
            right.plot([c["window"] for c in cs], [c["targets"][key].get("value") or float("nan") for c in cs],
                       marker=marker, label=f"({key}), every {every:g} epochs")
        threshold = criteria[0]["targets"][key]["threshold"]
        if threshold is not None:
            right.axhline(threshold, color="grey", ls=":", lw=0.8)
    right.set(xlabel="window (evaluations averaged)", ylabel="(a): x best static, (b): speed-up over static:32",
              title="targets (a) and (b) by wall time (dotted: the targets)")
    right.set_xscale("log", base=2)
    right.minorticks_off()
    windows = sorted({c["window"] for c in criteria})
    right.set_xticks(windows, labels=[str(w) for w in windows])
    right.legend(fontsize=7)
    fig.tight_layout()
    path = out / "criteria.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="seqsum")
    ap.add_argument("--policies", default="default", help="bench policies (batchpilot bench --policies)")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--epochs", type=float, default=None,
                    help="train every run this many epochs, past the target (required unless --reread)")
    ap.add_argument("--eval-every", type=float, default=0.0625, help="the fine evaluation grid, in epochs")
    ap.add_argument("--strides", default="1,4", help="coarser grids read from it: every k-th point")
    ap.add_argument("--windows", default="1,2,4,8", help="evaluations averaged (bench --target-window)")
    ap.add_argument("--target-accuracy", type=float, default=None, help="default: the workload's")
    ap.add_argument("--budget", type=float, default=120.0, help="most training seconds per run")
    ap.add_argument("--calibration", default=None,
                    help="a bench results.json whose step-time calibration to use (default: calibrate now)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench-out/criteria")
    ap.add_argument("--reread", default=None, help="a criteria.json whose runs to read again (no training)")
    args = ap.parse_args()
    try:
        strides = [int(s) for s in args.strides.split(",")]
        windows = [int(w) for w in args.windows.split(",")]
    except ValueError:
        strides = windows = [0]
    if min(strides) < 1 or min(windows) < 1:
        raise SystemExit(f"--strides {args.strides!r} and --windows {args.windows!r}: both list ints >= 1.")
    if args.reread:
        reread(Path(args.reread), strides, windows, Path(args.out))
        return
    if args.epochs is None:
        raise SystemExit("--epochs is required: how far past the target to train every run (about twice the "
                         "epochs the best static needs).")
    if not (args.epochs > 0 and args.eval_every > 0):
        raise SystemExit(f"--epochs and --eval-every must be positive, got {args.epochs} and {args.eval_every}.")
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = get_workload(args.workload)
    target = wl.target_accuracy if args.target_accuracy is None else args.target_accuracy
    seeds = [int(s) for s in args.seeds.split(",")]
    pols = workload_grid(parse_policies(args.policies), wl.grid)
    train, test = wl.build_data(wl.data_seed)
    n = len(train)
    lo, hi = min(wl.min_batch_size, n), min(wl.max_batch_size, n)
    extra = [s for p in pols if p.batch_size for s in (p.batch_size, p.end)]
    if args.calibration:
        cal = Calibration.from_json(json.loads(Path(args.calibration).read_text())["calibration"])
    else:
        print(f"calibrating step times for the cost model ({wl.name}) ...", flush=True)
        cal = calibrate(wl, train, size_grid(lo, hi, extra))
    plan = Plan(wl.base_lr, wl.base_batch_size, wl.lr_rule, n, lo, hi, cal.finder_size(hi, among=size_grid(lo, hi)),
                smith_every_epochs=wl.smith_every_epochs)
    specs, members = expand(pols, plan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def stop_at_epochs(point: dict[str, Any], run: Any) -> None:
        if point["epochs"] >= args.epochs:
            run.done = True

    runs: list[dict[str, Any]] = []
    total, start = len(seeds) * len(specs), time.perf_counter()
    for i, seed in enumerate(seeds):
        k = i % len(specs)
        for spec in specs[k:] + specs[:k]:  # seed-major, rotated, as the bench
            run = train_one(wl, spec, seed, train, test, target=NEVER, budget_s=args.budget,
                            eval_every=args.eval_every, on_eval=stop_at_epochs, calibration=cal)
            runs.append(run)
            print(f"[{len(runs)}/{total}] {spec.name} seed {seed}: {run['curve'][-1]['epochs']:.2f} epochs in "
                  f"{run['wall_s']:.1f} s ({time.perf_counter() - start:.0f} s so far)", flush=True)
    result = {"workload": wl.name, "target_accuracy": target, "settings": vars(args), "members": members,
              "policies": [p.name for p in pols], "seeds": seeds, "train_samples": n, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "platform": platform.platform(), "calibration": cal.to_json(),
              "runs": runs}
    write(out, result, strides, windows, args.eval_every)


def write(out: Path, result: dict[str, Any], strides: list[int], windows: list[int], eval_every: float) -> None:
    """Read every run under each criterion, print the table, write criteria.json and the plot."""
    base = {"workload": result["workload"], "target_accuracy": result["target_accuracy"],
            "members": result["members"], "config": {"policies": result["policies"], "seeds": result["seeds"]}}
    runs, target = result["runs"], result["target_accuracy"]
    criteria = [criterion_summary(base, runs, result["train_samples"], eval_every, s, w) for s in strides for w in windows]
    print(f"\n{result['workload']}, target {target:g}: how the verdict moves with the reading of time to target")
    print(f"{'grid':>8s} {'window':>6s}  {'best static':34s} {'best adaptive':30s} targets (wall, cost model)")
    for c in criteria:
        print(_row(c))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "criteria.json", {**result, "criteria": criteria})
    path = plot(out, runs, criteria, target)
    print(f"\nwrote {out / 'criteria.json'}" + (f" and {path}" if path else ""))


def reread(path: Path, strides: list[int], windows: list[int], out: Path) -> None:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
        eval_every = float(result["settings"]["eval_every"])
        point = next(p for p in result["runs"][0]["curve"] if p["epochs"] > 0)
        # Derivable from the runs where an earlier version of this file did not store them.
        result.setdefault("policies", list(result["members"]))
        result.setdefault("seeds", sorted({r["seed"] for r in result["runs"]}))
        result.setdefault("train_samples", round(point["samples_seen"] / point["epochs"]))
    except (OSError, ValueError, KeyError, IndexError, StopIteration, TypeError) as exc:
        raise SystemExit(f"--reread {str(path)!r} is not a criteria.json written by this benchmark ({exc}).") from None
    write(out, result, strides, windows, eval_every)


if __name__ == "__main__":
    main()
