"""The engine: `Pilot` (the step, read top to bottom), its settings, and the one decision path the
integrations share (`SizeDriver`)."""

from .config import (
    CheckpointConfig,
    DataConfig,
    DecisionConfig,
    DistributedConfig,
    LoggingConfig,
    LRConfig,
    MemoryConfig,
    PilotConfig,
    PrecisionConfig,
    StatsConfig,
)
from .driver import SizeDriver
from .pilot import Pilot
from .replay import is_out_of_memory

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DecisionConfig",
    "DistributedConfig",
    "LRConfig",
    "LoggingConfig",
    "MemoryConfig",
    "Pilot",
    "PilotConfig",
    "PrecisionConfig",
    "SizeDriver",
    "StatsConfig",
    "is_out_of_memory",
]
