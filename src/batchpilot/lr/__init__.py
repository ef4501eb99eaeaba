"""Learning rate and batch size.

- :mod:`.coupling`: :class:`LRCoupling` rescales the LR by ``lr_factor(rule, B, B0)`` around every
  optimizer step, on top of the user's own ``torch.optim.lr_scheduler`` (linear, sqrt, linear-then-sqrt).
- :mod:`.schedules`: :class:`SampleLRSchedule`, LR schedules keyed on ``samples_seen``.
- :mod:`.adascale`: AdaScale's gain from gradient statistics (Johnson et al. 2020).
"""

from ._common import LRRule
from .adascale import AdaScaleLR, adascale_gain
from .coupling import LRCoupling, lr_factor
from .schedules import SampleLRSchedule, warmup_constant, warmup_cosine

__all__ = [
    "AdaScaleLR",
    "LRCoupling",
    "LRRule",
    "SampleLRSchedule",
    "adascale_gain",
    "lr_factor",
    "warmup_constant",
    "warmup_cosine",
]
