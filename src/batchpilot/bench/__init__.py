"""The built-in benchmark: workloads, the time-to-accuracy runner, and reports with plots.

``batchpilot bench`` (see :mod:`batchpilot.cli`) is a thin wrapper around :func:`run_benchmark` and
:func:`write_report`. Plotting needs ``batchpilot[plot]`` and the MNIST-1D workload ``batchpilot[bench]``;
both are imported only when used.
"""

from .report import format_table, plot_log, write_report
from .runner import Policy, parse_policies, parse_policy, run_benchmark, summarize
from .workloads import WORKLOADS, Workload, get_workload

__all__ = [
    "WORKLOADS",
    "Policy",
    "Workload",
    "format_table",
    "get_workload",
    "parse_policies",
    "parse_policy",
    "plot_log",
    "run_benchmark",
    "summarize",
    "write_report",
]
