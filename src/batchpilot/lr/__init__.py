"""Learning rate and batch size.

- :mod:`.coupling`: :class:`LRCoupling` rescales the LR by ``lr_factor(rule, B, B0)`` around every
  optimizer step, on top of the user's own ``torch.optim.lr_scheduler`` (linear, sqrt, linear-then-sqrt).
- :mod:`.schedules`: :class:`SampleLRSchedule`, LR schedules keyed on ``samples_seen``.
- :mod:`.adascale`: AdaScale's gain from gradient statistics (Johnson et al. 2020).
- :mod:`.range_test`: the LR range test (Smith 2017): the largest useful LR, found in a few dozen steps.
"""

from ._common import LRRule, check_rule
from .adascale import AdaScaleLR, adascale_gain
from .coupling import LRCoupling, lr_factor
from .range_test import LRRangeTest, lr_range_test
from .schedules import SampleLRSchedule, warmup_constant, warmup_cosine

__all__ = [
    "AdaScaleLR",
    "LRCoupling",
    "LRRangeTest",
    "LRRule",
    "SampleLRSchedule",
    "adascale_gain",
    "check_rule",
    "lr_factor",
    "lr_range_test",
    "warmup_constant",
    "warmup_cosine",
]
