"""Controllers: decide the global batch size of the next step from an :class:`Observation`."""

from .auto import Auto
from .base import Controller, InvalidDecisionError, Observation
from .boundary import validate_decision
from .callable import Schedule, linear_increase_scheduler
from .context import ContextSchedule, curriculum_scheduler, incremental_scheduler, task_aware_scheduler
from .context_data import DataMix, DataScore
from .goodput import Goodput
from .noise_scale import NoiseScale
from .ppo import PPOController
from .schedules import Constant, Exponential, LinearIncrease, MultiplicativeStep, Piecewise, WarmupRamp
from .threshold_rules import ThresholdRules
from .variance_rule import VarianceRule

__all__ = [
    "Auto",
    "Constant",
    "ContextSchedule",
    "Controller",
    "DataMix",
    "DataScore",
    "Exponential",
    "Goodput",
    "InvalidDecisionError",
    "LinearIncrease",
    "MultiplicativeStep",
    "NoiseScale",
    "Observation",
    "PPOController",
    "Piecewise",
    "Schedule",
    "ThresholdRules",
    "VarianceRule",
    "WarmupRamp",
    "curriculum_scheduler",
    "incremental_scheduler",
    "linear_increase_scheduler",
    "task_aware_scheduler",
    "validate_decision",
]
