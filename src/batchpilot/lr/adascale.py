"""AdaScale (Johnson et al. 2020): an LR gain from gradient statistics, and progress in scale-invariant
iterations."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from .._validation import check_batch_size
from ._common import _check_optimizer, _check_stat, _get_lr, _set_lr


def adascale_gain(trace_cov: float, grad_sq_norm: float, batch_size: int, base_batch_size: int) -> float:
    """AdaScale's gain ratio ``r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2)``, ``S = B / B0``.

    Johnson et al. 2020, "AdaScale SGD: A User-Friendly Algorithm for Distributed Training" (ICML,
    Algorithm 1). There ``sigma^2`` is the variance of a gradient averaged over one *base* batch and
    ``mu^2 = |G|^2``. The noise-scale estimator reports the *per-sample* trace ``tr(Sigma)``
    (``stats/trace_cov``, McCandlish et al. 2018, so that ``B_simple = tr(Sigma) / |G|^2``), hence
    ``sigma^2 = tr(Sigma) / B0`` and, equivalently, ``r = (B_simple / B0 + 1) / (B_simple / B + 1)``.
    ``r / S`` is Pollux's statistical efficiency ``(B_simple + B0) / (B_simple + B)``.

    ``1 <= r <= S`` for ``S >= 1`` (``r = 1``: no noise, a bigger batch buys nothing; ``r = S``: pure
    noise, linear scaling); for ``S < 1`` the same formula gives ``S <= r <= 1``. Unbiased estimates
    can be negative early in training: negative inputs count as 0. With both 0, ``r = 1``.

    Args:
        trace_cov: ``tr(Sigma)``, per sample (``stats/trace_cov``).
        grad_sq_norm: ``|G|^2`` (``stats/grad_sq_norm``).
        batch_size: ``B``, the global batch size of the step.
        base_batch_size: ``B0``, the batch size the LR schedule was written for.

    Raises:
        TypeError, ValueError: a statistic is not a finite real, or a batch size is not an int >= 1.
    """
    b = check_batch_size(batch_size, "batch_size")
    b0 = check_batch_size(base_batch_size, "base_batch_size")
    variance = max(_check_stat(trace_cov, "trace_cov"), 0.0) / b0  # sigma^2 of a B0-sample mean
    mean_sq = max(_check_stat(grad_sq_norm, "grad_sq_norm"), 0.0)  # mu^2
    scale = b / b0
    if variance + mean_sq == 0.0:
        return 1.0
    gain = (variance + mean_sq) / (variance / scale + mean_sq)
    return min(max(gain, min(1.0, scale)), max(1.0, scale))  # guard the bounds against rounding


class AdaScaleLR:
    """Multiply the LR by AdaScale's gain ``r_t`` each step; count progress in scale-invariant iterations.

    Johnson et al. 2020 (Algorithm 1): ``w <- w - r_t * lr(tau_t) * g_t`` and ``tau_{t+1} = tau_t + r_t``,
    where ``lr(tau)`` is a schedule written for the base batch ``B0``. :attr:`progress` is ``tau`` (in
    ``B0``-steps) and :attr:`progress_samples` is ``tau * B0``, the clock to run a schedule written for
    ``B0`` on (e.g. :class:`SampleLRSchedule`). Like :class:`LRCoupling`, :meth:`scale` and
    :meth:`unscale` bracket ``optimizer.step()``, so torch schedulers only ever see their own LR::

        ada = AdaScaleLR(optimizer, base_batch_size=32)
        schedule = SampleLRSchedule(optimizer, warmup_cosine(10_000, 500_000))    # written for B0 = 32
        # every step, after backward (this step's statistics) and before optimizer.step():
        ada.scale(ada.gain_for(batch_size, trace_cov, grad_sq_norm))
        optimizer.step()
        ada.unscale()
        schedule.step(ada.progress_samples)

    Without an optimizer (``optimizer=None``) it only keeps the books (gain and progress).

    Args:
        optimizer: Any ``torch.optim.Optimizer``, or ``None``.
        base_batch_size: ``B0``.

    Raises:
        TypeError: ``optimizer`` has no ``param_groups``; TypeError/ValueError for a bad ``base_batch_size``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, base_batch_size: int) -> None:
        if optimizer is not None:
            _check_optimizer(optimizer)
        self.optimizer = optimizer
        self.base_batch_size = check_batch_size(base_batch_size, "base_batch_size")
        self.progress = 0.0  # tau: sum of the gains, in B0-steps
        self.steps = 0  # scale() calls
        self.gain = 1.0  # the gain of the last scale()
        self._scaled = False
        self._unscaled_lrs: list[float] = []
        self._written_lrs: list[float] = []

    @property
    def progress_samples(self) -> int:
        """``floor(progress * B0)``: samples at the base batch size that the steps so far are worth."""
        return int(math.floor(self.progress * self.base_batch_size * (1.0 + 1e-12)))

    @property
    def is_scaled(self) -> bool:
        """Whether the optimizer's LRs currently include the gain."""
        return self._scaled

    def gain_for(
        self, batch_size: int, trace_cov: float | None = None, grad_sq_norm: float | None = None
    ) -> float:
        """:func:`adascale_gain` at this ``B0``; while a statistic is ``None`` or NaN, ``min(1, S)`` with
        ``S = B / B0``, the smallest gain possible at that scale (no scaling above ``B0``, the linear rule below)."""
        if trace_cov is None or grad_sq_norm is None or math.isnan(trace_cov) or math.isnan(grad_sq_norm):
            return min(1.0, check_batch_size(batch_size, "batch_size") / self.base_batch_size)
        return adascale_gain(trace_cov, grad_sq_norm, batch_size, self.base_batch_size)

    def scale(self, gain: float) -> float:
        """Multiply every param group's LR by ``gain`` and add ``gain`` to :attr:`progress`; return ``gain``.

        Raises:
            ValueError: ``gain`` is not a finite real > 0.
            RuntimeError: the LRs are already scaled (call :meth:`unscale` first).
        """
        if isinstance(gain, bool) or not isinstance(gain, numbers.Real) or not (math.isfinite(gain) and gain > 0):
            raise ValueError(f"AdaScale gain must be a finite real > 0, got {gain!r}; use adascale_gain().")
        if self._scaled:
            raise RuntimeError(
                f"AdaScaleLR.scale({gain!r}) called while the LRs are already scaled by {self.gain!r}; "
                "call unscale() after optimizer.step() and before the next scale()."
            )
        gain = float(gain)
        if self.optimizer is not None:
            groups = self.optimizer.param_groups
            self._unscaled_lrs = [_get_lr(g) for g in groups]
            for group, lr in zip(groups, self._unscaled_lrs):
                _set_lr(group, lr * gain)
            self._written_lrs = [_get_lr(g) for g in groups]
        self.gain, self.progress, self.steps, self._scaled = gain, self.progress + gain, self.steps + 1, True
        return gain

    def unscale(self) -> None:
        """Take the gain back out of every param group's LR (exactly, unless something else changed it).

        Raises:
            RuntimeError: the LRs are not scaled.
        """
        if not self._scaled:
            raise RuntimeError("AdaScaleLR.unscale() called while the LRs are not scaled; call scale(gain) first.")
        if self.optimizer is not None:
            triples = zip(self.optimizer.param_groups, self._unscaled_lrs, self._written_lrs)
            for group, unscaled, written in triples:
                current = _get_lr(group)
                _set_lr(group, unscaled if current == written else current / self.gain)
        self._scaled = False

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: B0, progress, step count, last gain, and the scaled/unscaled LRs."""
        return {
            "base_batch_size": self.base_batch_size,
            "progress": self.progress,
            "steps": self.steps,
            "gain": self.gain,
            "scaled": self._scaled,
            "unscaled_lrs": list(self._unscaled_lrs),
            "written_lrs": list(self._written_lrs),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (load the optimizer's own state dict alongside it).

        Raises:
            ValueError: the state was saved with another ``base_batch_size``.
        """
        if int(state["base_batch_size"]) != self.base_batch_size:
            raise ValueError(
                f"this AdaScaleLR state was saved with base_batch_size={state['base_batch_size']}, but this "
                f"object has {self.base_batch_size}; build it with the same B0 before loading."
            )
        self.progress = float(state["progress"])
        self.steps = int(state["steps"])
        self.gain = float(state["gain"])
        self._scaled = bool(state["scaled"])
        self._unscaled_lrs = [float(x) for x in state.get("unscaled_lrs", [])]
        self._written_lrs = [float(x) for x in state.get("written_lrs", [])]
