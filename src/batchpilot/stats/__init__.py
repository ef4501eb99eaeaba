"""Statistics: estimators that turn gradients, losses and timings into the numbers controllers read.

Pure, cheap and ``state_dict``-able; none of them communicates (the engine reduces across ranks in
``batchpilot.distributed`` and passes the results in). Each stateful estimator has ``metrics()``, its
readings under the logged, namespaced names (``stats/...``, ``perf/...``, ``system/...``) that end up in
:attr:`batchpilot.Observation.stats`. See docs/statistics.md.
"""

from .grad_variance import PerSampleGradError, micro_batch_grad_variance, per_sample_grad_variance
from .loss_trend import LossTrend
from .noise_scale import NoiseScaleEstimator, small_big_from_micro, two_batch_estimates
from .system import SystemMonitor
from .throughput import ThroughputModel

__all__ = [
    "LossTrend",
    "NoiseScaleEstimator",
    "PerSampleGradError",
    "SystemMonitor",
    "ThroughputModel",
    "micro_batch_grad_variance",
    "per_sample_grad_variance",
    "small_big_from_micro",
    "two_batch_estimates",
]
