"""Data layer: the adaptive batch sampler and the loader built on it."""

from .loader import AdaptiveDataLoader, MicroBatch
from .sampler import AdaptiveBatchSampler

__all__ = ["AdaptiveBatchSampler", "AdaptiveDataLoader", "MicroBatch"]
