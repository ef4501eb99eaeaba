"""Controllers: decide the global batch size of the next step from an :class:`Observation`."""

from .base import Controller, InvalidDecisionError, Observation, validate_decision
from .schedules import (
    Constant,
    Exponential,
    LinearIncrease,
    MultiplicativeStep,
    Piecewise,
    Schedule,
    WarmupRamp,
    linear_increase_scheduler,
)

__all__ = [
    "Constant",
    "Controller",
    "Exponential",
    "InvalidDecisionError",
    "LinearIncrease",
    "MultiplicativeStep",
    "Observation",
    "Piecewise",
    "Schedule",
    "WarmupRamp",
    "linear_increase_scheduler",
    "validate_decision",
]
