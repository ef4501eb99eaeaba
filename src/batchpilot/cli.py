"""The ``batchpilot`` command.

    batchpilot bench [--workload mnist1d] [--policies static:32,static:128,static:512,ramp] [--seeds 0,1]
                     [--target-accuracy A] [--budget-s S] [--eval-every E] [--out DIR] [--quick]
    batchpilot report LOG.jsonl --out DIR [--x samples|time]

Bad input (an unknown policy or workload, a malformed number, a missing log) ends with a one-line message
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main"]

# Settings of a full run and of --quick (about 2 minutes on 2 CPU cores, data generation included).
FULL = {"seeds": "0,1,2", "budget_s": 120.0}
QUICK = {"seeds": "0", "budget_s": 30.0}


def _parser() -> argparse.ArgumentParser:
    from .bench.runner import _POLICY_HELP, DEFAULT_POLICIES
    from .bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(
        prog="batchpilot", description="Train PyTorch models with a batch size that changes while they train."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    bench = sub.add_parser(
        "bench",
        help="time to a target accuracy under several batch-size policies",
        description="Train a built-in workload under several batch-size policies, side by side, and report "
        "the training time, steps and samples to a target test accuracy. Writes DIR/results.json, "
        "DIR/report.md and PNG plots.",
    )
    names = ", ".join(f"{w.name} ({w.description})" for w in WORKLOADS.values())
    bench.add_argument("--workload", default="mnist1d", help=f"one of: {names}. Default: mnist1d.")
    bench.add_argument("--policies", default=DEFAULT_POLICIES,
                       help=f"comma-separated policies: {_POLICY_HELP}. Default: {DEFAULT_POLICIES}.")
    bench.add_argument("--seeds", default=None,
                       help=f"comma-separated run seeds. Default: {FULL['seeds']} ({QUICK['seeds']} with --quick).")
    bench.add_argument("--target-accuracy", type=float, default=None,
                       help="test accuracy to reach. Default: the workload's (its quick target with --quick).")
    bench.add_argument("--budget-s", type=float, default=None,
                       help=f"most training seconds per run. Default: {FULL['budget_s']:g} ({QUICK['budget_s']:g} with --quick).")
    bench.add_argument("--eval-every", type=float, default=0.25, help="epochs between evaluations. Default: 0.25.")
    bench.add_argument("--out", default="bench-out", help="output folder. Default: ./bench-out.")
    bench.add_argument("--quick", action="store_true",
                       help="a run of about 2 minutes on 2 cores: one seed, a lower target, a short budget.")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch.set_num_threads for the run (default: leave torch's setting). On a busy "
                       "machine, 1 thread is far less sensitive to other processes.")
    bench.add_argument("--no-progress", dest="progress", action="store_false", help="print only the results.")
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
    return parser


def _seeds(text: str) -> list[int]:
    seeds = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if not item.isdigit():
            raise ValueError(f"--seeds: {item!r} is not a whole number >= 0; pass e.g. --seeds 0,1,2.")
        seeds.append(int(item))
    if not seeds:
        raise ValueError("--seeds is empty; pass at least one seed, e.g. --seeds 0.")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r} lists a seed twice; list each seed once.")
    return seeds


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench.report import format_table, write_report
    from .bench.runner import parse_policies, run_benchmark
    from .bench.workloads import get_workload

    mode = QUICK if args.quick else FULL
    try:
        workload = get_workload(args.workload)
        policies = parse_policies(args.policies)
        seeds = _seeds(args.seeds if args.seeds is not None else mode["seeds"])
    except ValueError as exc:
        parser.error(str(exc))
    target = args.target_accuracy
    if target is None:
        target = workload.quick_target_accuracy if args.quick else workload.target_accuracy
    budget = args.budget_s if args.budget_s is not None else mode["budget_s"]
    if not 0 < target <= 1:
        parser.error(f"--target-accuracy must be in (0, 1], got {target}.")
    if not 0 < budget < float("inf"):
        parser.error(f"--budget-s must be a positive number of seconds, got {budget}.")
    if not 0 < args.eval_every < float("inf"):
        parser.error(f"--eval-every must be a positive number of epochs, got {args.eval_every}.")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}.")
        import torch

        torch.set_num_threads(args.threads)

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {str(out)!r} cannot be used as the output folder ({exc.strerror}); pass another folder.")
    try:
        results = run_benchmark(workload, policies, seeds, target, budget, out, args.eval_every, args.progress)
    except ImportError as exc:  # a missing optional extra (mnist1d)
        parser.exit(2, f"batchpilot bench: error: {exc}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"\nbatchpilot bench: interrupted; finished runs are in {out / 'results.json'}\n")
    print()
    print(f"{workload.name}: time to test accuracy {target:g} (training time, median over seeds {seeds})")
    print(format_table(results))
    try:
        write_report(results, out)
    except ImportError as exc:  # matplotlib missing: the results are still there
        print(f"batchpilot bench: no plots: {exc}", file=sys.stderr)
        print(f"\nresults: {out / 'results.json'}")
        return 0
    print(f"\nreport: {out / 'report.md'} (plots and results.json beside it)")
    return 0


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench.report import plot_log, write_report

    path = Path(args.log)
    out = Path(args.out) if args.out is not None else path.parent
    try:
        if path.suffix == ".json":
            try:
                results = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{str(path)!r} is not JSON ({exc.msg}); pass a bench results.json.") from exc
            if not isinstance(results, dict) or "runs" not in results:
                raise ValueError(f"{str(path)!r} is not a bench results.json (no 'runs'); pass an adjustment log .jsonl.")
            written = list(write_report(results, out).values())
        else:
            written = plot_log(path, out, x=args.x)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        parser.exit(2, f"batchpilot report: error: {exc}\n")
    for p in written:
        print(p)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``batchpilot`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Raises:
        SystemExit: with status 2 for bad input (argparse convention), after printing the reason.
    """
    args = _parser().parse_args(argv)
    return args.run(args, args.subparser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
