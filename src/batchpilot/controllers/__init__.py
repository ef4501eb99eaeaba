"""Controllers: decide the global batch size of the next step from an :class:`Observation`."""

from .auto import Auto
from .base import Controller, InvalidDecisionError, Observation
from .boundary import validate_decision
from .callable import Schedule, linear_increase_scheduler
from .goodput import Goodput
from .noise_scale import NoiseScale
from .ppo import PPOController
from .schedules import Constant, Exponential, LinearIncrease, MultiplicativeStep, Piecewise, WarmupRamp
from .threshold_rules import ThresholdRules
from .variance_rule import VarianceRule

__all__ = [
    "Auto",
    "Constant",
    "Controller",
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
    "linear_increase_scheduler",
    "validate_decision",
]
