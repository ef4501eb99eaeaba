"""The built-in benchmark: workloads, policies, the time-to-accuracy runner, reports with plots.

``batchpilot bench`` (see :mod:`batchpilot.cli`) is a thin wrapper around :func:`run_benchmark` and
:func:`write_report`. Modules: ``workloads``, ``tasks`` and ``cifar`` (data and models; ``load_cifar`` reads
CIFAR-10/100 from a local folder), ``policies`` (the
``--policies`` language), ``specs`` (what each policy trains), ``calibrate`` (step-time cost model,
batch-size finder), ``train`` (one run), ``runner`` (the benchmark), ``summary`` (medians, best static,
targets), ``report``, ``plots`` and ``progress``. Plotting needs
``batchpilot[plot]``; the MNIST-1D and digits workloads need ``batchpilot[bench]``; all are imported only
when used.
"""

from .cifar import load_cifar
from .policies import Policy, parse_policies, parse_policy
from .report import format_table, plot_log, write_report
from .runner import run_benchmark
from .summary import summarize
from .workloads import WORKLOADS, Workload, get_workload

__all__ = [
    "WORKLOADS",
    "Policy",
    "Workload",
    "format_table",
    "get_workload",
    "load_cifar",
    "parse_policies",
    "parse_policy",
    "plot_log",
    "run_benchmark",
    "summarize",
    "write_report",
]
