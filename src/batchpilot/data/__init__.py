"""Data layer: the adaptive batch sampler, the micro-batch split and the loader built on them."""

from .loader import AdaptiveDataLoader, MicroBatch
from .sampler import AdaptiveBatchSampler, SamplerPosition
from .tokens import plan_token_batch

__all__ = ["AdaptiveBatchSampler", "AdaptiveDataLoader", "MicroBatch", "SamplerPosition", "plan_token_batch"]
