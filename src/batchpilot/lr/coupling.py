"""Learning-rate coupling: rescale the LR when the batch size changes, on top of the user's LR schedule.

The engine drives :class:`LRCoupling` around every optimizer step::

    coupling.scale(first_batch_size)          # once, before the first step
    for each step:
        optimizer.step()
        coupling.unscale()                    # param_group["lr"] is the schedule's LR again
        for s in lr_schedulers: s.step()      # torch schedulers see (and write) the unscaled LR
        coupling.scale(next_batch_size)       # the next step runs at schedule LR x factor(next B)

so the LR the optimizer uses is always ``schedule_lr * lr_factor(rule, B, B0)`` and no scheduler has to
know about batch sizes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from .._validation import check_batch_size, check_positive_int
from ._common import LRRule, _check_optimizer, _get_lr, _rule_name, _set_lr, check_rule


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
    rule = check_rule(rule)
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
        self.rule = check_rule(rule)
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

    def rebase(self, base_batch_size: int) -> None:
        """Anchor the rule at another ``base_batch_size`` (from the next :meth:`scale` on; the automatic mode
        anchors it at the knee its probes find)."""
        self.base_batch_size = check_batch_size(base_batch_size, "base_batch_size")
        self._factor_cache.clear()

    def factor_for(self, batch_size: int) -> float:
        """``lr_factor(self.rule, batch_size, self.base_batch_size, self.knee)`` (cached: it runs every step)."""
        # Only a plain int hits the cache: 64.0 and True equal the keys 64 and 1, but lr_factor refuses them.
        factor = self._factor_cache.get(batch_size) if type(batch_size) is int else None
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
        """JSON-serialisable state: the anchor (``base_batch_size``, rule, knee), the factor, the batch size,
        whether the LRs are scaled, saved LRs."""
        return {
            "base_batch_size": self.base_batch_size,
            "rule": self.rule if isinstance(self.rule, str) else "callable",
            "knee": self.knee,
            "factor": self._factor,
            "batch_size": self._batch_size,
            "scaled": self._scaled,
            "unscaled_lrs": list(self._unscaled_lrs),
            "written_lrs": list(self._written_lrs),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; load the optimizer's own state dict alongside it.

        Raises:
            ValueError: the state was saved with another ``base_batch_size``, rule or knee (the LR would change
                silently: with B0 = 256 instead of 32 the linear rule's factor at 256 is 1, not 8).
        """
        rule = self.rule if isinstance(self.rule, str) else "callable"
        saved = {"rule": rule, "base_batch_size": self.base_batch_size if rule != "none" else state.get("base_batch_size"),
                 "knee": self.knee if rule == "linear-then-sqrt" else state.get("knee")}
        differ = [f"{k}={state[k]!r} there, {v!r} here" for k, v in saved.items() if k in state and state[k] != v]
        if differ:
            raise ValueError(f"this LR coupling state was saved with other settings ({'; '.join(differ)}); build it "
                             "with the run's own (LRCoupling(base_batch_size=..., rule=..., knee=...); in Pilot and the "
                             "integrations base_batch_size=..., lr_rule=..., lr_knee=...) before loading.")
        self._factor = float(state["factor"])
        self._batch_size = None if state.get("batch_size") is None else int(state["batch_size"])
        self._scaled = bool(state["scaled"])
        self._unscaled_lrs = [float(x) for x in state.get("unscaled_lrs", [])]
        self._written_lrs = [float(x) for x in state.get("written_lrs", [])]
