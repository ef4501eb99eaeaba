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
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..lr import lr_factor
from ..sim.trace import Trace, crossing, record_trace, smoothed
from .calibrate import calibrate, size_grid
from .runner import on_device, resolve_device
from .specs import RunSpec
from .train import _train
from .workloads import Workload, get_workload

__all__ = ["add_trace_parser", "record_workload_trace"]


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def _static_run(w: Workload, size: int, seed: int, train: Any, test: Any, *, target: float, budget_s: float,
                eval_every: float, window: int, noise_every: int | None, log_path: Path, progress: bool
                ) -> tuple[Any, list[tuple[float, float]], float]:
    """One static run of ``w`` at ``size`` (the workload's LR rule) through the bench's loop, until the mean of the
    last ``window`` evaluations reaches ``target`` or ``budget_s``: ``(run, evaluations, lr)``."""
    lr = w.base_lr * lr_factor(w.lr_rule, size, w.base_batch_size)
    spec = RunSpec(f"static:{size}", size, w.base_lr, w.lr_rule, w.base_batch_size, lr, noise_every=noise_every)
    evaluations: list[tuple[float, float]] = []
    last_note = [time.perf_counter()]

    def on_eval(point: dict[str, Any], run: Any) -> None:
        evaluations.append((float(point["samples_seen"]), float(point["accuracy"])))
        if time.perf_counter() - last_note[0] >= 10:
            last_note[0] = time.perf_counter()
            noise = point.get("noise_scale")
            _say(progress, f"  {w.name} static:{size}: t={point['time_s']:.1f}s epoch {point['epochs']:.2f} "
                 f"accuracy {point['accuracy']:.4f}" + ("" if noise is None else f" B_simple {noise:.0f}"))

    what = "" if noise_every is None else f", gradient statistics every {noise_every} steps"
    _say(progress, f"{w.name}: static run at batch {size} (lr {lr:g}{what}) until the mean of {window} evaluations "
         f"reaches {target:g}, at most {budget_s:g} s")
    run, _ = _train(w, spec, seed, train, test, target=target, budget_s=budget_s, eval_every=eval_every,
                    on_eval=on_eval, calibration=None, max_steps=None, target_window=window, log_path=log_path)
    train_s = run.train_time() if run.stopped_at is None else run.stopped_at
    _say(progress, f"{w.name}: static:{size} {'reached' if run.reached else 'missed'} {target:g} after "
         f"{run.last['step']} steps, {train_s:.1f} s")
    return run, evaluations, lr


def record_workload_trace(workload: str | Workload, seed: int = 0, *, batch_size: int | None = None,
                          budget_s: float = 300.0, eval_every: float = 0.02, noise_every: int = 2,
                          target: float | None = None, max_size: int | None = None, calibrate_steps: int = 4,
                          calibrate_rounds: int = 3, max_points: int = 200, device: str = "cpu",
                          progress: bool = True, command: str | None = None, window: int = 9,
                          fit_sizes: Sequence[int] = (512,), keep_log: str | os.PathLike | None = None) -> Trace:
    """Train ``workload`` statically at ``batch_size`` (default: its base batch) until the mean of ``window``
    evaluations reaches its target (default: the workload's) or ``budget_s`` training seconds; train a static run at
    each of ``fit_sizes`` the same way and keep their samples to target (:attr:`Trace.static_samples_to_target`, what
    :meth:`Trace.fitted` fits the efficiency's noise-scale factor to; the trace itself keeps the factor 1); calibrate
    the step time at doubling sizes up to ``max_size`` (default: the workload's largest batch), and return the
    trace (see the module docstring). ``keep_log``: where to copy the main run's JSONL log."""
    w = get_workload(workload)
    size = batch_size or w.base_batch_size
    target = w.target_accuracy if target is None else target
    dev = resolve_device(device)
    t0 = time.perf_counter()
    _say(progress, f"{w.name}: building the data")
    train, test = (on_device(d, dev) for d in w.build_data(w.data_seed))

    def static(n: int, noise: int | None, path: Path) -> tuple[Any, list[tuple[float, float]], float]:
        return _static_run(w, n, seed, train, test, target=target, budget_s=budget_s, eval_every=eval_every,
                           window=window, noise_every=noise, log_path=path, progress=progress)

    with tempfile.TemporaryDirectory(prefix="batchpilot-trace-") as tmp:
        log_path = Path(tmp) / "log.jsonl"
        run, evaluations, lr = static(size, noise_every, log_path)
        train_s = run.train_time() if run.stopped_at is None else run.stopped_at
        measured: dict[int, float] = {}
        fits = []
        for n in sorted({int(b) for b in fit_sizes if int(b) != size and int(b) <= len(train)}):
            _, evals, _ = static(n, None, Path(tmp) / f"{n}.jsonl")
            reach = crossing([e[0] for e in evals], smoothed([e[1] for e in evals], window), target)
            fits.append(f"static:{n} " + ("missed it" if reach is None else f"{reach / len(train):.2f} epochs"))
            if reach is not None:
                measured[n] = reach
        sizes = size_grid(w.min_batch_size, min(max_size or w.max_batch_size, len(train)), [size])
        _say(progress, f"{w.name}: timing steps at batch sizes {sizes}")
        calibration = calibrate(w, train, sizes, steps=calibrate_steps, rounds=calibrate_rounds)
        busy = f", 1-min load average {os.getloadavg()[0]:.1f} after it" if hasattr(os, "getloadavg") else ""
        grad_bytes = 4 * sum(p.numel() for p in w.build_model(seed).parameters() if p.requires_grad)
        machine = f"{os.cpu_count()}-core {platform.machine()} CPU" if dev.type == "cpu" else \
            torch.cuda.get_device_name(dev)
        how = command or f"batchpilot trace --workload {w.name} --seed {seed}"
        reached = "reached" if run.reached is not None else f"did not reach ({run.stop_reason})"
        source = (f"{how}: static:{size} (lr {lr:g}), seed {seed}, data seed {w.data_seed}, gradient statistics every "
                  f"{noise_every} steps, accuracy every {eval_every:g} epochs (metric: centred mean of {window}), "
                  f"{reached} the target after {run.last['step']} steps ({train_s:.0f} s); step times: "
                  f"batchpilot.bench.calibrate ({calibrate_steps} steps x {calibrate_rounds} rounds, "
                  f"{calibration.seconds:.0f} s{busy}); machine {machine}, torch threads {torch.get_num_threads()}, "
                  f"torch {torch.__version__}")
        trace = record_trace(log_path, evaluations, calibration.sizes, calibration.step_s, workload=w.name,
                             target=target, num_samples=len(train), grad_bytes=grad_bytes, base_batch_size=size,
                             max_points=max_points, source=source, smooth=window)
        first = crossing([e[0] for e in evaluations], [e[1] for e in evaluations], target)
        source += ("" if first is None else f"; a single evaluation first reached it at {first / len(train):.2f} "
                   "epochs")
        if measured and run.reached is not None:  # the run at B0 has progress == samples whatever the factor
            trace = replace(trace, static_samples_to_target=measured)
            k = trace.fitted().noise_scale_factor
            source += (f"; static_samples_to_target from {', '.join(fits)}: Pollux's model with the measured noise "
                       f"scale gives " + ", ".join(f"{trace.samples_to_target(n) / len(train):.2f}" for n in measured)
                       + f" epochs, trace.fitted() (noise_scale_factor {k:.3g}) gives "
                       + ", ".join(f"{trace.fitted().samples_to_target(n) / len(train):.2f}" for n in measured))
        elif fits:
            source += f"; static runs at other sizes: {', '.join(fits)}"
        trace = replace(trace, source=source)
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
    p.add_argument("--target-window", type=int, default=9, help="the run stops when the mean of the last W evaluations "
                   "reaches the target, and the trace's metric is the centred mean of W evaluations. Default: 9.")
    p.add_argument("--fit-sizes", default="512", help="comma-separated batch sizes of extra static runs (no gradient "
                   "statistics) whose samples to target the trace keeps (static_samples_to_target, for "
                   "Trace.fitted()); 'none' skips them. Default: 512.")
    p.add_argument("--keep-log", action="store_true", help="also write each run's JSONL log to OUT/<workload>.jsonl.")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the runs.")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N.")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="print only the written files.")
    p.set_defaults(run=_run, subparser=p)


def _fit_sizes(text: str) -> list[int]:
    if text.strip().lower() == "none":
        return []
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isascii() and t.isdigit() and int(t) >= 1 for t in items):
        raise ValueError(f"--fit-sizes {text!r} must list whole batch sizes >= 1 (e.g. 512 or 256,1024) or be none.")
    return [int(t) for t in items]


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Workload]:
    try:
        workloads = [get_workload(n.strip()) for n in args.workload.split(",") if n.strip()]
        args.fit_sizes = _fit_sizes(args.fit_sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if not workloads:
        parser.error("--workload is empty; pass e.g. --workload mnist1d.")
    for name, value, low in (("--batch-size", args.batch_size, 1), ("--noise-every", args.noise_every, 1),
                             ("--max-size", args.max_size, 1), ("--calibrate-steps", args.calibrate_steps, 1),
                             ("--calibrate-rounds", args.calibrate_rounds, 1), ("--max-points", args.max_points, 6),
                             ("--threads", args.threads, 1), ("--seed", args.seed, 0),
                             ("--target-window", args.target_window, 1)):
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
    # The options that differ from their defaults, for the traces' source (--out is where, not how).
    options = ""
    for dest in ("batch_size", "target", "budget_s", "eval_every", "noise_every", "max_size", "calibrate_steps",
                 "calibrate_rounds", "max_points", "target_window", "fit_sizes", "threads", "device"):
        value, default = getattr(args, dest), parser.get_default(dest)
        if dest == "fit_sizes":
            value, default = ",".join(map(str, value)) or "none", default
        if value != default:
            options += f" --{dest.replace('_', '-')} {value}"
    for w in workloads:
        command = f"batchpilot trace --workload {w.name} --seed {args.seed}{options}"
        try:
            trace = record_workload_trace(
                w, args.seed, batch_size=args.batch_size, budget_s=args.budget_s, eval_every=args.eval_every,
                noise_every=args.noise_every, target=args.target, max_size=args.max_size,
                calibrate_steps=args.calibrate_steps, calibrate_rounds=args.calibrate_rounds,
                max_points=args.max_points, device=args.device, progress=args.progress, command=command,
                window=args.target_window, fit_sizes=args.fit_sizes,
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
