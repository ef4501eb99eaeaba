"""``batchpilot simulate``: policies on a workload trace and a simulated cluster, against the goodput oracle.

    batchpilot simulate --trace mnist1d --cluster gpus=16,speedup=20 --out sim-out/

For one trace (a shipped name or a trace file) and one cluster spec (docs/simulator.md), every policy runs one
simulated job to the trace's target (:mod:`batchpilot.sim.episode`); the table gives each one's simulated time to
target and its ratio to the goodput oracle's (:func:`batchpilot.sim.oracle.goodput_oracle`, the limit: no policy can
be faster in this model). ``OUT/simulate.json`` holds the numbers and each job's history; ``OUT/simulate.png`` plots
batch size and goodput over simulated time per policy (with matplotlib). Everything here is simulated.

Policies: ``oracle``, ``best-static`` (the fastest static size of a sqrt(2) grid, found by search in the
simulator), ``static:N``, ``goodput``, ``noise-scale`` (our controllers with their defaults, through their own
``decide()``), and ``ppo`` (the shipped PPO policy, :class:`~batchpilot.controllers.PPOController`). Adaptive
policies start at the trace's base batch, clamped to the bounds.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ..sim.cluster import ClusterSpec
from ..sim.episode import SimResult
from ..sim.oracle import best_static, goodput_oracle, run_controller
from ..sim.trace import Trace, load_trace

__all__ = ["POLICIES", "add_simulate_parser", "plot_simulation", "simulate"]

POLICIES = ("oracle", "best-static", "goodput", "noise-scale", "ppo")
"""The default policies (``static:N`` may be added)."""


def _controller(name: str, min_size: int, max_size: int, interval: int) -> Any:
    from .. import controllers as c

    if name == "goodput":
        return c.Goodput(min_size, max_size, interval=interval)
    if name == "noise-scale":
        return c.NoiseScale(min_size, max_size, interval=interval)
    if name == "ppo":
        from ..controllers.ppo import PPOController

        return PPOController(min_size, max_size, interval=interval)
    raise ValueError(f"unknown policy {name!r}; use {', '.join(POLICIES)} or static:N.")


def simulate(trace: Trace, spec: ClusterSpec, policies: list[str], *, min_size: int = 32, max_size: int = 4096,
             interval: int = 50, seed: int = 0) -> dict[str, SimResult]:
    """One simulated job per policy (see the module docstring); the oracle is always run (the table's reference)."""
    kw: dict[str, Any] = {"min_size": min_size, "max_size": max_size, "interval": interval, "seed": seed}
    results: dict[str, SimResult] = {"oracle": goodput_oracle(trace, spec, **kw)}
    start = min(max(trace.base_batch_size, min_size), max_size)
    for name in policies:
        if name in results:
            continue
        if name == "best-static":
            size, run = best_static(trace, spec, **kw)
            run.policy = f"best-static ({size})"
        elif name.startswith("static:"):
            text = name.partition(":")[2]
            if not text.isdigit() or not min_size <= int(text) <= max_size:
                raise ValueError(f"policy {name!r}: N must be a whole number in [{min_size}, {max_size}].")
            _, run = best_static(trace, spec, [int(text)], **kw)
        else:
            run = run_controller(_controller(name, min_size, max_size, interval), trace, spec, start_size=start, **kw)
            run.policy = name
        results[name] = run
    return results


def _table(results: dict[str, SimResult]) -> list[str]:
    oracle = results["oracle"].time_to_target_s
    lines = [f"{'policy':<22} {'simulated time to target':>26} {'ratio to oracle':>16} {'steps':>9} {'mean batch':>11}"]
    for run in results.values():
        mean = f"{run.series('batch_size').mean():.0f}" if run.history else "—"
        time = f"{run.time_to_target_s:.4g} s" if run.reached else "not reached"
        ratio = f"{run.time_to_target_s / oracle:.3f}x" if run.reached and math.isfinite(oracle) else "—"
        lines.append(f"{run.policy:<22} {time:>26} {ratio:>16} {run.steps:>9,} {mean:>11}")
    return lines


def plot_simulation(results: dict[str, SimResult], path: Path, title: str) -> Path:
    """Batch size (top) and goodput (bottom) against simulated time, one line per policy."""
    from .._plotting import figures, save

    plt = figures()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for run in results.values():
        if not run.history:
            continue
        t = run.series("time_s")
        top.step(t, run.series("batch_size"), where="post", label=run.policy)
        bottom.plot(t, run.series("goodput"), label=run.policy)
    top.set_yscale("log", base=2)
    top.set_ylabel("global batch size")
    top.set_title(f"{title} (simulated)")
    top.legend(fontsize=7)
    bottom.set_ylabel("goodput (efficiency-weighted samples/s)")
    bottom.set_xlabel("simulated time (s)")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    save(fig, path)
    return path


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        trace = load_trace(args.trace)
        spec = ClusterSpec.parse(args.cluster)
        policies = [p.strip().lower() for p in args.policies.split(",") if p.strip()]
        for p in policies:
            if p not in POLICIES and not p.startswith("static:"):
                raise ValueError(f"unknown policy {p!r}; use {', '.join(POLICIES)} or static:N.")
        results = simulate(trace, spec, policies, min_size=args.min_size, max_size=args.max_size,
                           interval=args.interval, seed=args.seed)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    print(f"{trace.workload} on cluster {args.cluster!r} ({spec.size} devices), seed {args.seed}: SIMULATED")
    for line in _table(results):
        print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"trace": trace.workload, "cluster": args.cluster, "devices": spec.size, "seed": args.seed,
            "simulated": True, "policies": {
                name: {"policy": r.policy, "time_to_target_s": r.time_to_target_s if r.reached else None,
                       "ratio_to_oracle": (r.time_to_target_s / results["oracle"].time_to_target_s) if r.reached
                       else None, "steps": r.steps, "samples": r.samples, "history": r.history}
                for name, r in results.items()}}
    (out / "simulate.json").write_text(json.dumps(data, indent=1, default=float))
    try:
        written = plot_simulation(results, out / "simulate.png", f"{trace.workload}, {args.cluster}")
        print(f"\nwritten: {out / 'simulate.json'}, {written}")
    except ImportError as exc:
        print(f"\nwritten: {out / 'simulate.json'} (no plot: {exc})")
    return 0


def add_simulate_parser(sub: Any) -> None:
    """Register ``batchpilot simulate`` on the subparsers ``sub`` of the main parser."""
    p = sub.add_parser("simulate", help="compare batch-size policies on a simulated cluster (vs the goodput oracle)",
                       description="Run policies on a workload trace and a simulated cluster to the trace's target; "
                       "print each one's simulated time to target and its ratio to the goodput oracle, and write "
                       "OUT/simulate.json and OUT/simulate.png. See docs/simulator.md.")
    p.add_argument("--trace", default="mnist1d", help="a shipped trace (mnist1d, digits, seqsum) or a trace .json "
                   "written by `batchpilot trace`. Default: mnist1d.")
    p.add_argument("--cluster", default="cpu", help="cluster spec, e.g. gpus=16,speedup=20 (docs/simulator.md). "
                   "Default: cpu (one device: the machine the trace was recorded on).")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated: {', '.join(POLICIES)}, static:N. Default: all of the first.")
    p.add_argument("--min-size", type=int, default=32, help="smallest batch. Default: 32.")
    p.add_argument("--max-size", type=int, default=4096, help="largest batch. Default: 4096.")
    p.add_argument("--interval", type=int, default=50, help="steps between decisions. Default: 50.")
    p.add_argument("--seed", type=int, default=0, help="cluster seed (load phase, failures). Default: 0.")
    p.add_argument("--out", default="sim-out", help="output folder. Default: ./sim-out.")
    p.set_defaults(run=_run, subparser=p)
