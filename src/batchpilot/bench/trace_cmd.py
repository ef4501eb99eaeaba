"""``batchpilot trace``: record simulator traces (:class:`batchpilot.sim.trace.Trace`) of the built-in workloads.

For each workload: one static run at its base batch through the bench's own training loop
(:mod:`batchpilot.bench.train`: the workload's model, optimizer, LR and target), with the gradient statistics
measured every ``noise_every`` steps, the metric evaluated every ``eval_every`` epochs, and the run stopped at the
target (or the budget); then the step-time calibration of :func:`batchpilot.bench.calibrate.calibrate` at doubling
batch sizes; :func:`batchpilot.sim.trace.record_trace` turns the log, the evaluations and the table into a trace,
written to ``OUT/<workload>.json``.

    batchpilot trace --workload mnist1d,digits,seqsum --seed 0 --out traces/
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..lr import lr_factor
from ..sim.trace import Trace, record_trace
from .calibrate import calibrate, size_grid
from .runner import on_device, resolve_device
from .specs import RunSpec
from .train import _train
from .workloads import Workload, get_workload

__all__ = ["add_trace_parser", "record_workload_trace"]


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def record_workload_trace(workload: str | Workload, seed: int = 0, *, batch_size: int | None = None,
                          budget_s: float = 300.0, eval_every: float = 0.02, noise_every: int = 2,
                          target: float | None = None, max_size: int | None = None, calibrate_steps: int = 4,
                          calibrate_rounds: int = 3, max_points: int = 200, device: str = "cpu",
                          progress: bool = True, command: str | None = None,
                          keep_log: str | os.PathLike | None = None) -> Trace:
    """Train ``workload`` statically at ``batch_size`` (default: its base batch) until its target (default: the
    workload's) or ``budget_s`` training seconds, calibrate the step time at doubling sizes up to ``max_size``
    (default: the workload's largest batch), and return the trace (see the module docstring). ``keep_log``: where
    to copy the run's JSONL log (default: it is deleted)."""
    w = get_workload(workload)
    size = batch_size or w.base_batch_size
    target = w.target_accuracy if target is None else target
    dev = resolve_device(device)
    t0 = time.perf_counter()
    _say(progress, f"{w.name}: building the data")
    train, test = (on_device(d, dev) for d in w.build_data(w.data_seed))
    lr = w.base_lr * lr_factor(w.lr_rule, size, w.base_batch_size)
    spec = RunSpec(f"static:{size}", size, w.base_lr, w.lr_rule, w.base_batch_size, lr, noise_every=noise_every)
    evaluations: list[tuple[float, float]] = []
    last_note = [time.perf_counter()]

    def on_eval(point: dict[str, Any], run: Any) -> None:
        evaluations.append((float(point["samples_seen"]), float(point["accuracy"])))
        if time.perf_counter() - last_note[0] >= 10 or point["accuracy"] >= target:
            last_note[0] = time.perf_counter()
            noise = point.get("noise_scale")
            _say(progress, f"  {w.name} static:{size}: t={point['time_s']:.1f}s epoch {point['epochs']:.2f} "
                 f"accuracy {point['accuracy']:.4f}" + ("" if noise is None else f" B_simple {noise:.0f}"))

    with tempfile.TemporaryDirectory(prefix="batchpilot-trace-") as tmp:
        log_path = Path(tmp) / "log.jsonl"
        _say(progress, f"{w.name}: static run at batch {size} (lr {lr:g}, gradient statistics every {noise_every} "
             f"steps) to accuracy {target:g}, at most {budget_s:g} s")
        run, _ = _train(w, spec, seed, train, test, target=target, budget_s=budget_s, eval_every=eval_every,
                        on_eval=on_eval, calibration=None, max_steps=None, target_window=1, log_path=log_path)
        train_s = run.train_time() if run.stopped_at is None else run.stopped_at
        reached = "reached" if run.reached is not None else f"did not reach ({run.stop_reason})"
        _say(progress, f"{w.name}: {reached} {target:g} after {run.last['step']} steps, {train_s:.1f} s")
        sizes = size_grid(w.min_batch_size, min(max_size or w.max_batch_size, len(train)), [size])
        _say(progress, f"{w.name}: timing steps at batch sizes {sizes}")
        calibration = calibrate(w, train, sizes, steps=calibrate_steps, rounds=calibrate_rounds)
        busy = f", 1-min load average {os.getloadavg()[0]:.1f} after it" if hasattr(os, "getloadavg") else ""
        grad_bytes = 4 * sum(p.numel() for p in w.build_model(seed).parameters() if p.requires_grad)
        machine = f"{os.cpu_count()}-core {platform.machine()} CPU" if dev.type == "cpu" else \
            torch.cuda.get_device_name(dev)
        how = command or f"batchpilot trace --workload {w.name} --seed {seed}"
        source = (f"{how}: static:{size} (lr {lr:g}), seed {seed}, data seed {w.data_seed}, gradient statistics every "
                  f"{noise_every} steps, accuracy every {eval_every:g} epochs, {reached} the target after "
                  f"{run.last['step']} steps ({train_s:.0f} s); step times: batchpilot.bench.calibrate "
                  f"({calibrate_steps} steps x {calibrate_rounds} rounds, {calibration.seconds:.0f} s{busy}); machine "
                  f"{machine}, torch threads {torch.get_num_threads()}, torch {torch.__version__}")
        trace = record_trace(log_path, evaluations, calibration.sizes, calibration.step_s, workload=w.name,
                             target=target, num_samples=len(train), grad_bytes=grad_bytes, base_batch_size=size,
                             max_points=max_points, source=source)
        if keep_log is not None:
            shutil.copyfile(log_path, keep_log)
    _say(progress, f"{w.name}: trace of {len(trace.progress)} points in {time.perf_counter() - t0:.0f} s")
    return trace


def add_trace_parser(sub: Any) -> None:
    """Register ``batchpilot trace`` on the subparsers ``sub`` of the main parser."""
    p = sub.add_parser("trace", help="record simulator traces of built-in workloads",
                       description="Train each workload statically at its base batch with the gradient statistics on, "
                       "evaluate it periodically until its target, time steps at doubling batch sizes, and write "
                       "OUT/<workload>.json (a batchpilot.sim.trace.Trace; see docs/simulator.md).")
    p.add_argument("--workload", default="mnist1d,digits,seqsum", help="comma-separated built-in workloads. "
                   "Default: mnist1d,digits,seqsum.")
    p.add_argument("--seed", type=int, default=0, help="run seed (model init and data order). Default: 0.")
    p.add_argument("--out", default="traces", help="output folder. Default: ./traces.")
    p.add_argument("--batch-size", type=int, default=None, help="the static batch (B0). Default: the workload's base.")
    p.add_argument("--target", type=float, default=None, help="accuracy target. Default: the workload's.")
    p.add_argument("--budget-s", type=float, default=300.0, help="most training seconds per run. Default: 300.")
    p.add_argument("--eval-every", type=float, default=0.02, help="epochs between evaluations. Default: 0.02.")
    p.add_argument("--noise-every", type=int, default=2, help="steps between gradient-statistics measurements. "
                   "Default: 2.")
    p.add_argument("--max-size", type=int, default=None, help="largest batch timed. Default: the workload's.")
    p.add_argument("--calibrate-steps", type=int, default=4, help="timed steps per size and round. Default: 4.")
    p.add_argument("--calibrate-rounds", type=int, default=3, help="calibration rounds. Default: 3.")
    p.add_argument("--max-points", type=int, default=200, help="most points kept per trace. Default: 200.")
    p.add_argument("--keep-log", action="store_true", help="also write each run's JSONL log to OUT/<workload>.jsonl.")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the runs.")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N.")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="print only the written files.")
    p.set_defaults(run=_run, subparser=p)


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Workload]:
    try:
        workloads = [get_workload(n.strip()) for n in args.workload.split(",") if n.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not workloads:
        parser.error("--workload is empty; pass e.g. --workload mnist1d.")
    for name, value, low in (("--batch-size", args.batch_size, 1), ("--noise-every", args.noise_every, 1),
                             ("--max-size", args.max_size, 1), ("--calibrate-steps", args.calibrate_steps, 1),
                             ("--calibrate-rounds", args.calibrate_rounds, 1), ("--max-points", args.max_points, 6),
                             ("--threads", args.threads, 1), ("--seed", args.seed, 0)):
        if value is not None and value < low:
            parser.error(f"{name} must be a whole number >= {low}, got {value}.")
    for name, value in (("--budget-s", args.budget_s), ("--eval-every", args.eval_every)):
        if not 0 < value < float("inf"):
            parser.error(f"{name} must be a positive number, got {value}.")
    if args.target is not None and not 0 < args.target <= 1:
        parser.error(f"--target must be an accuracy in (0, 1], got {args.target}.")
    return workloads


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    workloads = _check(args, parser)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {str(out)!r} cannot be used as the output folder ({exc.strerror}); pass another folder.")
    for w in workloads:
        command = (f"batchpilot trace --workload {w.name} --seed {args.seed}"
                   + (f" --batch-size {args.batch_size}" if args.batch_size else "")
                   + (f" --calibrate-rounds {args.calibrate_rounds}" if args.calibrate_rounds != 3 else "")
                   + (f" --threads {args.threads}" if args.threads else ""))
        try:
            trace = record_workload_trace(
                w, args.seed, batch_size=args.batch_size, budget_s=args.budget_s, eval_every=args.eval_every,
                noise_every=args.noise_every, target=args.target, max_size=args.max_size,
                calibrate_steps=args.calibrate_steps, calibrate_rounds=args.calibrate_rounds,
                max_points=args.max_points, device=args.device, progress=args.progress, command=command,
                keep_log=out / f"{w.name}.jsonl" if args.keep_log else None)
        except (ValueError, ImportError, FileNotFoundError) as exc:  # bad settings, a missing extra or data set
            parser.exit(2, f"batchpilot trace: error: {exc}\n")
        path = trace.save(out / f"{w.name}.json")
        try:
            reach = f"target progress {trace.target_progress():.0f} samples"
        except ValueError:
            reach = "target NOT reached: raise --budget-s or lower --target"
        print(f"{path}: {len(trace.progress)} points, noise scale {trace.noise_scale.min():.0f}.."
              f"{trace.noise_scale.max():.0f}, {reach}")
    return 0
