"""batchpilot: train PyTorch models with a batch size that changes while they train.

The public API is small: :class:`Pilot` runs adaptive-batch training inside your own loop, on top of
:class:`AdaptiveBatchSampler` / :class:`AdaptiveDataLoader` (exact data coverage for any sequence of
batch sizes); controllers live in :mod:`batchpilot.controllers`, LR rules in :mod:`batchpilot.lr`.
"""

from . import controllers, lr
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_checkpoint, save_checkpoint
from .controllers.base import Controller, Observation
from .data.loader import AdaptiveDataLoader, MicroBatch
from .data.sampler import AdaptiveBatchSampler
from .engine import Pilot
from .logs import read_log

__version__ = "0.1.0"

__all__ = [
    "AdaptiveBatchSampler",
    "AdaptiveDataLoader",
    "CheckpointError",
    "Controller",
    "MicroBatch",
    "Observation",
    "Pilot",
    "controllers",
    "latest_checkpoint",
    "load_checkpoint",
    "lr",
    "read_checkpoint",
    "read_log",
    "save_checkpoint",
]
