"""How far the simulator's time to target is from the measured one (issue 22, item 7). A benchmark, not a test.

For each bench ``results.json`` given (one per workload, written by ``batchpilot bench``), and each policy in it
that the simulator can run (``static:N`` at the rule LR, ``goodput``, ``noise-scale``, ``ppo``, and ``auto`` as what
it is: Goodput from the knee its probes found, plus the probes' steps), this compares

- the **measured** median time to target over the bench's seeds: wall time and the cost model (calibrated step
  times, immune to the machine's load), with
- the **simulated** time of the same policy on one device, from the workload's trace (its noise scale and metric
  against progress) with the step times of *the bench's own calibration* (so the device is the one the runs used;
  the trace's own table was recorded with other settings). One simulated job per bench seed, the median reported.

Two efficiency models are validated side by side: ``pollux`` (the trace's measured noise scale, Pollux's model)
and ``fitted`` (the noise scale times the factor that makes the model match the trace's own static runs,
:meth:`Trace.fitted`; the policies still *observe* the measured noise scale). The simulator is trusted where the
error against the cost model is within 20%. Writes ``OUT/validation.json`` and ``OUT/validation.md``.

    python benchmarks/validate_simulator.py bench-out/digits/results.json bench-out/mnist1d/results.json --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchpilot import controllers as c
from batchpilot.bench.calibrate import Calibration
from batchpilot.bench.train import probe_steps
from batchpilot.sim.oracle import best_static, run_controller
from batchpilot.sim.trace import Trace, fit_compute, load_trace

TRUSTED = 0.20


def device_trace(trace: Trace, calibration: Calibration) -> Trace:
    """``trace`` with the bench's calibrated step times as its device."""
    sizes, seconds = tuple(calibration.sizes), tuple(calibration.step_s)
    return replace(trace, step_sizes=sizes, step_seconds=seconds, compute=fit_compute(sizes, seconds))


def simulated(policy: str, run: dict[str, Any], trace: Trace, lo: int, hi: int) -> float | None:
    """Simulated seconds to target of ``run``'s policy on one device (``None`` where the simulator has no model)."""
    seed = int(run["seed"])
    kind = policy.split(":")[0]
    if kind == "static" and "@" not in policy:
        _, result = best_static(trace, "cpu", [int(policy.split(":")[1])], min_size=lo, max_size=hi, seed=seed)
    elif policy in ("goodput", "noise-scale", "ppo"):
        make = {"goodput": c.Goodput, "noise-scale": c.NoiseScale, "ppo": _ppo}[policy]
        result = run_controller(make(lo, hi), trace, "cpu", start_size=lo, min_size=lo, max_size=hi, seed=seed)
    elif policy == "auto" and run.get("probe"):
        probe = run["probe"]
        knee = int(probe["start_size"])
        result = run_controller(c.Goodput(knee, hi), trace, "cpu", start_size=knee, min_size=knee, max_size=hi,
                                seed=seed)
        probes = sum(count * trace.compute_seconds(size) for size, count in probe_steps(probe))
        return result.time_to_target_s + probes if result.reached else None
    else:
        return None
    return result.time_to_target_s if result.reached else None


def _ppo(lo: int, hi: int) -> Any:
    from batchpilot.controllers.ppo import PPOController

    return PPOController(lo, hi)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def validate(results: dict[str, Any], trace: Trace, model: str = "pollux") -> list[dict[str, Any]]:
    """One row per simulable policy of ``results``: measured and simulated medians and the errors."""
    cal = Calibration.from_json(results["calibration"])
    dev = device_trace(trace.fitted() if model == "fitted" else trace, cal)
    lo, hi = int(results["config"]["min_batch_size"]), int(results["config"]["max_batch_size"])
    rows = []
    for policy in sorted({r["policy"] for r in results["runs"]}):
        runs = [r for r in results["runs"] if r["policy"] == policy]
        sims = [simulated(policy, r, dev, lo, hi) for r in runs]
        if all(s is None for s in sims) and not (policy.startswith("static:") and "@" not in policy) and \
                policy not in ("goodput", "noise-scale", "ppo", "auto"):
            continue
        wall = _median([r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None])
        cost = _median([r["cost_model_time_to_target_s"] for r in runs
                        if r.get("cost_model_time_to_target_s") is not None])
        sim = _median([s for s in sims if s is not None])
        rows.append({"workload": results["workload"], "model": model, "policy": policy, "seeds": len(runs),
                     "reached_measured": sum(r["time_to_target_s"] is not None for r in runs),
                     "reached_simulated": sum(s is not None for s in sims),
                     "measured_wall_s": wall, "measured_cost_model_s": cost, "simulated_s": sim,
                     "error_vs_cost_model": None if sim is None or not cost else sim / cost - 1,
                     "error_vs_wall": None if sim is None or not wall else sim / wall - 1})
    return rows


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | model | policy | reached (measured / simulated) | measured wall | measured cost model | simulated "
             "| error vs cost model | error vs wall | trusted (within 20%) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r["error_vs_cost_model"]
        trusted = "—" if err is None else ("yes" if abs(err) <= TRUSTED else "no")
        lines.append(f"| {r['workload']} | {r['model']} | {r['policy']} | {r['reached_measured']}/{r['seeds']} / "
                     f"{r['reached_simulated']}/{r['seeds']} | {_fmt(r['measured_wall_s'], '.2f')} s | "
                     f"{_fmt(r['measured_cost_model_s'], '.2f')} s | {_fmt(r['simulated_s'], '.2f')} s | "
                     f"{_fmt(err, '+.0%')} | {_fmt(r['error_vs_wall'], '+.0%')} | {trusted} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench results.json files (one per workload)")
    parser.add_argument("--trace", action="append", default=None,
                        help="trace per results file (default: the shipped trace named like the workload)")
    parser.add_argument("--model", choices=("pollux", "fitted", "both"), default="both",
                        help="efficiency model(s) to validate (default both)")
    parser.add_argument("--out", default="bench-out/validation")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for i, path in enumerate(args.results):
        results = json.loads(Path(path).read_text())
        trace = load_trace(args.trace[i] if args.trace else results["workload"])
        for model in ("pollux", "fitted") if args.model == "both" else (args.model,):
            rows += validate(results, trace, model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows)
    (out / "validation.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
