"""Gradient norms and clipping thresholds."""

from __future__ import annotations

import collections
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, Literal, overload

import torch

from ._validation import check_positive_int


@overload
def sum_of_squares(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], lazy: Literal[False] = False) -> float: ...
@overload
def sum_of_squares(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], lazy: bool) -> float | torch.Tensor: ...
def sum_of_squares(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], lazy: bool = False) -> float | torch.Tensor:
    """``sum_i |t_i|^2`` over ``tensors`` (``inf``/``nan`` when one is not finite).

    On an accelerator the per-tensor norms are summed on the device and copied to the host once (a copy
    per tensor would synchronise once per parameter); with ``lazy`` the sum stays a 0-dim float64 device
    tensor (no synchronisation at all; ``float()`` it later). On CPU reading each norm is cheaper than
    stacking, and a float is returned either way.
    """
    if not tensors:
        return 0.0
    norms = _norms(tensors)
    if tensors[0].device.type != "cpu":
        total = _stacked_sum_of_squares(norms)
        return total if lazy else float(total)
    return sum(float(n) ** 2 for n in norms)


def _norms(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Each tensor's L2 norm; those of float16/bfloat16 tensors in float32 (a float16 norm overflows to inf
    above 65504 although every element is finite, and a bfloat16 one keeps ~3 digits)."""
    is_low = [t.dtype in (torch.float16, torch.bfloat16) for t in tensors]
    if not any(is_low):
        return list(torch._foreach_norm(tensors))
    low = [i for i, flag in enumerate(is_low) if flag]
    rest = [i for i, flag in enumerate(is_low) if not flag]
    norms: list[Any] = [None] * len(tensors)
    if rest:
        for i, n in zip(rest, torch._foreach_norm([tensors[i] for i in rest])):
            norms[i] = n
    try:
        low_norms = list(torch._foreach_norm([tensors[i] for i in low], 2, dtype=torch.float32))
    except TypeError:  # torch before the dtype argument: one norm per tensor
        low_norms = [torch.linalg.vector_norm(tensors[i], dtype=torch.float32) for i in low]
    for i, n in zip(low, low_norms):
        norms[i] = n
    return norms


def _stacked_sum_of_squares(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    device = norms[0].device  # parameters may sit on several devices (model parallel): gather on the first
    return torch.stack([n.to(device, torch.float64) for n in norms]).square().sum()


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Global L2 norm of all gradients (``inf``/``nan`` when a gradient is not finite)."""
    return math.sqrt(float(sum_of_squares([p.grad for p in params if p.grad is not None])))


class StatsClip:
    """A clipping threshold taken from the statistics of recent gradient norms (seed 002, "dynamic
    threshold from gradient variance").

    The seed's snippet computes ``0.1 * std`` of per-parameter norms, which is not well defined (it
    concatenates 0-d tensors) and would clip almost every step; we read its intent as "clip outliers
    relative to recent gradient statistics": threshold = ``mean + z * std`` of the last ``window``
    pre-clip global norms, after ``warmup`` steps (no clipping before), in the spirit of OLMo-core's
    outlier skipping. Only finite norms enter the window.

    Args:
        z: How many standard deviations above the mean a norm may lie before it is clipped.
        window: Number of recent norms that define mean and standard deviation.
        warmup: Steps without clipping, while the window fills.
    """

    def __init__(self, z: float = 3.0, window: int = 50, warmup: int = 10) -> None:
        if isinstance(z, bool) or not isinstance(z, numbers.Real) or not 0 < z < math.inf:
            raise ValueError(f"StatsClip needs a finite z > 0 (standard deviations), got {z!r}.")
        window = check_positive_int(window, "StatsClip's window", minimum=2)
        warmup = check_positive_int(warmup, "StatsClip's warmup", minimum=2)
        if warmup > window:
            raise ValueError(f"StatsClip's warmup={warmup} is larger than its window={window}: the window never holds "
                             "that many norms, so it would never clip; pass warmup <= window.")
        self.z: float = float(z)
        self.window: int = window
        self.warmup: int = warmup
        self._norms: collections.deque[float] = collections.deque(maxlen=self.window)

    def threshold(self) -> float | None:
        """The current clipping threshold, or ``None`` while warming up."""
        if len(self._norms) < self.warmup:
            return None
        n = len(self._norms)
        mean = sum(self._norms) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self._norms) / (n - 1))
        return mean + self.z * std

    def observe(self, norm: float) -> None:
        """Record one pre-clip global gradient norm."""
        if math.isfinite(norm):
            self._norms.append(float(norm))

    def state_dict(self) -> dict[str, Any]:
        return {"z": self.z, "window": self.window, "warmup": self.warmup, "norms": list(self._norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.z, self.window, self.warmup = float(state["z"]), int(state["window"]), int(state["warmup"])
        self._norms = collections.deque(state["norms"], maxlen=self.window)
