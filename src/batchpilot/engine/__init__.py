"""The engine: `Pilot` (the step, read top to bottom) and the one decision path the integrations share."""

from .driver import SizeDriver
from .pilot import Pilot
from .replay import is_out_of_memory

__all__ = ["Pilot", "SizeDriver", "is_out_of_memory"]
