"""Learning-rate coupling: rescale the LR when the batch size changes, on top of the user's LR schedule.

The engine drives :class:`LRCoupling` around every optimizer step::

    coupling.scale(first_batch_size)          # once, before the first step
    for each step:
        optimizer.step()
        coupling.unscale()                    # param_group["lr"] is the schedule's LR again
        for s in lr_schedulers: s.step()      # torch schedulers see (and write) the unscaled LR
        coupling.scale(next_batch_size)       # the next step runs at schedule LR x factor(next B)

so the LR the optimizer uses is always ``schedule_lr * lr_factor(rule, B, B0)`` and no scheduler has to
know about batch sizes. :class:`SampleLRSchedule` is an LR schedule keyed on ``samples_seen``, which
keeps its meaning when the number of samples per step changes. :class:`AdaScaleLR` (with
:func:`adascale_gain`) scales the LR by AdaScale's gain, which depends on gradient statistics rather than
on the batch size alone, and counts progress in scale-invariant iterations.
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
