"""The trace-driven simulator (Pollux-style, docs/simulator.md): recorded workload traces, a cluster model, the
simulated training job, the goodput oracle and the best static batch. ``import batchpilot`` does not import it;
the gymnasium environment (:mod:`batchpilot.sim.env`, extra ``rl``) is imported only from its own module.

    from batchpilot.sim import ClusterSpec, goodput_oracle, load_trace
    print(goodput_oracle(load_trace("digits"), ClusterSpec.parse("gpus=16")).time_to_target_s)
"""

from .cluster import Cluster, ClusterSpec, Device, Network, StepTime, compression_factor
from .episode import SimJob, SimResult, drive, make_job, run_policy
from .oracle import best_static, goodput_oracle, goodput_policy, run_controller, static_sizes
from .trace import Trace, fit_compute, load_trace, record_trace, shipped_traces

__all__ = ["Cluster", "ClusterSpec", "Device", "Network", "SimJob", "SimResult", "StepTime", "Trace", "best_static",
           "compression_factor", "drive", "fit_compute", "goodput_oracle", "goodput_policy", "load_trace", "make_job",
           "record_trace", "run_controller", "run_policy", "shipped_traces", "static_sizes"]
