"""The ``batchpilot`` command.

    batchpilot bench [--workload mnist1d|digits|seqsum|markov|synthetic|cifar10|cifar100|all] [--policies default] [--seeds 0,1,2,3,4]
                     [--target-accuracy A] [--budget-s S] [--eval-every E] [--target-window W] [--out DIR] [--resume] [--quick]
                     [--cache-dir DIR] [--no-cache] [--list]
    batchpilot report LOG.jsonl|results.json --out DIR [--x samples|time]
    batchpilot trace [--workload mnist1d,digits,seqsum] [--seed 0] [--out DIR] (see batchpilot.bench.trace_cmd)
    batchpilot rl train [--timesteps N] [--seed S] [--out DIR] (see batchpilot.bench.rl_cmd, docs/ppo.md)

Bad input (an unknown policy or workload, a malformed number, a missing log) ends with a one-line message
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

# Settings of a full run (issue 21's comparison, 5 seeds) and of --quick (one seed: auto against statics).
FULL = {"seeds": "0,1,2,3,4", "policies": "default"}
QUICK = {"seeds": "0", "policies": "quick"}


def _parser() -> argparse.ArgumentParser:
    from . import __version__
    from .bench.cluster_clock import CLOCK_HELP
    from .bench.policies import NAMED_SETS, POLICY_HELP
    from .bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(
        prog="batchpilot", description="Train PyTorch models with a batch size that changes while they train."
    )
    parser.add_argument("--version", action="version", version=f"batchpilot {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    bench = sub.add_parser(
        "bench",
        help="time to a target accuracy under several batch-size policies",
        description="Train a built-in workload under several batch-size policies, side by side, and report "
        "the training time, steps and samples to a target test accuracy. Writes DIR/results.json, "
        "DIR/report.md and PNG plots.",
    )
    names = ", ".join(WORKLOADS)
    bench.add_argument("--workload", default="mnist1d",
                       help=f"one of: {names}, or all (every workload but synthetic, cifar10 and cifar100). Default: mnist1d. "
                       "See --list.")
    bench.add_argument("--policies", default=None,
                       help=f"comma-separated policies: {POLICY_HELP}. Default: {FULL['policies']} "
                       f"(= {NAMED_SETS['default']}); {QUICK['policies']} with --quick.")
    bench.add_argument("--seeds", default=None,
                       help=f"comma-separated run seeds. Default: {FULL['seeds']} ({QUICK['seeds']} with --quick).")
    bench.add_argument("--target-accuracy", type=float, default=None,
                       help="test accuracy to reach. Default: the workload's (its quick target with --quick).")
    bench.add_argument("--budget-s", type=float, default=None,
                       help="most training seconds per run. Default: the workload's (see --list; its quick "
                       "budget with --quick).")
    bench.add_argument("--eval-every", type=float, default=0.25, help="epochs between evaluations. Default: 0.25.")
    bench.add_argument("--target-window", type=int, default=1,
                       help="the target is reached when the mean accuracy of the last W evaluations reaches it "
                       "(1: the first evaluation that does). Use 4-8 with a smaller --eval-every when the accuracy "
                       "fluctuates around the target. Default: 1.")
    bench.add_argument("--tune-factors", default="0.5,1,2",
                       help="LR grid of tuned-static:N, as multiples of the rule LR. Default: 0.5,1,2.")
    bench.add_argument("--calibrate-steps", type=int, default=4,
                       help="timed steps per batch size and round (3 rounds) in the step-time calibration. Default: 4.")
    bench.add_argument("--out", default="bench-out", help="output folder (with --workload all: one subfolder "
                       "per workload). Default: ./bench-out.")
    bench.add_argument("--quick", action="store_true",
                       help="a short run: one seed, the quick policy set, a lower target, a short budget.")
    bench.add_argument("--resume", action="store_true",
                       help="continue an interrupted bench in --out: keep its finished runs and its calibration, "
                       "train only the missing ones (the settings must be the same).")
    bench.add_argument("--list", action="store_true", help="list the workloads and policies, and exit.")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch.set_num_threads for the run (default: leave torch's setting). On a busy "
                       "machine, 1 thread is far less sensitive to other processes.")
    bench.add_argument("--device", default="cpu",
                       help="where to train: cpu (default), cuda or cuda:N. The data sets are moved there once.")
    bench.add_argument("--data-dir", default=None,
                       help="folder of real data sets (cifar10: cifar-10-batches-py/, cifar100: cifar-100-python/). "
                       "Default: $BATCHPILOT_DATA, else ~/.cache/batchpilot/data.")
    bench.add_argument("--cache-dir", default=None,
                       help="folder of the cache of static runs and calibrations, reused by a later bench with the "
                       "same settings (docs/benchmark.md#the-cache). Default: $BATCHPILOT_CACHE/bench, else "
                       "~/.cache/batchpilot/bench.")
    bench.add_argument("--no-cache", dest="cache", action="store_false",
                       help="train every run and calibrate afresh; read and write no cache.")
    bench.add_argument("--no-progress", dest="progress", action="store_false", help="print only the results.")
    bench.add_argument("--clock", default=None, help=f"{CLOCK_HELP}. Default: none.")
    bench.set_defaults(run=_bench, subparser=bench)

    report = sub.add_parser(
        "report",
        help="plot an adjustment log (batch size, loss, LR) or re-render a bench report",
        description="Plot a JSONL adjustment log written by Pilot(log_path=...) into batch_size.png, "
        "loss.png and lr.png; or, given a bench results.json, rewrite its report.md and plots.",
    )
    report.add_argument("log", help="an adjustment log (.jsonl) or a bench results.json")
    report.add_argument("--out", default=None, help="output folder. Default: the log's folder.")
    report.add_argument("--x", choices=("samples", "time"), default="samples",
                        help="x axis of log plots: samples seen or wall time. Default: samples.")
    report.set_defaults(run=_report, subparser=report)
    from .bench.trace_cmd import add_trace_parser

    add_trace_parser(sub)
    from .bench.rl_cmd import add_rl_parser

    add_rl_parser(sub)
    from .bench.simulate_cmd import add_simulate_parser

    add_simulate_parser(sub)
    return parser


def _seeds(text: str) -> list[int]:
    seeds = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if not (item.isascii() and item.isdigit()) or int(item) >= 2**63:  # "²" is a digit; torch seeds are int64
            raise ValueError(f"--seeds: {item!r} is not a whole number in [0, 2**63); pass e.g. --seeds 0,1,2.")
        seeds.append(int(item))
    if not seeds:
        raise ValueError("--seeds is empty; pass at least one seed, e.g. --seeds 0.")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r} lists a seed twice; list each seed once.")
    return seeds


def _factors(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--tune-factors {text!r} is not a comma-separated list of numbers, e.g. 0.5,1,2.") from None
    if not values or any(not (0 < v < float("inf")) for v in values):
        raise ValueError(f"--tune-factors {text!r} must list positive numbers, e.g. 0.5,1,2.")
    shown = [f"{v:g}" for v in values]  # the grid's cells are named by their LR to 6 significant digits
    twice = sorted({s for s in shown if shown.count(s) > 1})
    if twice:
        raise ValueError(f"--tune-factors {text!r} lists {', '.join(twice)} twice (to 6 significant digits); "
                         "list each factor once.")
    return values


def _data_dir(option: str | None) -> Path | None:
    """The folder of real data sets: ``--data-dir``, else ``$BATCHPILOT_DATA`` (read here only), else ``None``
    (the loader's default)."""
    if option is not None:
        return Path(option).expanduser()
    env = os.environ.get("BATCHPILOT_DATA")
    return Path(env).expanduser() if env else None


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench.cluster_clock import cluster_clock_lines
    from .bench.policies import parse_policies
    from .bench.report import format_table, write_index, write_report
    from .bench.runner import run_benchmark
    from .bench.workloads import all_workloads, get_workload

    if args.list:
        print(list_text())
        return 0
    mode = QUICK if args.quick else FULL
    data_dir = _data_dir(args.data_dir)
    try:
        if args.workload == "all":
            workloads = [get_workload(n, data_dir=data_dir) for n in all_workloads()]
        else:
            try:
                workloads = [get_workload(args.workload, data_dir=data_dir)]
            except ValueError as exc:
                raise ValueError(f"{str(exc)[:-1]}, or all.") from None
        policies = parse_policies(args.policies if args.policies is not None else mode["policies"])
        seeds = _seeds(args.seeds if args.seeds is not None else mode["seeds"])
        factors = _factors(args.tune_factors)
    except ValueError as exc:
        parser.error(str(exc))
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        parser.error(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}.")
    if args.budget_s is not None and not 0 < args.budget_s < float("inf"):
        parser.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}.")
    if not 0 < args.eval_every < float("inf"):
        parser.error(f"--eval-every must be a positive number of epochs, got {args.eval_every}.")
    if args.target_window < 1:
        parser.error(f"--target-window must be >= 1 evaluations, got {args.target_window}.")
    if args.calibrate_steps < 1:
        parser.error(f"--calibrate-steps must be >= 1, got {args.calibrate_steps}.")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}.")
        import torch

        torch.set_num_threads(args.threads)

    if args.data_dir is not None and not Path(args.data_dir).expanduser().is_dir():
        parser.error(f"--data-dir {args.data_dir!r} is not a folder.")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {str(out)!r} cannot be used as the output folder ({exc.strerror}); pass another folder.")
    cache = None
    if args.cache:
        from .bench.cache import default_cache_dir

        cache = Path(args.cache_dir).expanduser() if args.cache_dir is not None else default_cache_dir()
    everything = {}
    for workload in workloads:
        target = args.target_accuracy
        if target is None:
            target = workload.quick_target_accuracy if args.quick else workload.target_accuracy
        budget = args.budget_s
        if budget is None:
            budget = workload.quick_budget_s if args.quick else workload.budget_s
        folder = out / workload.name if len(workloads) > 1 else out
        saved = folder / "results.json"
        before = saved.stat().st_mtime_ns if saved.is_file() else None  # an earlier bench's file is no progress
        try:
            results = run_benchmark(workload, policies, seeds, target, budget, folder, args.eval_every, args.progress,
                                    calibrate_steps=args.calibrate_steps, tune_factors=factors, resume=args.resume,
                                    device=args.device, target_window=args.target_window, cache_dir=cache,
                                    clock=args.clock)
        except (ImportError, FileNotFoundError) as exc:  # a missing optional extra, or a real data set not there
            parser.exit(2, f"batchpilot bench: error: {exc}\n")
        except ValueError as exc:  # --resume from a damaged or different results.json, or an unusable --device
            parser.error(str(exc))
        except KeyboardInterrupt:
            if saved.is_file() and saved.stat().st_mtime_ns != before:
                where = f"finished runs are in {saved} (--resume goes on)"
            else:
                where = "no run had finished" + ("" if before is None else f"; {saved} is as it was before")
            parser.exit(130, f"\nbatchpilot bench: interrupted; {where}\n")
        everything[workload.name] = results
        print()
        print(f"{workload.name}: time to test accuracy {target:g} (training time, median over seeds {seeds})")
        print(format_table(results))
        hits = sum(bool(r.get("cached")) for r in results["runs"])
        if hits:
            print(f"{hits} of {len(results['runs'])} runs read from the cache in {results['config']['cache_dir']} "
                  "(static runs of an earlier bench with the same settings; --no-cache trains them again)")
        for key in ("a", "b", "c", "d"):
            entry = results["targets"][key]
            print(f"target ({key}): {entry['status']}: {entry['text']}")
        for line in cluster_clock_lines(results):
            print(line)
        written = write_report(results, folder)
        beside = "plots and results.json" if len(written) > 1 else "results.json; no plots without matplotlib"
        print(f"\nreport: {folder / 'report.md'} ({beside} beside it)")
    if len(workloads) > 1:
        print(f"\nall workloads: {write_index(everything, out)}")
    return 0


# What a field of the wrong kind or size in a hand-edited or foreign file raises deep inside the report.
_MALFORMED = (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError, OverflowError, RecursionError)


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench.report import check_results, plot_log, write_report

    path = Path(args.log)
    out = Path(args.out) if args.out is not None else path.parent
    try:
        if path.suffix.lower() == ".json":
            try:
                results = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise ValueError(f"{str(path)!r} is not JSON ({type(exc).__name__}: {exc}); pass a bench "
                                 "results.json.") from exc
            if not isinstance(results, dict) or "runs" not in results:
                raise ValueError(f"{str(path)!r} is not a bench results.json (no 'runs'); pass an adjustment log .jsonl.")
            check_results(results, path)
            try:
                written = list(write_report(results, out).values())
            except _MALFORMED as exc:
                raise ValueError(f"{str(path)!r} is not a well-formed bench results.json ({type(exc).__name__}: "
                                 f"{exc}); pass one written by `batchpilot bench`.") from exc
        else:
            try:
                written = plot_log(path, out, x=args.x)
            except _MALFORMED as exc:
                raise ValueError(f"{str(path)!r} is not a well-formed adjustment log ({type(exc).__name__}: {exc}); "
                                 "pass one written by Pilot(log_path=...).") from exc
    except (ValueError, ImportError) as exc:
        parser.exit(2, f"batchpilot report: error: {exc}\n")
    except OSError as exc:  # a missing or unreadable file, an --out that is a file, ...
        text = str(exc) if exc.strerror is None else f"{exc.strerror}: {exc.filename or path}"
        parser.exit(2, f"batchpilot report: error: {text}\n")
    for p in written:
        print(p)
    return 0


def list_text() -> str:
    """What ``batchpilot bench --list`` prints: the workloads and the policies."""
    from .bench.policies import DESCRIPTIONS, NAMED_SETS
    from .bench.workloads import WORKLOADS

    lines = ["Workloads (--workload NAME, or all):"]
    for w in WORKLOADS.values():
        lines.append(f"  {w.name:<10} target {w.target_accuracy:g} (quick {w.quick_target_accuracy:g}), budget "
                     f"{w.budget_s:g} s/run, batch {w.min_batch_size}..{w.max_batch_size}, lr_rule {w.lr_rule}"
                     + ("" if w.in_all else "  [not in 'all']"))
        lines.append(f"             {w.description}")
    lines += ["", "Policies (--policies, comma-separated):"]
    forms = {"static": "static:N[@lr=X]", "tuned-static": "tuned-static:N | A-B | grid", "finder": "finder",
             "ramp": "ramp | ramp:START-END[@EPOCHS]", "smith": "ramp-smith | smith:START-END@EPOCHS",
             "warmup": "warmup:SMALL-TARGET@W+R"}
    for kind, text in DESCRIPTIONS.items():
        lines.append(f"  {forms.get(kind, kind):<38} {text}")
    lines += ["", "Named sets:"]
    lines += [f"  {name:<11} {spec}" for name, spec in NAMED_SETS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``batchpilot`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Raises:
        SystemExit: with status 2 for bad input (argparse convention), after printing the reason.
    """
    args = _parser().parse_args(argv)
    return args.run(args, args.subparser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
