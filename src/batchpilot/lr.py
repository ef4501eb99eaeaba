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

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

import torch

from ._validation import check_batch_size, check_positive_int

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

LRRule = Union[str, Callable[[float], float]]
"""``"none"``, ``"linear"``, ``"sqrt"``, ``"linear-then-sqrt"`` or a callable ``ratio -> factor``."""

RULES = ("none", "linear", "sqrt", "linear-then-sqrt")


def lr_factor(rule: LRRule, batch_size: int, base_batch_size: int, knee: int = 4096) -> float:
    """The factor to multiply the LR by when training at ``batch_size`` instead of ``base_batch_size``.

    With ``k = batch_size / base_batch_size``:

    - ``"none"``: 1.
    - ``"linear"``: ``k`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.1; for SGD).
    - ``"sqrt"``: ``sqrt(k)`` (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
      Algorithms"; for Adam-type optimizers).
    - ``"linear-then-sqrt"``: ``k`` up to ``knee``, then ``(knee / B0) * sqrt(B / knee)`` above it
      (seed 002: linear scaling, square root above 4096); continuous at the knee. If ``B0 > knee`` it is
      ``sqrt(k)`` throughout.
    - a callable: ``rule(k)``, which must return a finite real > 0.

    Raises:
        ValueError: unknown ``rule``, or a callable rule returned something other than a finite real > 0.
        TypeError, ValueError: a batch size or ``knee`` is not an int >= 1.
    """
    b = check_batch_size(batch_size, "batch_size")
    b0 = check_batch_size(base_batch_size, "base_batch_size")
    knee = check_positive_int(knee, "knee")
    rule = _check_rule(rule)
    ratio = b / b0
    if callable(rule):
        factor = rule(ratio)
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not (
            math.isfinite(factor) and factor > 0
        ):
            raise ValueError(
                f"lr rule {_rule_name(rule)} returned {factor!r} for batch ratio {ratio!r}; "
                "it must return a finite real > 0 (the LR multiplier)."
            )
        return float(factor)
    if rule == "none":
        return 1.0
    if rule == "linear":
        return ratio
    if rule == "sqrt" or b0 > knee:
        return math.sqrt(ratio)
    if b <= knee:  # linear-then-sqrt, below the knee
        return ratio
    return (knee / b0) * math.sqrt(b / knee)


class LRCoupling:
    """Multiply each param group's LR by ``lr_factor(rule, B, base_batch_size)`` around each step.

    Composes with any ``torch.optim.lr_scheduler`` (or :class:`SampleLRSchedule`): between
    :meth:`unscale` and :meth:`scale` the optimizer holds the schedule's own LR, so the schedulers step
    as if the batch size never changed. :meth:`unscale` restores the exact values :meth:`scale` saw
    (no ``x * f / f`` rounding drift), unless something else changed the LR in between, in which case it
    divides by the factor. Construct torch schedulers before the first :meth:`scale`, since they record
    ``initial_lr`` from the optimizer.

    Args:
        optimizer: Any ``torch.optim.Optimizer`` (anything with ``param_groups``).
        base_batch_size: B0, the batch size the LRs in the optimizer (and the schedule) were tuned for.
        rule: See :func:`lr_factor`.
        knee: Batch size where ``"linear-then-sqrt"`` switches from linear to square root.

    Raises:
        TypeError: ``optimizer`` has no ``param_groups``.
        ValueError: unknown ``rule``; TypeError/ValueError for a bad ``base_batch_size`` or ``knee``.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, base_batch_size: int, rule: LRRule = "none", knee: int = 4096
    ) -> None:
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        self.base_batch_size = check_batch_size(base_batch_size, "base_batch_size")
        self.rule = _check_rule(rule)
        self.knee = check_positive_int(knee, "knee")
        self._factor = 1.0
        self._batch_size: int | None = None
        self._scaled = False
        self._unscaled_lrs: list[float] = []  # what scale() found, restored exactly by unscale()
        self._written_lrs: list[float] = []  # what scale() wrote
        self._factor_cache: dict[int, float] = {}

    @property
    def factor(self) -> float:
        """The factor of the last :meth:`scale` call (1.0 before the first)."""
        return self._factor

    @property
    def batch_size(self) -> int | None:
        """The batch size of the last :meth:`scale` call (``None`` before the first)."""
        return self._batch_size

    @property
    def is_scaled(self) -> bool:
        """Whether the optimizer's LRs currently include the factor."""
        return self._scaled

    def factor_for(self, batch_size: int) -> float:
        """``lr_factor(self.rule, batch_size, self.base_batch_size, self.knee)`` (cached: it runs every step)."""
        factor = self._factor_cache.get(batch_size)
        if factor is None:
            factor = self._factor_cache[batch_size] = lr_factor(self.rule, batch_size, self.base_batch_size, self.knee)
        return factor

    def scale(self, batch_size: int) -> float:
        """Multiply every param group's LR by the factor for ``batch_size``; return the factor.

        Raises:
            RuntimeError: the LRs are already scaled (call :meth:`unscale` first).
        """
        if self._scaled:
            raise RuntimeError(
                f"LRCoupling.scale({batch_size!r}) called while the LRs are already scaled by "
                f"{self._factor!r}; call unscale() after optimizer.step() and before scale()."
            )
        factor = self.factor_for(batch_size)
        groups = self.optimizer.param_groups
        self._unscaled_lrs = [_get_lr(g) for g in groups]
        for group, lr in zip(groups, self._unscaled_lrs):
            _set_lr(group, lr * factor)
        self._written_lrs = [_get_lr(g) for g in groups]
        self._factor, self._batch_size, self._scaled = factor, int(batch_size), True
        return factor

    def unscale(self) -> None:
        """Take the factor back out of every param group's LR (groups added since are left alone).

        Raises:
            RuntimeError: the LRs are not scaled (call :meth:`scale` first).
        """
        if not self._scaled:
            raise RuntimeError(
                "LRCoupling.unscale() called while the LRs are not scaled; call scale(batch_size) "
                "before the first optimizer.step() and after every unscale()."
            )
        triples = zip(self.optimizer.param_groups, self._unscaled_lrs, self._written_lrs)
        for group, unscaled, written in triples:
            current = _get_lr(group)
            _set_lr(group, unscaled if current == written else current / self._factor)
        self._scaled = False

    def scaled_lrs(self) -> list[float]:
        """The LRs the optimizer uses at the current batch size (schedule LR x factor), per group."""
        lrs = [_get_lr(g) for g in self.optimizer.param_groups]
        return lrs if self._scaled else [lr * self._factor for lr in lrs]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the factor, the batch size, whether the LRs are scaled, saved LRs."""
        return {
            "factor": self._factor,
            "batch_size": self._batch_size,
            "scaled": self._scaled,
            "unscaled_lrs": list(self._unscaled_lrs),
            "written_lrs": list(self._written_lrs),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; load the optimizer's own state dict alongside it."""
        self._factor = float(state["factor"])
        self._batch_size = None if state.get("batch_size") is None else int(state["batch_size"])
        self._scaled = bool(state["scaled"])
        self._unscaled_lrs = [float(x) for x in state.get("unscaled_lrs", [])]
        self._written_lrs = [float(x) for x in state.get("written_lrs", [])]


class SampleLRSchedule:
    """An LR schedule keyed on ``samples_seen``: ``lr = base_lr * fn(samples_seen)`` for every group.

    Step counts lose their meaning when the batch size changes; samples do not. The base LR of each group
    is its ``initial_lr`` (set from ``lr`` at construction if absent, as torch schedulers do), and
    ``fn(0)`` is applied at construction. ``fn`` itself is not saved in the state dict: build the
    schedule with the same ``fn`` before loading.

    Args:
        optimizer: Any ``torch.optim.Optimizer``.
        fn: ``samples_seen -> multiplier`` (finite, >= 0), e.g. :func:`warmup_cosine`.

    Raises:
        TypeError: ``optimizer`` has no ``param_groups`` or ``fn`` is not callable.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fn: Callable[[int], float]) -> None:
        _check_optimizer(optimizer)
        if not callable(fn):
            raise TypeError(
                f"SampleLRSchedule needs a callable samples_seen -> multiplier, got {fn!r}; "
                "pass e.g. warmup_cosine(warmup_samples, total_samples)."
            )
        self.optimizer = optimizer
        self.fn = fn
        self.base_lrs = [float(g.setdefault("initial_lr", _get_lr(g))) for g in optimizer.param_groups]
        self.samples_seen = 0
        self._last_lr: list[float] = []
        self.step(0)

    def step(self, samples_seen: int) -> None:
        """Set every group's LR for the step that starts after ``samples_seen`` samples.

        Raises:
            ValueError: ``fn`` returned something other than a finite real >= 0.
            TypeError, ValueError: ``samples_seen`` is not an int >= 0.
        """
        samples_seen = check_positive_int(samples_seen, "samples_seen", minimum=0)
        multiplier = self.fn(samples_seen)
        if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real) or not (
            math.isfinite(multiplier) and multiplier >= 0
        ):
            raise ValueError(
                f"LR schedule {_rule_name(self.fn)} returned {multiplier!r} at samples_seen={samples_seen}; "
                "it must return a finite real >= 0 (the multiplier of the base LR)."
            )
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            _set_lr(group, base * float(multiplier))
        self._last_lr = [_get_lr(g) for g in self.optimizer.param_groups]
        self.samples_seen = samples_seen

    def get_last_lr(self) -> list[float]:
        """The LRs set by the last :meth:`step`, per group."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: base LRs, the last ``samples_seen`` and the last LRs."""
        return {
            "base_lrs": list(self.base_lrs),
            "samples_seen": self.samples_seen,
            "last_lr": self.get_last_lr(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the optimizer's LRs come from its own state dict)."""
        self.base_lrs = [float(x) for x in state["base_lrs"]]
        self.samples_seen = int(state["samples_seen"])
        self._last_lr = [float(x) for x in state["last_lr"]]


@dataclass(frozen=True)
class _WarmupCosine:
    """Multiplier: linear warm-up to 1, then a half cosine to ``min_ratio`` at ``total_samples``."""

    warmup_samples: int
    total_samples: int
    min_ratio: float = 0.0

    def __call__(self, samples_seen: int) -> float:
        if samples_seen < self.warmup_samples:
            return (samples_seen + 1) / self.warmup_samples
        if samples_seen >= self.total_samples:
            return self.min_ratio
        progress = (samples_seen - self.warmup_samples) / (self.total_samples - self.warmup_samples)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class _WarmupConstant:
    """Multiplier: linear warm-up to 1 over ``warmup_samples``, then 1."""

    warmup_samples: int

    def __call__(self, samples_seen: int) -> float:
        if samples_seen < self.warmup_samples:
            return (samples_seen + 1) / self.warmup_samples
        return 1.0


def warmup_cosine(warmup_samples: int, total_samples: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """``samples_seen -> multiplier``: ``(s + 1) / warmup_samples`` while ``s < warmup_samples``, then a
    half cosine from 1 down to ``min_ratio`` at ``total_samples``, then ``min_ratio``.

    Raises:
        TypeError, ValueError: ``warmup_samples`` not an int >= 0, ``total_samples`` not an int
            > ``warmup_samples``, or ``min_ratio`` not in ``[0, 1]``.
    """
    warmup_samples = check_positive_int(warmup_samples, "warmup_samples", minimum=0)
    total_samples = check_positive_int(total_samples, "total_samples", minimum=warmup_samples + 1)
    if isinstance(min_ratio, bool) or not isinstance(min_ratio, numbers.Real) or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be a real in [0, 1] (final LR / peak LR), got {min_ratio!r}.")
    return _WarmupCosine(warmup_samples, total_samples, float(min_ratio))


def warmup_constant(warmup_samples: int) -> Callable[[int], float]:
    """``samples_seen -> multiplier``: ``(s + 1) / warmup_samples`` while ``s < warmup_samples``, then 1.

    Raises:
        TypeError, ValueError: ``warmup_samples`` is not an int >= 0.
    """
    return _WarmupConstant(check_positive_int(warmup_samples, "warmup_samples", minimum=0))


# ----------------------------------------------------------------------------- AdaScale


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
        """:func:`adascale_gain` at this ``B0``; 1.0 (no scaling) while a statistic is ``None`` or NaN."""
        if trace_cov is None or grad_sq_norm is None or math.isnan(trace_cov) or math.isnan(grad_sq_norm):
            return 1.0
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


def _check_stat(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number (from the noise-scale estimator), got {value!r} of type "
            f"{type(value).__name__}."
        )
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}; skip the gain (use 1.0) until it is measured.")
    return float(value)


# ----------------------------------------------------------------------------- helpers


def _check_rule(rule: Any) -> LRRule:
    if callable(rule) or (isinstance(rule, str) and rule in RULES):
        return rule
    raise ValueError(
        f"unknown lr rule {rule!r}; use one of {', '.join(map(repr, RULES))} "
        "or a callable batch_ratio -> lr_factor."
    )


def _rule_name(fn: Any) -> str:
    return str(getattr(fn, "__name__", repr(fn)))


def _check_optimizer(optimizer: Any) -> None:
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"expected a torch.optim.Optimizer (with param_groups), got {type(optimizer).__name__}."
        )


def _get_lr(group: Mapping[str, Any]) -> float:
    return float(group["lr"])


def _set_lr(group: dict[str, Any], value: float) -> None:
    # Tensor LRs (capturable / compiled optimizers) are updated in place so references stay valid.
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(value)
    else:
        group["lr"] = value
