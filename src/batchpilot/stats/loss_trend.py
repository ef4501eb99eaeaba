"""Loss trend: how much the training loss fell over the last ``window`` steps.

The threshold rules of seed 000 (Sec. 4.2) adjust the batch when "the loss decreased by less than 1%"
several checks in a row. We define that decrease over a window of the ``w`` most recent step losses as
the drop from the mean of its older half to the mean of its newer half, relative to the older half::

    relative_decrease = (mean(first half) - mean(second half)) / |mean(first half)|

(for odd ``w`` the middle loss belongs to neither half). A positive value means the loss is falling:
``0.01`` is a 1% decrease. Comparing half-window means rather than two single losses averages away
most of the step-to-step noise of mini-batch losses, and the result is easy to derive by hand. The
least-squares slope over the window is offered as well (:attr:`LossTrend.slope`).
"""

from __future__ import annotations

import collections
import math
import numbers
from typing import Any

__all__ = ["LossTrend"]


class LossTrend:
    """Relative decrease of the training loss over the last ``window`` steps.

    Args:
        window: Number of recent step losses considered, >= 2. Readings are ``None`` until it is full.

    Raises:
        ValueError: ``window`` is not an int >= 2.
    """

    def __init__(self, window: int = 50) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an int >= 2 (two halves to compare), got {window!r}.")
        self.window = window
        self._losses: collections.deque[float] = collections.deque(maxlen=window)

    def update(self, loss: float) -> None:
        """Record the mean training loss of one step.

        Raises:
            ValueError: ``loss`` is not a finite number (skip non-finite steps instead of passing them).
        """
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real) or not math.isfinite(loss):
            raise ValueError(f"loss must be a finite number, got {loss!r}; do not record skipped (non-finite) steps.")
        self._losses.append(float(loss))

    @property
    def count(self) -> int:
        """Losses currently held (at most ``window``)."""
        return len(self._losses)

    @property
    def ready(self) -> bool:
        """Whether the window is full."""
        return len(self._losses) == self.window

    @property
    def relative_decrease(self) -> float | None:
        """``(mean(first half) - mean(second half)) / |mean(first half)|``; ``None`` until the window is
        full or when the first half's mean is 0."""
        if not self.ready:
            return None
        half = self.window // 2
        losses = list(self._losses)
        first = sum(losses[:half]) / half
        second = sum(losses[-half:]) / half
        if first == 0:
            return None
        return (first - second) / abs(first)

    @property
    def slope(self) -> float | None:
        """Least-squares slope of loss against step over the window (loss units per step; negative while
        the loss falls); ``None`` until the window is full."""
        if not self.ready:
            return None
        w = self.window
        x_mean = (w - 1) / 2
        y_mean = sum(self._losses) / w
        sxy = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(self._losses))
        sxx = w * (w * w - 1) / 12  # sum of (i - x_mean)^2 for i = 0..w-1
        return sxy / sxx

    def metrics(self) -> dict[str, float]:
        """``{"stats/loss_trend": relative_decrease}`` when available, else ``{}``."""
        value = self.relative_decrease
        return {} if value is None else {"stats/loss_trend": value}

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot."""
        return {"window": self.window, "losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: ``window`` < 2, more losses than the window, or a loss that is not finite.
        """
        window, losses = int(state["window"]), [float(v) for v in state["losses"]]
        if window < 2 or len(losses) > window or not all(math.isfinite(v) for v in losses):
            raise ValueError(f"invalid LossTrend state {state!r}: window >= 2, at most window finite losses.")
        self.window = window
        self._losses = collections.deque(losses, maxlen=window)

    def __repr__(self) -> str:
        return f"LossTrend(window={self.window}, count={self.count}, relative_decrease={self.relative_decrease})"
